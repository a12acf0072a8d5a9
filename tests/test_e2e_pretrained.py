"""A user's pretrained backbone through shipped configs, end to end.

An official FLatten-PVTv2-b0 ImageNet checkpoint (the official key layout of
``../shared/spec/state_dict_keys/flatten_pvt_v2_b0.txt``, classification head included,
values written by the test) is converted by ``tools/convert_checkpoint.py`` and named in
the backbone's ``init_cfg=dict(type='Pretrained', checkpoint=...)`` of a shipped
RetinaNet config and a shipped Semantic FPN config. After the detector / segmentor's own
``init_weights()`` -- built directly, and built by mmengine's ``Runner`` and initialised
the way ``Runner.train`` does -- and after one ``tools/train.py`` iteration (learning rate
0, so the step leaves the weights as loaded), the backbone holds exactly the written
weights. A backbone that skips its ``init_weights`` inside a model (mmengine skips a
child whose ``is_init`` is set) trains from random weights without an error; these tests
are what notices it.
"""
import importlib.util
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, load_key_listing
from official_layouts import to_official_pvt_keys

DET = osp.join(REPO_ROOT, 'configs/mmdet/flatten_pvt_v2/retinanet_flatten-pvt-v2-b0_fpn_1x_coco.py')
SEG = osp.join(REPO_ROOT,
               'configs/mmseg/flatten_pvt_v2/fpn_flatten-pvt-v2-b0_4xb4-80k_ade20k-512x512.py')
SEG_QUICKSTART = osp.join(REPO_ROOT,
                          'configs/quickstart/fpn_flatten-pvt-v2-b0_quickstart_ade20k-mini.py')


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
    """``(converted file, backbone state dict it must give)``: every tensor of a
    FLatten-PVTv2-b0 (initialised with another seed than the suite's, then perturbed so
    that no two LayerNorms are alike) written in the official layout and converted by the
    tool."""
    official = load_key_listing('flatten_pvt_v2_b0')  # skips when ../shared is absent
    from flatten_mm.models import FLattenPVTv2
    source = FLattenPVTv2('b0')
    torch.manual_seed(1234)
    source.init_weights()
    expected = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v.clone()
                for k, v in source.state_dict().items()}
    backbone = to_official_pvt_keys(expected)
    assert set(backbone) <= set(official), sorted(set(backbone) - set(official))[:5]
    extra = set(official) - set(backbone)
    assert extra and all(k.startswith('head.') for k in extra), sorted(extra)
    for k in extra:  # the classification head the converter drops
        official[k] = torch.randn(official[k].shape)
    official.update(backbone)
    tmp = tmp_path_factory.mktemp('pretrained')
    src, dst = str(tmp / 'flatten_pvt_v2_b0.pth'), str(tmp / 'flatten-pvt-v2-b0_converted.pth')
    torch.save({'model': official}, src)
    spec = importlib.util.spec_from_file_location(
        'convert_checkpoint', osp.join(REPO_ROOT, 'tools', 'convert_checkpoint.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([src, dst, '--arch', 'b0']) == 0
    return dst, expected


def assert_backbone_holds(backbone_state, expected):
    assert set(backbone_state) == set(expected)
    differ = [k for k, v in expected.items() if not torch.equal(backbone_state[k], v)]
    assert not differ, f'{len(differ)} of {len(expected)} tensors are not the checkpoint\'s: ' \
        f'{differ[:5]}'


def config_with_checkpoint(path, checkpoint):
    from mmengine.config import Config
    cfg = Config.fromfile(path)
    assert cfg.model.backbone.init_cfg.type == 'Pretrained'  # as shipped
    cfg.model.backbone.init_cfg.checkpoint = checkpoint
    return cfg


@pytest.mark.parametrize('config', [DET, SEG], ids=['retinanet', 'semantic-fpn'])
def test_model_init_weights_loads_the_converted_checkpoint(pretrained, config):
    """The detector / segmentor's ``init_weights()`` (mmengine's, over all children)
    puts the file's weights into the backbone; before it, none is there."""
    path, expected = pretrained
    cfg = config_with_checkpoint(config, path)
    scope = cfg.default_scope
    pytest.importorskip(scope)
    from mmengine.registry import init_default_scope
    init_default_scope(scope)
    registry = importlib.import_module(f'{scope}.registry')
    model = registry.MODELS.build(cfg.model)
    built = model.backbone.state_dict()  # the constructors' weights: none is the file's
    assert not [k for k, v in expected.items()
                if v.is_floating_point() and torch.equal(built[k], v)]
    model.init_weights()
    assert_backbone_holds(model.backbone.state_dict(), expected)


@pytest.mark.parametrize('config', [DET, SEG], ids=['retinanet', 'semantic-fpn'])
def test_runner_built_model_loads_the_converted_checkpoint(pretrained, config, tmp_path):
    """mmengine's Runner builds the model from the config and initialises it as
    ``Runner.train`` does (``_init_model_weights``, before loading or resuming)."""
    path, expected = pretrained
    cfg = config_with_checkpoint(config, path)
    pytest.importorskip(cfg.default_scope)
    from mmengine.runner import Runner
    cfg.work_dir = str(tmp_path)
    cfg.experiment_name = f'pretrained_{osp.basename(config)[:-3]}_{os.getpid()}'
    runner = Runner.from_cfg(cfg)
    runner._init_model_weights()
    assert_backbone_holds(runner.model.backbone.state_dict(), expected)


def test_train_script_starts_from_the_converted_checkpoint(pretrained, tmp_path):
    """``tools/train.py`` on the Semantic FPN quick-start config (bundled ADE20K images)
    with the Pretrained backbone: after one iteration at learning rate 0 the saved
    checkpoint's backbone is the converted one, tensor for tensor."""
    pytest.importorskip('mmseg')
    path, expected = pretrained
    config = tmp_path / 'pretrained_quickstart.py'
    config.write_text(f'_base_ = {SEG_QUICKSTART!r}\n'
                      'model = dict(backbone=dict(init_cfg=dict(\n'
                      f"    _delete_=True, type='Pretrained', checkpoint={path!r})))\n")
    work = tmp_path / 'work'
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run(
        [sys.executable, 'tools/train.py', str(config), '--work-dir', str(work),
         '--cfg-options', 'train_cfg.max_iters=1', 'train_cfg.val_interval=1000',
         'default_hooks.checkpoint.interval=1', 'optim_wrapper.optimizer.lr=0.0',
         'default_hooks.logger.interval=1'],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ckpt = torch.load(str(work / 'iter_1.pth'), map_location='cpu', weights_only=False)
    assert ckpt['meta']['iter'] == 1
    state = {k[len('backbone.'):]: v for k, v in ckpt['state_dict'].items()
             if k.startswith('backbone.')}
    assert_backbone_holds(state, expected)
