"""The GPU user's training path, run on the CPU: every backbone family in the kernels' auto
mode, through the CUDA branch of the dispatch, under every training feature users switch on.

The Triton kernels run under Triton's interpreter on CPU tensors and the dispatch's auto
mode treats ``cpu`` as ``cuda`` (``emulated_gpu``), so the code a GPU runs -- the gates,
the first-use checks (in their own thread), the fallbacks, the kernels and their autograd
-- runs here. The interpreter proves logic and integration, not hardware behaviour:
``scripts/gpu_session.sh`` runs this file on a real GPU too (``FLATTEN_MM_TEST_DEVICE=cuda``:
the compiled kernels on CUDA tensors, the same assertions).

Each case takes one training step (forward, a loss that is a fixed random projection of
every output, backward) and asserts: nothing raised, no warning of ours (a failed
first-use check or a kernel fallback would warn), every first-use verdict made is a pass
(for the families with kernels at least one was made), and the parameter gradients equal
those of the PyTorch path (``FLATTEN_MM_TRITON=0``, CPU kernels off: what a GPU falls back
to). Gradients are compared as one vector (relative L2 norm over every parameter):

* float32: within 1e-5 (both paths compute in float32; measured up to 2e-6);
* bf16 / fp16 autocast: both paths run the linear layers in the half dtype, whose own
  rounding moves the gradients by 1e-3 - 2e-1 from float32 on these tiny models (the
  paths round at different places: the kernels once per fused output, the PyTorch path
  per op); the kernels' gradients must be no further from the float32 ones than 3x the
  PyTorch path's (measured 0.6x - 2.1x over the families). An integration error of
  autocast (a lost cast, a gradient in the wrong dtype) moves them by O(1); the float32
  cases hold the kernels' own arithmetic to 1e-5.

``torch.compile``: with the kernels, Dynamo traces the whole training forward as one graph
(``fullgraph=True``) with the dispatch's decisions as constants; the graph runs eagerly
(backend ``eager``: Triton's interpreter cannot be traced by AOT autograd, which reads
tensor memory at trace time). On the PyTorch path (``compile-pytorch``) AOT autograd
traces forward and backward (``aot_eager``, ``fullgraph=True``) and must give eager's
gradients.
"""
import contextlib
import os
import threading
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import backbone_specs as specs
from conftest import import_interpreted

if os.environ.get('FLATTEN_MM_TEST_DEVICE', 'cpu') == 'cpu':
    import_interpreted('flatten_mm.models.ops.fla_triton',
                       'flatten_mm.models.ops.quadtree_triton')
from flatten_mm.models.ops import dispatch  # noqa: E402
from flatten_mm.models.ops import quadtree_cpu  # noqa: E402

#: family -> (registered class, constructor overrides); tiny arches of ``backbone_specs``
FAMILIES = {
    'flatten-pvt': ('FLattenPVT', {}),
    'flatten-pvt-v2': ('FLattenPVTv2', {}),
    'flatten-swin': ('FLattenSwin', {}),
    'flatten-cswin': ('FLattenCSWin', {}),
    'sima-xcit': ('SimAXCiT', {}),
    'quadtree-b': ('QuadTreePVTv2', {}),
    'quadtree-a': ('QuadTreePVTv2', dict(attn_cfg=dict(topk=4, attn_type='A'))),
    'hybrid-pvt-v2': ('PVTv2', dict(attn_cfg=[
        dict(type='QuadTreeAttention', num_levels=3, topk=4),
        dict(type='FocusedLinearAttention'), dict(type='SimAAttention'), dict(sr_ratio=1)])),
}
#: families whose operators have no Triton kernels (the auto mode must still change nothing)
NO_KERNELS = {'sima-xcit'}
#: family -> the kernel operators (first-use key names) its training step must run, at
#: float32 and at each autocast dtype
KERNEL_OPS = {
    'flatten-pvt': {'fla_projected'},
    'flatten-pvt-v2': {'fla_projected'},
    'flatten-swin': {'fla_projected'},
    'flatten-cswin': {'fla_core'},
    'quadtree-b': {'qt_scores', 'qt_final_b'},
    'quadtree-a': {'qt_scores', 'qt_messages', 'qt_final_a'},
    'hybrid-pvt-v2': {'qt_scores', 'qt_final_b', 'fla_projected'},
}
#: the first-use check's thread (``dispatch.run_isolated``)
CHECK_THREAD = 'flatten_mm-first-use-check'
FEATURES = ['plain', 'with_cp', 'frozen_stages', 'bf16', 'fp16', 'compile', 'compile-pytorch']
AMP = {'bf16': torch.bfloat16, 'fp16': torch.float16}
INPUT_HW = (64, 64)
#: ``cpu`` (emulated: the interpreted kernels) or ``cuda`` (a real GPU, gpu_session.sh)
DEVICE = os.environ.get('FLATTEN_MM_TEST_DEVICE', 'cpu')
if DEVICE not in ('cpu', 'cuda'):
    raise ValueError(f'FLATTEN_MM_TEST_DEVICE={DEVICE!r}: cpu or cuda')
if DEVICE == 'cuda' and not torch.cuda.is_available():
    pytest.fail('FLATTEN_MM_TEST_DEVICE=cuda but CUDA is not available',
                pytrace=False)


@pytest.fixture
def emulated_gpu(monkeypatch):
    """The kernels allowed and a fresh dispatch; on the CPU, Triton's interpreter on and
    the auto mode considering CPU tensors (as it does CUDA ones)."""
    monkeypatch.delenv('FLATTEN_MM_TRITON', raising=False)
    if DEVICE == 'cpu':
        monkeypatch.setenv('TRITON_INTERPRET', '1')
        monkeypatch.setattr(dispatch, 'AUTO_DEVICE_TYPES', ('cuda', 'cpu'))
    else:  # (the tests' float32 tolerances need float32 matmuls)
        monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
        monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    dispatch.reset()
    yield
    dispatch.reset()


def build(family: str, **overrides) -> torch.nn.Module:
    name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    return specs.build(name, **kwargs, **overrides).train().to(DEVICE)


def train_step(model, x, amp=None, compiled=None):
    """Parameter gradients of one step with a fixed loss: a random projection of every
    output (not a norm-invariant one: the outputs' LayerNorms make ``sum(out ** 2)``
    nearly constant, whose gradients are rounding noise)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # (drop path)
    fn = model if compiled is None else torch.compile(model, fullgraph=True, **compiled)
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        outs = fn(x)
    gen = torch.Generator().manual_seed(2)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
               for o in outs)
    loss.backward()
    if compiled is not None:
        torch._dynamo.reset()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


@contextlib.contextmanager
def pytorch_path():
    """What a GPU falls back to: ``FLATTEN_MM_TRITON=0`` and the QuadTree CPU kernels
    off (they are a CPU fast path, not the GPU's fallback)."""
    old = os.environ.get(dispatch.TRITON_ENV)
    os.environ[dispatch.TRITON_ENV] = '0'
    try:
        with quadtree_cpu.use_cpu_kernels(False):
            yield
    finally:
        if old is None:
            del os.environ[dispatch.TRITON_ENV]
        else:
            os.environ[dispatch.TRITON_ENV] = old


def relative(grads, ref) -> float:
    """``||grads - ref|| / ||ref||`` over every parameter (the same parameters required)."""
    assert grads.keys() == ref.keys()
    num = sum(((grads[n].double() - ref[n].double()) ** 2).sum() for n in ref)
    den = sum((ref[n].double() ** 2).sum() for n in ref)
    return float((num / den).sqrt())


@contextlib.contextmanager
def no_warnings_of_ours():
    """Fail on any RuntimeWarning and on any warning from flatten_mm (a failed check, a
    fallback, a refused kernel all warn)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        yield
    ours = [f'{w.category.__name__}: {w.message}' for w in caught
            if issubclass(w.category, RuntimeWarning) or 'flatten_mm' in str(w.message)
            or 'flatten_mm' in (w.filename or '')]
    assert not ours, ours


class KernelLaunches:
    """Stands in for ``torch.library.wrap_triton`` and records, for every Triton launch
    the step makes itself (not a first-use check's thread), the kernel and the dtypes of
    its tensor arguments."""

    def __init__(self):
        self.real = torch.library.wrap_triton
        self.launches = set()

    def __call__(self, kernel):
        wrapped, recorder = self.real(kernel), self

        class Grid:
            def __getitem__(self, grid):
                launch = wrapped[grid]

                def run(*args, **kwargs):
                    if threading.current_thread().name != CHECK_THREAD:
                        dtypes = frozenset(str(a.dtype).replace('torch.', '') for a in args
                                           if isinstance(a, torch.Tensor))
                        recorder.launches.add((kernel.__name__, dtypes))
                    return launch(*args, **kwargs)
                return run
        return Grid()


def assert_kernels_served(family: str, amp=None, launches=None):
    """Every verdict made passed; a family with kernels has a passing verdict for each
    of its operators at the step's dtype (``amp``: the autocast dtype; a kernel that
    declined it would leave the PyTorch path compared with itself) and, where
    ``launches`` recorded them, kernels ran in the step on tensors of that dtype."""
    verdicts = dispatch.verdicts()
    assert all(verdicts.values()), {k: v for k, v in verdicts.items() if not v}
    if family in NO_KERNELS:
        assert not verdicts, verdicts  # (no operator of it has kernels)
        return
    dtype = 'float32' if amp is None else str(amp).replace('torch.', '')
    # (the key holds the output dtype and every input's layout with its dtype: QuadTree's
    # queries stay float32 under autocast, its keys and values reach the kernels in it)
    passed = {key[0] for (_, _, key), ok in verdicts.items() if ok and dtype in repr(key)}
    missing = KERNEL_OPS[family] - passed
    assert not missing, (f'no passing {dtype} verdict for {sorted(missing)}: the kernels '
                         f'did not serve them', sorted({k[2][:2] for k in verdicts}))
    if launches is not None:
        ran = {name for name, dtypes in launches.launches if dtype in dtypes}
        assert ran, f'no kernel ran in the step on {dtype} tensors: {launches.launches}'


@pytest.mark.timeout(900)
@pytest.mark.parametrize('feature', FEATURES)
@pytest.mark.parametrize('family', list(FAMILIES))
def test_training_step_through_the_kernels(emulated_gpu, monkeypatch, family, feature):
    overrides = {'with_cp': dict(with_cp=True), 'frozen_stages': dict(frozen_stages=1)}
    model = build(family, **overrides.get(feature, {}))
    x = torch.randn(2, 3, *INPUT_HW, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    amp = AMP.get(feature)
    if feature == 'compile-pytorch':
        with pytorch_path():
            eager = train_step(model, x)
            with no_warnings_of_ours():
                got = train_step(model, x, compiled=dict(backend='aot_eager'))
        assert relative(got, eager) <= 1e-5
        return
    # (Triton's interpreter cannot be traced by AOT autograd: eagerly run graphs on the
    # CPU, Inductor on a GPU)
    backend = 'eager' if DEVICE == 'cpu' else 'inductor'
    launches = None
    if amp is not None:
        launches = KernelLaunches()
        monkeypatch.setattr(torch.library, 'wrap_triton', launches)
    with no_warnings_of_ours():
        got = train_step(model, x, amp,
                         compiled=dict(backend=backend) if feature == 'compile' else None)
    if launches is not None:
        monkeypatch.setattr(torch.library, 'wrap_triton', launches.real)
    assert_kernels_served(family, amp, launches)
    with pytorch_path():
        ref = train_step(model, x, amp)
    if feature == 'frozen_stages':
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert frozen and not frozen & got.keys()
    if amp is None:
        assert relative(got, ref) <= 1e-5
    else:
        with pytorch_path():
            full = train_step(model, x)
        assert relative(got, full) <= 3 * relative(ref, full), (relative(got, full),
                                                                relative(ref, full))


@pytest.mark.parametrize('family', list(FAMILIES))
def test_backbone_use_triton_false_turns_every_kernel_off(emulated_gpu, family):
    """The one switch-off key every backbone accepts, as a config gives it
    (``backbone=dict(..., use_triton=False)``): in the auto mode that would otherwise run
    the kernels, no first-use check is made (no kernel considered), nothing warns, and the
    gradients are the PyTorch path's."""
    model = build(family, use_triton=False)
    x = torch.randn(2, 3, *INPUT_HW, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with no_warnings_of_ours():
        got = train_step(model, x)
    assert dispatch.verdicts() == {}
    with pytorch_path():
        ref = train_step(model, x)
    assert relative(got, ref) <= 1e-6
