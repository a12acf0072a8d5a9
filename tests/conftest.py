"""Shared test settings: seeds, thread count, the location of ../shared, Triton's
interpreter."""
import os
import os.path as osp

# Triton decides when a function is decorated -- its own standard library (``tl.sum``,
# ``tl.zeros``, ...) when ``triton`` is first imported -- whether kernels are interpreted.
# torch.compile tests import triton long before tests/test_layers/test_fla_triton.py, and
# interpreted kernels cannot call compiled-mode library functions, so the whole suite runs
# with the interpreter on (it changes nothing for CPU code; real GPU checks are
# benchmarks/gpu_kernel_check.py, not this suite).
os.environ.setdefault('TRITON_INTERPRET', '1')

import pytest  # noqa: E402
import torch  # noqa: E402

# parallel workers (scripts/run_tests.sh) share the cores instead of each taking all of them
if os.environ.get('PYTEST_XDIST_WORKER_COUNT'):
    torch.set_num_threads(max(1, torch.get_num_threads()
                              // int(os.environ['PYTEST_XDIST_WORKER_COUNT'])))

# in CI (CI / FLATTEN_MM_REQUIRE_ALL set) a skip for a missing mmdet / mmseg / mmcv /
# onnxruntime / triton fails instead (tests/required_packages.py)
from required_packages import (pytest_make_collect_report,  # noqa: E402,F401
                               pytest_runtest_makereport)

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SHARED_DIR = os.environ.get('FLATTEN_MM_SHARED', osp.join(osp.dirname(REPO_ROOT), 'shared'))
FIXTURES_DIR = osp.join(SHARED_DIR, 'fixtures')


def shared_fixtures(pattern: str = '*.pt'):
    """Fixture files of ../shared/fixtures matching ``pattern`` (empty when absent)."""
    import glob
    return sorted(glob.glob(osp.join(FIXTURES_DIR, pattern)))


def requires_shared():
    return pytest.mark.skipif(
        not osp.isdir(FIXTURES_DIR),
        reason=f'golden fixtures not found at {FIXTURES_DIR} (../shared is only present in the '
        'development/CI checkout; set FLATTEN_MM_SHARED to point elsewhere)')


def import_interpreted(*names: str) -> list:
    """Import the modules ``names`` with ``TRITON_INTERPRET=1`` (Triton decides when a
    kernel is decorated, i.e. when its module is imported, whether it is interpreted), then
    restore the variable. Without Triton this raises: kernel tests fail, never skip."""
    import importlib
    previous = os.environ.get('TRITON_INTERPRET')
    os.environ['TRITON_INTERPRET'] = '1'
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        if previous is None:
            del os.environ['TRITON_INTERPRET']
        else:
            os.environ['TRITON_INTERPRET'] = previous


@pytest.fixture
def triton_interpreter(monkeypatch):
    """``TRITON_INTERPRET=1`` while a test runs (the interpreter also reads it when a kernel
    runs) and the ``FLATTEN_MM_TRITON`` switch unset (kernels allowed)."""
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    monkeypatch.delenv('FLATTEN_MM_TRITON', raising=False)
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

KEY_LISTINGS_DIR = osp.join(SHARED_DIR, 'spec', 'state_dict_keys')

_DTYPES = {'float32': torch.float32, 'int64': torch.int64, 'float64': torch.float64}


def load_key_listing(name: str):
    """A zero-filled official state dict built from ``spec/state_dict_keys/<name>.txt``
    (key, shape and dtype of every entry); skips the test when ../shared is absent."""
    path = osp.join(KEY_LISTINGS_DIR, f'{name}.txt')
    if not osp.isfile(path):
        pytest.skip(f'official key listing {path} not found (../shared absent)')
    state = {}
    with open(path) as f:
        for line in f:
            if line.startswith('#') or not line.strip():
                continue
            key, shape, dtype = line.rstrip('\n').split('\t')
            dims = [int(s) for s in shape.strip('[]').split(',') if s.strip()]
            state[key] = torch.zeros(dims, dtype=_DTYPES[dtype])
    return state


@pytest.fixture
def official_listing():
    """Fixture form of ``load_key_listing`` (call it with the listing name)."""
    return load_key_listing


def assert_checkpointing_matches(ref: torch.nn.Module, cp: torch.nn.Module, x: torch.Tensor):
    """``cp`` (built with ``with_cp=True``, same weights as ``ref``) gives the same outputs
    and the same parameter gradients as ``ref`` on ``x``."""
    out_ref, out_cp = ref(x), cp(x)
    for a, b in zip(out_ref, out_cp):
        torch.testing.assert_close(a, b)
    sum(o.sum() for o in out_cp).backward()
    g_cp = {n: p.grad.clone() for n, p in cp.named_parameters()}
    sum(o.sum() for o in out_ref).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, g_cp[n], rtol=1e-4, atol=1e-6)
