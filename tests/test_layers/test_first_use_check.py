"""The first-use check wherever it is first called, the compiled specialisations it
proves, and the errors no fallback can survive.

* The check runs in a thread of its own: the caller's saved-tensor hooks (``with_cp``'s
  non-reentrant checkpoint, ``save_on_cpu``), anomaly mode, autocast, grad / inference
  mode, ``torch.func`` transforms and compile tracing neither change its verdict nor see
  its work; during CUDA-graph capture it does not run.
* Its key holds what selects a compiled Triton specialisation (alignment, size and stride
  classes) and its inputs reproduce them: every launch of a real call has the Triton
  specialisation of a launch of its check (Triton's own ``specialize_impl`` decides).
* A sticky CUDA error (illegal address, device-side assert) is re-raised, not "fallen
  back" from.
"""
import sys
import threading
import time
import warnings

import pytest
import torch
from conftest import import_interpreted

triton, fla_triton, qt_triton = import_interpreted(
    'triton', 'flatten_mm.models.ops.fla_triton', 'flatten_mm.models.ops.quadtree_triton')
from test_kernel_dispatch import (LAUNCHERS, OPERATORS, _input, _step,  # noqa: E402
                                  auto_on_cpu)

from flatten_mm.models.layers import QuadTreeAttention  # noqa: E402
from flatten_mm.models.layers import focused_linear_attention as fla  # noqa: E402
from flatten_mm.models.ops import dispatch, specialisation  # noqa: E402
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels  # noqa: E402
from flatten_mm.models.ops import quadtree_paths  # noqa: E402

pytestmark = pytest.mark.usefixtures('triton_interpreter', 'auto_on_cpu')
CHECK_THREAD = 'flatten_mm-first-use-check'


def _fla_operator():
    return OPERATORS['fla-pvt'][0]


def _verdicts_all_pass():
    v = dispatch.verdicts()
    return bool(v) and all(v.values())


# --------------------------------------------------------------------------- ambient state
def _checkpointed_step(make, x):
    """The operator under a non-reentrant checkpoint (what ``with_cp=True`` runs)."""
    m, hw = make(None)
    x = x.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(m, x, hw, use_reentrant=False)
    out.sum().backward()
    return out


@pytest.mark.parametrize('name', ['fla-pvt', 'fla-swin', 'quadtree-b'])
def test_check_inside_a_non_reentrant_checkpoint(name):
    """The first call of a configuration inside ``with_cp``'s checkpoint: the check
    passes, no warning, and the checkpoint's recomputation saves what the forward saved
    (before, the check's own graph was packed by the checkpoint's hooks: a
    ``CheckpointError`` at the first backward and a wrong "failed" verdict)."""
    make = OPERATORS[name][0]
    x = _input(make(False)[1])
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        _checkpointed_step(make, x)
    assert _verdicts_all_pass(), dispatch.verdicts()


class _CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that count what they pack, and in which thread."""

    def __init__(self):
        self.threads = []
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t):
        self.threads.append(threading.current_thread().name)
        return t


def _ambient_contexts():
    return {
        'saved-tensor hooks': _CountingHooks,
        'save_on_cpu': lambda: torch.autograd.graph.save_on_cpu(),
        'anomaly mode': lambda: torch.autograd.detect_anomaly(check_nan=True),
        'bf16 autocast': lambda: torch.autocast('cpu', dtype=torch.bfloat16),
        'no_grad': torch.no_grad,
        'inference_mode': torch.inference_mode,
    }


@pytest.mark.filterwarnings('ignore:Anomaly Detection has been enabled')
@pytest.mark.parametrize('context', list(_ambient_contexts()))
def test_check_is_independent_of_the_callers_context(context):
    """A check first run under the caller's context gives the verdict of a check run
    outside any, and nothing it records reaches the caller's hooks."""
    key = fla._fla_key('fla_core', *(torch.randn(2, 40, 16) for _ in range(3)), 2, 3, None,
                       None)
    ctx = _ambient_contexts()[context]()
    with ctx:
        passed = dispatch.verdict('fla', 'cpu', None, key)
    assert passed is True
    if isinstance(ctx, _CountingHooks):
        assert CHECK_THREAD not in ctx.threads


def test_check_under_a_torch_func_transform():
    """A configuration first met inside a ``torch.func`` transform (``grad``: the caller's
    tensors are wrapped, its autograd is the transform's) is checked outside it: the
    verdict passes and the transform's own result is unchanged."""
    key = fla._fla_key('fla_core', *(torch.randn(2, 40, 16) for _ in range(3)), 2, 3, None,
                       None)
    seen = []

    def f(x):
        seen.append(dispatch.verdict('fla', 'cpu', None, key))
        return (x ** 3).sum()

    x = torch.randn(5)
    torch.testing.assert_close(torch.func.grad(f)(x), 3 * x ** 2)
    assert seen == [True]


def test_no_check_during_cuda_graph_capture(monkeypatch):
    """While a stream captures a CUDA graph the check cannot run (it synchronises and
    allocates): the call takes the PyTorch path and nothing is cached, so the next eager
    call checks the configuration and uses the kernels."""
    calls = []
    real = dispatch._run_first_use_check
    monkeypatch.setattr(dispatch, '_run_first_use_check',
                        lambda *a: calls.append(a) or real(*a))
    key = fla._fla_key('fla_core', *(torch.randn(2, 40, 16) for _ in range(3)), 2, 3, None,
                       None)
    monkeypatch.setattr(dispatch, 'stream_capturing', lambda device: True)
    assert dispatch.verdict('fla', 'cpu', None, key) is False
    assert calls == [] and dispatch.verdicts() == {}
    monkeypatch.setattr(dispatch, 'stream_capturing', lambda device: False)
    assert dispatch.verdict('fla', 'cpu', None, key) is True
    assert len(calls) == 1


# --------------------------------------------------------------------------- one check per key
class _FakeCheck:
    """A first-use check that counts its runs and how many ran at once; ``hold()`` (a
    callable) decides when a run may end, and ``fail`` makes it raise."""

    def __init__(self, hold, fail=False):
        self.hold, self.fail = hold, fail
        self.runs = self.active = self.most_at_once = 0
        self._lock = threading.Lock()

    def __call__(self, key, device):
        with self._lock:
            self.runs += 1
            self.active += 1
            self.most_at_once = max(self.most_at_once, self.active)
        try:
            self.hold()
            if self.fail:
                raise ValueError('injected')
        finally:
            with self._lock:
                self.active -= 1


def _blocked_in_threading(threads) -> bool:
    """Whether each of ``threads`` has ended or waits inside ``threading`` (an event, a
    join): after entering ``verdict`` that is the only place a caller can wait."""
    frames = sys._current_frames()
    return all(not t.is_alive() or t.ident in frames and
               frames[t.ident].f_code.co_filename == threading.__file__ for t in threads)


def _until(condition, limit=30.0):
    end = time.monotonic() + limit  # (a safety limit: never reached when the code is right)
    while not condition() and time.monotonic() < end:
        time.sleep(0.001)


def _check_threads():
    return [t for t in threading.enumerate() if t.name == CHECK_THREAD]


@pytest.mark.parametrize('fail', [False, True], ids=['passes', 'fails'])
def test_threads_meeting_a_new_key_share_one_check(monkeypatch, fail):
    """Eight threads meet a configuration nobody checked: its check runs once (the others
    wait for its verdict instead of compiling and running their own) and every thread gets
    the same verdict; a failing check warns once. The check holds until all eight callers
    wait, so a dispatch that let each caller check would run it eight times."""
    callers, entered, got = [], [], []
    check = _FakeCheck(lambda: _until(lambda: len(entered) == len(callers) and
                                      _blocked_in_threading(callers)), fail)
    monkeypatch.setitem(dispatch._checks, 'fla', check)
    key = ('fake_op', 'float32', 'new-key')

    def call():
        entered.append(threading.current_thread().name)
        got.append(dispatch.verdict('fla', 'cpu', None, key))
    callers.extend(threading.Thread(target=call) for _ in range(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for t in callers:
            t.start()
        for t in callers:
            t.join()
    assert check.runs == 1 and check.most_at_once == 1
    assert got == [not fail] * 8
    assert dispatch.verdicts() == {('fla', 'cpu', key): not fail}
    assert len([w for w in caught if 'first-use check' in str(w.message)]) == int(fail)


def test_an_interrupt_leaves_no_second_check(monkeypatch):
    """A ``KeyboardInterrupt`` while the caller waits for the check propagates at once;
    the check runs on in its thread, nobody starts another meanwhile, and the next call
    gets its verdict (the check ran once, never two at a time) and no check is left."""
    interrupted = threading.Event()
    check = _FakeCheck(lambda: interrupted.wait(30))
    monkeypatch.setitem(dispatch._checks, 'fla', check)
    real_join = threading.Thread.join

    def join(thread, timeout=None):
        if thread.name == CHECK_THREAD and not interrupted.is_set():
            interrupted.set()  # (the check may end only once the caller was interrupted)
            raise KeyboardInterrupt
        return real_join(thread, timeout)
    monkeypatch.setattr(threading.Thread, 'join', join)
    key = ('fake_op', 'float32', 'interrupted')
    with pytest.raises(KeyboardInterrupt):
        dispatch.verdict('fla', 'cpu', None, key)
    assert dispatch.verdict('fla', 'cpu', None, key) is True
    assert check.runs == 1 and check.most_at_once == 1
    for t in _check_threads():
        real_join(t, 30)
    assert not _check_threads()
    assert dispatch.verdicts() == {('fla', 'cpu', key): True}


def test_a_check_that_ends_without_a_verdict_is_run_again(monkeypatch):
    """A check that ends without a verdict (out of memory is re-raised to its caller)
    leaves the configuration unchecked: the next call checks it again."""
    outcomes = [torch.cuda.OutOfMemoryError('injected'), None]

    def check(key, device):
        error = outcomes.pop(0)
        if error is not None:
            raise error
    monkeypatch.setitem(dispatch._checks, 'fla', check)
    key = ('fake_op', 'float32', 'oom')
    with pytest.raises(torch.cuda.OutOfMemoryError):
        dispatch.verdict('fla', 'cpu', None, key)
    assert dispatch.verdicts() == {}
    assert dispatch.verdict('fla', 'cpu', None, key) is True
    assert outcomes == []


# --------------------------------------------------------------------------- warnings
def _wrong_forward(real):
    def launch(*a, **k):
        out = real(*a, **k)
        out[0].mul_(1.01)
        return out
    return launch


def test_warning_names_the_real_cause(monkeypatch):
    """A kernel that computes a wrong result "disagreed with the PyTorch path"; one that
    raises "raised" -- each in its first-use check."""
    make = OPERATORS['fla-pvt-sr2'][0]
    x = _input((6, 8))
    monkeypatch.setattr(fla_triton, '_forward_kernels', _wrong_forward(fla_triton._forward_kernels))
    with pytest.warns(RuntimeWarning, match='disagreed with the PyTorch path in its first-use '
                      'check.*KernelMismatch'):
        _step(make, None, x)
    dispatch.reset()

    def boom(*a, **k):
        raise ValueError('injected')
    monkeypatch.setattr(fla_triton, '_forward_kernels', boom)
    with pytest.warns(RuntimeWarning, match='raised in its first-use check on .*: ValueError: '
                      'injected'):
        _step(make, None, x)


# --------------------------------------------------------------------------- sticky errors
STICKY = [
    RuntimeError('CUDA error: an illegal memory access was encountered\nCUDA kernel errors '
                 'might be asynchronously reported'),
    RuntimeError('Triton Error [CUDA]: misaligned address'),
    RuntimeError('CUDA error: device-side assert triggered'),
]


@pytest.mark.parametrize('error', STICKY, ids=['illegal-address', 'misaligned', 'assert'])
@pytest.mark.parametrize('when', ['check', 'later'])
def test_sticky_device_errors_are_raised_not_fallen_back_from(monkeypatch, error, when):
    """After a sticky CUDA error every later CUDA call fails: the dispatch raises
    ``DeviceUnusable`` naming the kernel and the switch, from the first-use check and
    from a later call alike, instead of a fallback that would fail with an unrelated
    message."""
    make = OPERATORS['fla-pvt-sr2'][0]
    x = _input((6, 8))
    if when == 'later':
        _step(make, None, x)
        assert _verdicts_all_pass()

    def sticky(*a, **k):
        raise error
    monkeypatch.setattr(fla_triton, '_forward_kernels', sticky)
    with pytest.raises(dispatch.DeviceUnusable, match=r'fla_core \(float32\) left .*unusable'
                       r'.*FLATTEN_MM_TRITON=0') as info:
        _step(make, None, x)
    assert info.value.__cause__ is error
    assert dispatch.leaves_device_unusable(error)
    assert not dispatch.leaves_device_unusable(RuntimeError('out of resources: shared memory'))


# --------------------------------------------------------------------------- specialisations
class _LaunchRecorder:
    """Records, for every Triton launch, the kernel and Triton's specialisation of each
    argument (``native_specialize_impl``: what selects the compiled variant), split by
    whether the launch came from a first-use check's thread or from the caller."""

    def __init__(self):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
        self.spec = lambda a: native_specialize_impl(BaseBackend, a, False, True, True)
        self.real = torch.library.wrap_triton
        self.launches = {'check': set(), 'call': set()}

    def __call__(self, kernel):
        wrapped = self.real(kernel)
        recorder = self

        class Grid:
            def __getitem__(self, grid):
                launch = wrapped[grid]

                def run(*args, **kwargs):
                    where = ('check' if threading.current_thread().name == CHECK_THREAD
                             else 'call')
                    sig = tuple(recorder.spec(a) for a in args)
                    consts = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
                    recorder.launches[where].add((kernel.__name__, sig, consts))
                    return launch(*args, **kwargs)
                return run
        return Grid()


def _fla_inputs(layout):
    """q, k, v (and k_pos, residual) of an FLA core call in a given memory layout."""
    g = torch.Generator().manual_seed(0)
    B, N, C = 2, 48, 32
    if layout == 'contiguous':
        q, k, v = (torch.randn(B, N, C, generator=g) for _ in range(3))
    elif layout == 'qkv-chunk':  # the views FLatten-Swin's qkv projection gives
        q, k, v = torch.randn(B, N, 3 * C, generator=g).chunk(3, dim=-1)
    elif layout == 'unaligned':  # (a 4-byte offset: not 16-byte aligned)
        q, k, v = (torch.randn(B, N, C + 1, generator=g)[..., 1:] for _ in range(3))
    elif layout == 'odd-tokens':
        q, k, v = (torch.randn(B, 37, C, generator=g) for _ in range(3))
    elif layout == 'one-sample':
        q, k, v = (torch.randn(1, N, C, generator=g) for _ in range(3))
    pos = 0.1 * torch.randn(1, k.shape[1], C, generator=g)
    res = torch.randn(q.shape, generator=g)
    return q, k, v, pos, res


@pytest.mark.parametrize('layout', ['contiguous', 'qkv-chunk', 'unaligned', 'odd-tokens',
                                    'one-sample'])
def test_fla_call_compiles_only_what_its_check_proved(monkeypatch, layout):
    """Forward and backward of an FLA core call launch only Triton specialisations that
    its first-use check launched (same kernel, constants and argument specialisations)."""
    recorder = _LaunchRecorder()
    monkeypatch.setattr(torch.library, 'wrap_triton', recorder)
    q, k, v, pos, res = (t.requires_grad_() for t in _fla_inputs(layout))
    scale = (0.3 * torch.randn(1, 1, 32)).requires_grad_()
    out = fla.focused_linear_core(q, k, v, scale, 2, 3, k_pos=pos, residual=res)
    out.backward(torch.randn(out.shape))
    assert _verdicts_all_pass()
    assert recorder.launches['call'], 'the kernels did not run'
    missing = recorder.launches['call'] - recorder.launches['check']
    assert not missing, sorted(missing)[:2]


@pytest.mark.parametrize('hw,attn_type', [((16, 16), 'B'), ((16, 24), 'B'), ((24, 40), 'A')])
@pytest.mark.parametrize('grad', [True, False], ids=['train', 'infer'])
def test_quadtree_call_compiles_only_what_its_check_proved(monkeypatch, hw, attn_type, grad):
    recorder = _LaunchRecorder()
    monkeypatch.setattr(torch.library, 'wrap_triton', recorder)
    torch.manual_seed(0)
    m = QuadTreeAttention(32, 2, attn_type=attn_type, num_levels=3, topk=4)
    x = torch.randn(2, hw[0] * hw[1], 32, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        out = m(x, hw)
    if grad:
        out.backward(torch.randn(out.shape))
    assert _verdicts_all_pass()
    assert recorder.launches['call'], 'the kernels did not run'
    missing = recorder.launches['call'] - recorder.launches['check']
    assert not missing, sorted(missing)[:2]


def test_a_failure_of_the_unaligned_variant_is_caught_by_its_check(monkeypatch):
    """A kernel that is wrong only on unaligned inputs (the variant Triton compiles for
    ``qkv.chunk`` views): its check, run on inputs of the call's layout, sees it -- one
    warning and the PyTorch path -- while aligned calls keep the kernels."""
    real = fla_triton._forward_kernels

    def wrong_when_unaligned(q, *a, **k):
        out = real(q, *a, **k)
        if q.data_ptr() % 16:
            out[0].mul_(1.01)
        return out
    monkeypatch.setattr(fla_triton, '_forward_kernels', wrong_when_unaligned)
    scale = 0.3 * torch.randn(1, 1, 32)
    aligned = _fla_inputs('contiguous')[:3]
    unaligned = _fla_inputs('unaligned')[:3]
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        fla.focused_linear_core(*aligned, scale, 2, 3)
    with pytest.warns(RuntimeWarning, match='disagreed with the PyTorch path'):
        got = fla.focused_linear_core(*unaligned, scale, 2, 3)
    ref = fla.focused_linear_core(*unaligned, scale, 2, 3, use_triton=False)
    assert torch.equal(got, ref)
    passed = [specialisation.unknown_alignment(k) or k[6].aligned
              for (_, _, k), ok in dispatch.verdicts().items() if ok]
    assert passed == [True]  # (the aligned configuration kept its kernels)


@pytest.mark.parametrize('shape,strides,offset', [
    ((2, 48, 32), None, 0), ((2, 48, 32), (4608, 96, 1), 32), ((2, 37, 32), (1221, 33, 1), 1),
    ((1, 48, 32), None, 0), ((2, 5, 1, 32), (0, 32, 32, 1), 0)])
def test_like_reproduces_the_layout(shape, strides, offset):
    """``specialisation.like`` builds, at another size of the same classes, a tensor whose
    ``layout`` is the original's."""
    base = torch.randn(10000)
    t = (base[:torch.Size(shape).numel()].view(shape) if strides is None
         else base.as_strided(shape, strides, offset))
    spec = specialisation.layout(t)
    sizes = [specialisation.sized_like(c, 3) for c in spec.sizes]
    view, _ = specialisation.like(spec, sizes, t.device, torch.Generator().manual_seed(0))
    assert specialisation.layout(view) == spec


# --------------------------------------------------------------------------- QuadTree fallback
def test_quadtree_inference_after_a_failed_check_takes_the_chunked_path(monkeypatch):
    """Once a level's kernels failed their check, QuadTree inference runs the documented
    chunked path (no ``(B, h, L, 4, 4K)`` scores), not the batched gathers: the paths
    taken are the chunked ones (``rows``, or the CPU kernel's) and the result is the PyTorch
    path's."""
    def oor(*a, **k):
        from triton.runtime.errors import OutOfResources
        raise OutOfResources(106496, 101376, 'shared memory')
    for name in LAUNCHERS['quadtree'][1]:
        monkeypatch.setattr(qt_triton, name, oor)
    torch.manual_seed(0)
    m = QuadTreeAttention(32, 2, num_levels=3, topk=4).eval()
    x = torch.randn(2, 16 * 16, 32)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match='first-use check'), \
            quadtree_paths.record_paths() as taken:
        got = m(x, (16, 16))
    chunked = 'cpu_kernel' if cpu_kernels.quadtree_level_kernel() is not None else 'rows'
    assert [t.path for t in taken] == [chunked, chunked], taken
    with torch.no_grad(), cpu_kernels.use_cpu_kernels(False):
        m.use_triton = False
        ref = m(x, (16, 16))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
