"""How ``scripts/setup_env.sh`` decides mmcv's ops (``scripts/mmcv_ops.py``): every
combination of torch build, nvcc, visible GPU and switch, mocked; and the check after
install on this machine."""
import importlib.util
import os.path as osp
import subprocess

import pytest

from conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location(
    'mmcv_ops', osp.join(REPO_ROOT, 'scripts', 'mmcv_ops.py'))
mmcv_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mmcv_ops)
plan = mmcv_ops.plan

TORCH_ARCHES = ['sm_75', 'sm_80', 'sm_86', 'sm_90', 'sm_100', 'sm_120']
NVCC = '/usr/local/cuda-13.0/bin/nvcc'


def test_cpu_torch_builds_cpu_ops():
    p = plan('2.14.1', None, [], None, None, {})
    assert (p.ops, p.tag, p.error, p.env) == ('cpu', 'cpu', None, {})


@pytest.mark.parametrize('gpu', [[], ['9.0']], ids=['no-gpu', 'gpu'])
def test_cuda_torch_builds_cuda_ops_whether_or_not_a_gpu_is_visible(gpu):
    """``FORCE_CUDA=1`` either way, ``CUDA_HOME`` at nvcc's toolkit; the architectures of
    the visible GPU, else every one torch was built for (torch's builder finds none by
    itself without a GPU); the cache tag carries the CUDA version and the architectures."""
    p = plan('2.14.1', '13.0', gpu, NVCC, '13.0', {}, TORCH_ARCHES)
    assert p.error is None and p.ops == 'cuda'
    assert p.env['FORCE_CUDA'] == '1' and p.env['CUDA_HOME'] == '/usr/local/cuda-13.0'
    if gpu:
        assert p.env['TORCH_CUDA_ARCH_LIST'] == '9.0' and p.tag == 'cu130-sm90'
    else:
        assert p.env['TORCH_CUDA_ARCH_LIST'] == '7.5;8.0;8.6;9.0;10.0;12.0'
        assert p.tag == 'cu130-sm75-sm80-sm86-sm90-sm100-sm120'
        assert any('no GPU visible' in n for n in p.notes)


def test_arch_list_from_the_environment_wins():
    p = plan('2.14.1', '12.8', ['8.6'], NVCC, '12.8',
             {'TORCH_CUDA_ARCH_LIST': '8.0;9.0+PTX'}, TORCH_ARCHES)
    assert p.env['TORCH_CUDA_ARCH_LIST'] == '8.0;9.0+PTX' and p.tag == 'cu128-sm80-sm90ptx'


def test_cache_tags_differ_between_flavours():
    """A wheel built on a machine without a GPU is never reused for another flavour."""
    tags = {plan('2.14.1', None, [], None, None, {}).tag,
            plan('2.14.1', '13.0', [], NVCC, '13.0', {'FLATTEN_MM_MMCV_OPS': 'cpu'}).tag,
            plan('2.14.1', '13.0', ['9.0'], NVCC, '13.0', {}).tag,
            plan('2.14.1', '12.8', ['9.0'], NVCC, '12.8', {}).tag}
    assert tags == {'cpu', 'cu130-sm90', 'cu128-sm90'}


def test_missing_nvcc_stops_before_the_build_with_what_to_install():
    p = plan('2.14.1', '13.0', ['9.0'], None, None, {}, TORCH_ARCHES)
    assert p.error and 'nvcc' in p.error and 'CUDA_HOME' in p.error and '13.0' in p.error
    assert 'FLATTEN_MM_MMCV_OPS=cpu' in p.error


def test_nvcc_of_another_cuda_major_stops():
    p = plan('2.14.1', '13.0', [], '/usr/local/cuda-12.4/bin/nvcc', '12.4', {}, TORCH_ARCHES)
    assert p.error and 'CUDA 13.0' in p.error and '12.4' in p.error


def test_cpu_switch_on_a_cuda_torch():
    p = plan('2.14.1', '13.0', [], None, None, {'FLATTEN_MM_MMCV_OPS': 'cpu'}, TORCH_ARCHES)
    assert (p.ops, p.tag, p.error) == ('cpu', 'cpu', None)
    refused = plan('2.14.1', '13.0', ['9.0'], NVCC, '13.0', {'FLATTEN_MM_MMCV_OPS': 'cpu'})
    assert refused.error and 'GPU is visible' in refused.error


@pytest.mark.parametrize('value,match', [('gpu', 'say cuda or cpu'), ('cuda', 'CPU build')])
def test_bad_switches(value, match):
    assert match in plan('2.14.1', None, [], None, None, {'FLATTEN_MM_MMCV_OPS': value}).error


def test_plan_prints_shell_assignments():
    p = plan('2.14.1', '13.0', ['9.0'], NVCC, '13.0', {})
    out = subprocess.run(['bash', '-c', p.shell() + '\necho "$MMCV_OPS $MMCV_TAG $FORCE_CUDA"'],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == 'cuda cu130-sm90 1'


def test_find_nvcc_order():
    files = {'/opt/cuda/bin/nvcc', '/usr/local/cuda-13.0/bin/nvcc',
             '/usr/local/cuda-13.0/include/cuda.h', '/usr/local/cuda/bin/nvcc'}
    exists = files.__contains__
    find = mmcv_ops.find_nvcc
    assert find({'CUDA_HOME': '/opt/cuda'}, lambda n: None, exists) == '/opt/cuda/bin/nvcc'
    # nvcc on PATH inside a toolkit
    assert find({}, lambda n: '/usr/local/cuda-13.0/bin/nvcc', exists,
                lambda p: p) == '/usr/local/cuda-13.0/bin/nvcc'
    # a wrapper script on PATH (no toolkit around it): the default toolkit
    assert find({}, lambda n: '/usr/local/bin/nvcc', exists,
                lambda p: p) == '/usr/local/cuda/bin/nvcc'
    assert find({}, lambda n: None, lambda p: False) is None


def test_nvcc_version_parsing():
    class Out:
        stdout = ('nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, '
                  'release 13.0, V13.0.88\nBuild cuda_13.0.r13.0/compiler.36424714_0\n')
    assert mmcv_ops.nvcc_version('nvcc', run=lambda *a, **k: Out) == '13.0'

    def fails(*a, **k):
        raise FileNotFoundError('nvcc')
    assert mmcv_ops.nvcc_version('nvcc', run=fails) is None


def test_installed_mmcv_serves_this_machine():
    """The check ``setup_env.sh`` runs after install: mmcv's nms and RoIAlign on the CPU
    (and on a visible GPU); a CPU-only mmcv where a GPU is visible fails it."""
    pytest.importorskip('mmcv.ops')
    assert mmcv_ops.verify() == []
    assert mmcv_ops.mmcv_flavour() in ('cpu', 'cuda')


def test_cpu_only_mmcv_meeting_a_gpu_fails_verify(monkeypatch):
    pytest.importorskip('mmcv.ops')
    import torch
    monkeypatch.setattr(mmcv_ops, 'mmcv_flavour', lambda: 'cpu')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    problems = mmcv_ops.verify()
    assert any('built without CUDA ops' in p for p in problems), problems
    assert any('expected cuda' in p for p in mmcv_ops.verify('cuda'))
