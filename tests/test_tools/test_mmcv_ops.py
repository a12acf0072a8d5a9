"""How ``scripts/setup_env.sh`` decides mmcv's ops (``scripts/mmcv_ops.py``): every
combination of torch build, nvcc, visible GPU and switch, mocked; and the check after
install on this machine."""
import importlib.util
import os
import os.path as osp
import subprocess
import sys

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
    p = plan('2.14.1', None, [], None, None, {}, cpus=2, mem_gib=22)
    assert (p.ops, p.tag, p.error, p.env) == ('cpu', 'cpu', None, {'MAX_JOBS': '2'})


def test_no_gpu_visible_builds_cpu_ops_and_says_how_to_get_cuda_ops():
    """A CUDA build of torch (what PyPI gives on x86_64) on a machine without a visible GPU,
    nvcc installed or not: the CPU ops, no CUDA build for every architecture."""
    for nvcc, ver in ((NVCC, '13.0'), (None, None)):
        p = plan('2.14.1', '13.0', [], nvcc, ver, {}, TORCH_ARCHES)
        assert (p.ops, p.tag, p.error) == ('cpu', 'cpu', None)
        assert 'FORCE_CUDA' not in p.env and 'TORCH_CUDA_ARCH_LIST' not in p.env
        assert any('no GPU visible' in n and 'FLATTEN_MM_MMCV_OPS=cuda' in n for n in p.notes)


def test_a_visible_gpu_gets_cuda_ops_for_its_architecture():
    p = plan('2.14.1', '13.0', ['9.0', '9.0'], NVCC, '13.0', {}, TORCH_ARCHES)
    assert p.error is None and p.ops == 'cuda'
    assert p.env['FORCE_CUDA'] == '1' and p.env['CUDA_HOME'] == '/usr/local/cuda-13.0'
    assert p.env['TORCH_CUDA_ARCH_LIST'] == '9.0' and p.tag == 'cu130-sm90'


def test_cuda_ops_without_a_gpu_are_an_explicit_request():
    """A login node or image builder: FLATTEN_MM_MMCV_OPS=cuda builds for
    TORCH_CUDA_ARCH_LIST, else every architecture torch was built for (torch's builder
    finds none by itself without a GPU)."""
    p = plan('2.14.1', '13.0', [], NVCC, '13.0', {'FLATTEN_MM_MMCV_OPS': 'cuda'}, TORCH_ARCHES)
    assert p.error is None and p.ops == 'cuda' and p.env['FORCE_CUDA'] == '1'
    assert p.env['TORCH_CUDA_ARCH_LIST'] == '7.5;8.0;8.6;9.0;10.0;12.0'
    assert p.tag == 'cu130-sm75-sm80-sm86-sm90-sm100-sm120'
    assert any('no GPU visible' in n and 'TORCH_CUDA_ARCH_LIST' in n for n in p.notes)
    one = plan('2.14.1', '13.0', [], NVCC, '13.0',
               {'FLATTEN_MM_MMCV_OPS': 'cuda', 'TORCH_CUDA_ARCH_LIST': '9.0'}, TORCH_ARCHES)
    assert one.tag == 'cu130-sm90' and not any('every architecture' in n for n in one.notes)
    missing = plan('2.14.1', '13.0', [], None, None, {'FLATTEN_MM_MMCV_OPS': 'cuda'})
    assert missing.error and 'nvcc' in missing.error and 'FLATTEN_MM_MMCV_OPS=cuda' in missing.error


def test_the_plan_for_this_machine_without_any_switch():
    """This machine's real facts, no switch and nothing remembered: what a newcomer's
    `bash scripts/quickstart.sh` builds here. Without a visible GPU that is the CPU ops
    (whether or not nvcc is installed); with one, its CUDA ops or a stop before the build."""
    pytest.importorskip('torch')
    import torch
    env = {k: v for k, v in os.environ.items()
           if k not in ('FLATTEN_MM_MMCV_OPS', 'TORCH_CUDA_ARCH_LIST')}
    p = plan(**mmcv_ops._facts(env), env=env, remembered=None)
    if not torch.cuda.is_available():
        assert (p.ops, p.tag, p.error) == ('cpu', 'cpu', None)
        assert 'FORCE_CUDA' not in p.env
    else:
        assert p.ops == 'cuda' or (p.error and 'nvcc' in p.error)


def test_a_remembered_switch_is_used_and_named():
    """`python scripts/mmcv_ops.py plan` and setup_env.sh read the switch the environment
    remembers; every message that depends on it names the file and how to clear it."""
    mem = ('cpu', '/work/.venv/.flatten_mm_mmcv_ops')
    p = plan('2.14.1', '13.0', [], NVCC, '13.0', {}, TORCH_ARCHES, remembered=mem)
    assert p.ops == 'cpu' and any(mem[1] in n and 'delete' in n for n in p.notes)
    refused = plan('2.14.1', '13.0', ['9.0'], NVCC, '13.0', {}, TORCH_ARCHES, remembered=mem)
    assert refused.error and mem[1] in refused.error and 'GPU is visible' in refused.error
    cuda = plan('2.14.1', '13.0', [], NVCC, '13.0', {}, TORCH_ARCHES,
                remembered=('cuda', mem[1]))
    assert cuda.ops == 'cuda' and any(mem[1] in n for n in cuda.notes)
    # the variable wins over the file
    over = plan('2.14.1', '13.0', [], NVCC, '13.0', {'FLATTEN_MM_MMCV_OPS': 'cuda'},
                TORCH_ARCHES, remembered=mem)
    assert over.ops == 'cuda' and not any(mem[1] in n for n in over.notes)


def test_remembered_choice_reads_the_environment_file(tmp_path):
    assert mmcv_ops.remembered_choice(str(tmp_path)) is None
    (tmp_path / '.flatten_mm_mmcv_ops').write_text('cuda\n')
    assert mmcv_ops.remembered_choice(str(tmp_path)) == (
        'cuda', str(tmp_path / '.flatten_mm_mmcv_ops'))


def test_plan_subcommand_reads_the_remembered_switch(tmp_path):
    """`python scripts/mmcv_ops.py plan` run by a venv's python uses what that venv
    remembers (sys.prefix), like setup_env.sh."""
    pytest.importorskip('torch')
    (tmp_path / '.flatten_mm_mmcv_ops').write_text('bogus\n')
    script = osp.join(REPO_ROOT, 'scripts', 'mmcv_ops.py')
    code = (f'import runpy, sys; sys.prefix = sys.argv[1]; sys.argv = ["mmcv_ops.py", "plan"]; '
            f'runpy.run_path({script!r}, run_name="__main__")')
    env = {k: v for k, v in os.environ.items() if k != 'FLATTEN_MM_MMCV_OPS'}
    proc = subprocess.run([sys.executable, '-c', code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert 'say cuda or cpu' in proc.stderr and str(tmp_path) in proc.stderr


@pytest.mark.parametrize('ops,cpus,mem,jobs', [
    ('cuda', 16, 120.0, 16), ('cuda', 16, 20.0, 5), ('cpu', 2, 22.0, 2), ('cpu', 64, 3.0, 2),
    ('cuda', 8, 1.0, 1), ('cpu', None, None, 1)])
def test_compile_jobs_use_the_cores_within_memory(ops, cpus, mem, jobs):
    assert mmcv_ops.compile_jobs(ops, cpus, mem) == jobs


def test_max_jobs_is_set_unless_given():
    p = plan('2.14.1', '13.0', ['9.0'], NVCC, '13.0', {}, TORCH_ARCHES, cpus=16, mem_gib=120)
    assert p.env['MAX_JOBS'] == '16'
    given = plan('2.14.1', '13.0', ['9.0'], NVCC, '13.0', {'MAX_JOBS': '3'}, TORCH_ARCHES,
                 cpus=16, mem_gib=120)
    assert 'MAX_JOBS' not in given.env and any('3 compile jobs' in n for n in given.notes)


def test_arch_list_from_the_environment_wins():
    p = plan('2.14.1', '12.8', ['8.6'], NVCC, '12.8',
             {'TORCH_CUDA_ARCH_LIST': '8.0;9.0+PTX'}, TORCH_ARCHES)
    assert p.env['TORCH_CUDA_ARCH_LIST'] == '8.0;9.0+PTX' and p.tag == 'cu128-sm80-sm90ptx'


def test_cache_tags_differ_between_flavours():
    """A wheel built on a machine without a GPU is never reused for another flavour."""
    tags = {plan('2.14.1', None, [], None, None, {}).tag,
            plan('2.14.1', '13.0', [], NVCC, '13.0', {}).tag,
            plan('2.14.1', '13.0', [], NVCC, '13.0', {'FLATTEN_MM_MMCV_OPS': 'cpu'}).tag,
            plan('2.14.1', '13.0', ['9.0'], NVCC, '13.0', {}).tag,
            plan('2.14.1', '12.8', ['9.0'], NVCC, '12.8', {}).tag}
    assert tags == {'cpu', 'cu130-sm90', 'cu128-sm90'}


def test_missing_nvcc_stops_before_the_build_with_what_to_install():
    p = plan('2.14.1', '13.0', ['9.0'], None, None, {}, TORCH_ARCHES)
    assert p.error and 'nvcc' in p.error and 'CUDA_HOME' in p.error and '13.0' in p.error
    assert 'FLATTEN_MM_MMCV_OPS=cpu' in p.error


def test_nvcc_of_another_cuda_major_stops():
    p = plan('2.14.1', '13.0', ['9.0'], '/usr/local/cuda-12.4/bin/nvcc', '12.4', {},
             TORCH_ARCHES)
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
    # what setup_env.sh installed is what the plan for this machine asks for
    env = dict(os.environ)
    expected = plan(**mmcv_ops._facts(env), env=env, remembered=mmcv_ops.remembered_choice())
    assert mmcv_ops.mmcv_flavour() == expected.ops


def test_cpu_only_mmcv_meeting_a_gpu_fails_verify(monkeypatch):
    pytest.importorskip('mmcv.ops')
    import torch
    monkeypatch.setattr(mmcv_ops, 'mmcv_flavour', lambda: 'cpu')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    problems = mmcv_ops.verify()
    assert any('built without CUDA ops' in p for p in problems), problems
    assert any('expected cuda' in p for p in mmcv_ops.verify('cuda'))
