"""tools/train.py's precision switches on a config that asks for AMP (SimA's ImageNet
recipe): ``--no-amp`` trains it in float32 here, and without it a machine without CUDA is
told so before the runner starts."""
import importlib.util
import os.path as osp

import pytest
import torch

from conftest import REPO_ROOT

SIMA = 'configs/mmpretrain/sima_xcit/sima-xcit-s12-p16_8xb128_in1k.py'


def _train_tool():
    spec = importlib.util.spec_from_file_location('train_tool',
                                                  osp.join(REPO_ROOT, 'tools', 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_amp_builds_a_float32_optimizer_wrapper():
    pytest.importorskip('mmpretrain')
    from mmengine.optim import OptimWrapper, build_optim_wrapper
    tool = _train_tool()
    cfg = tool.build_cfg(tool.parse_args([osp.join(REPO_ROOT, SIMA), '--no-amp']))
    assert cfg.optim_wrapper.type == 'OptimWrapper' and 'loss_scale' not in cfg.optim_wrapper
    wrapper = build_optim_wrapper(torch.nn.Linear(2, 2), cfg.optim_wrapper)
    assert type(wrapper) is OptimWrapper


@pytest.mark.skipif(torch.cuda.is_available(), reason='the refusal is for machines without CUDA')
def test_an_amp_config_without_cuda_names_no_amp():
    tool = _train_tool()
    with pytest.raises(SystemExit, match='--no-amp'):
        tool.build_cfg(tool.parse_args([osp.join(REPO_ROOT, SIMA)]))


def test_amp_and_no_amp_exclude_each_other():
    tool = _train_tool()
    with pytest.raises(SystemExit):
        tool.parse_args([SIMA, '--amp', '--no-amp'])
