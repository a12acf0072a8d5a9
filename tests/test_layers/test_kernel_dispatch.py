"""The GPU path's safety, proven on the CPU: the one kernel dispatch (``ops.dispatch``) with
its first-use check and fallback, the determinism and ROCm gates, the shared-memory gate of
the ahead-of-time limit table, the device guard, and NaN / Inf propagation through the
kernels.

The kernels run under Triton's interpreter on CPU tensors; ``auto_on_cpu`` makes the auto
mode (``use_triton=None``, on CUDA in real use) consider them, so that every decision the
dispatch takes on a GPU is taken here on the same code. Failures are injected at the
kernels' launch helpers (below the ``torch.library`` ops), so the whole path from the
operator through the op to the launch is exercised.
"""
import copy
import re
import warnings

import pytest
import torch
from conftest import import_interpreted

triton, fla_triton, qt_triton, common = import_interpreted(
    'triton', 'flatten_mm.models.ops.fla_triton', 'flatten_mm.models.ops.quadtree_triton',
    'flatten_mm.models.ops.triton_common')
from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from flatten_mm.models.layers import (FocusedLinearAttention,  # noqa: E402
                                      FocusedLinearAttentionQKV, QuadTreeAttention)
from flatten_mm.models.layers import focused_linear_attention as fla  # noqa: E402
from flatten_mm.models.layers import quadtree_attention as qa  # noqa: E402
from flatten_mm.models.ops import dispatch, kernel_limits  # noqa: E402
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels  # noqa: E402

pytestmark = pytest.mark.usefixtures('triton_interpreter')


@pytest.fixture
def auto_on_cpu(monkeypatch):
    """The auto mode considers CPU tensors (interpreted kernels), with a fresh dispatch."""
    monkeypatch.setattr(dispatch, 'AUTO_DEVICE_TYPES', ('cuda', 'cpu'))
    dispatch.reset()
    yield
    dispatch.reset()


# --------------------------------------------------------------------------- operators
def _fla_pvt(use_triton, sr=1):
    torch.manual_seed(0)
    m = FocusedLinearAttention(32, 2, sr_ratio=sr, pretrain_hw_shape=(6, 8),
                               use_triton=use_triton)
    with torch.no_grad():
        m.scale.normal_(0, 0.3)
        m.positional_encoding.normal_(0, 0.1)
    return m, (6, 8)


def _fla_swin(use_triton):
    torch.manual_seed(0)
    m = FocusedLinearAttentionQKV(32, 2, pretrain_hw_shape=(6, 8), use_triton=use_triton)
    with torch.no_grad():
        m.scale.normal_(0, 0.3)
    return m, (6, 8)


def _quadtree(use_triton, attn_type):
    torch.manual_seed(0)
    return QuadTreeAttention(32, 2, attn_type=attn_type, num_levels=3, topk=4,
                             use_triton=use_triton), (16, 16)


#: operator -> (builder, the kernel ops its auto mode tries, in the warnings' words)
OPERATORS = {
    'fla-pvt': (lambda u: _fla_pvt(u), ('fla_projected', 'fla_core')),
    'fla-pvt-sr2': (lambda u: _fla_pvt(u, 2), ('fla_core', )),
    'fla-swin': (_fla_swin, ('fla_projected', 'fla_core')),
    # (the final level fused; when that falls back, the gathered scores and messages)
    'quadtree-b': (lambda u: _quadtree(u, 'B'), ('qt_final_b', 'qt_scores', 'qt_messages')),
    'quadtree-a': (lambda u: _quadtree(u, 'A'), ('qt_final_a', 'qt_scores', 'qt_messages')),
}


def _step(make, use_triton, x):
    """Forward + backward of a fresh operator: output, input and parameter gradients."""
    m, hw = make(use_triton)
    x = x.clone().requires_grad_()
    out = m(x, hw)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), x.grad] + [p.grad for p in m.parameters()]


def _input(hw):
    return torch.randn(2, hw[0] * hw[1], 32, generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------- injected failures
def _oor(*a, **k):
    raise OutOfResources(106496, 101376, 'shared memory')


def _compile_error(*a, **k):
    raise CompilationError('<kernel source>', None, 'injected: unsupported on this target')


def _wrong(real):
    def launch(*a, **k):
        out = real(*a, **k)
        if out is None:  # (``_launch`` writes into its ``out`` / ``dsrc`` arguments)
            written = a[4] if a[4] is not None else a[5]
        else:  # (the other launchers return their main output first)
            written = out[0]
        written.mul_(1.01)
        return out
    return launch


#: family -> the launch helpers a failure is injected into
LAUNCHERS = {'fla': (fla_triton, ('_forward_kernels', '_backward_kernels')),
             'quadtree': (qt_triton, ('_launch', '_final_forward', '_final_backward_launch'))}


def _inject(monkeypatch, family, failure, which=None):
    module, names = LAUNCHERS[family]
    for name in names if which is None else (which, ):
        real = getattr(module, name)
        fake = _wrong(real) if failure == 'wrong' else failure
        monkeypatch.setattr(module, name, fake)


@pytest.mark.parametrize('failure', [_oor, _compile_error, 'wrong'],
                         ids=['out-of-resources', 'compilation-error', 'wrong-result'])
@pytest.mark.parametrize('name', list(OPERATORS))
def test_failing_kernel_falls_back_with_one_warning(auto_on_cpu, monkeypatch, name, failure):
    """A kernel that raises or computes a wrong result in its first-use check is not used:
    one RuntimeWarning per kernel op naming the op, the device, the dtype and the error,
    and the step's output and every gradient equal the PyTorch path's, bit for bit; a
    second step warns no more."""
    make, ops = OPERATORS[name]
    family = 'fla' if name.startswith('fla') else 'quadtree'
    x = _input(make(False)[1])
    with cpu_kernels.use_cpu_kernels(False):  # what a GPU falls back to: the PyTorch path
        ref = _step(make, False, x)
    _inject(monkeypatch, family, failure)
    for step in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            got = _step(make, None, x)
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                and 'flatten_mm' in str(w.message)]
        if step == 0:
            assert sorted(re.search(r'kernel (\w+)', m).group(1) for m in msgs) == sorted(ops)
            for m in msgs:
                assert 'cpu (Triton interpreter)' in m and 'float32' in m, m
                assert ('OutOfResources' in m or 'CompilationError' in m
                        or 'KernelMismatch' in m), m
        else:
            assert msgs == []
        for a, b in zip(got, ref):
            assert torch.equal(a, b)


@pytest.mark.parametrize('name', list(OPERATORS))
def test_passing_kernels_are_used_after_the_check(auto_on_cpu, name):
    """Without a failure the auto mode checks each kernel configuration once, then uses the
    kernels (the verdicts say so) and matches the PyTorch path to float32 rounding."""
    make, ops = OPERATORS[name]
    x = _input(make(False)[1])
    ref = _step(make, False, x)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        got = _step(make, None, x)
    passed = {key[0] for (_, dev, key), ok in dispatch.verdicts().items() if ok}
    assert set(ops[:1]) <= passed, dispatch.verdicts()
    assert all(dispatch.verdicts().values())
    # float32 sums in another order: within 5e-5 of the largest value of all results, the
    # bound of the backbone kernel tests (largest here 5.2e-5 of a bias gradient's 1 %)
    largest = max(float(b.abs().max()) for b in ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5 * largest)


def test_backward_only_failure_is_caught_by_the_check(auto_on_cpu, monkeypatch):
    """The first-use check runs the backward too: a backward kernel that cannot launch
    keeps the configuration off the kernels before any training step depends on it."""
    make, _ = OPERATORS['fla-pvt-sr2']
    x = _input((6, 8))
    _inject(monkeypatch, 'fla', _oor, '_backward_kernels')
    with pytest.warns(RuntimeWarning, match='fla_core'):
        got = _step(make, None, x)
    for a, b in zip(got, _step(make, False, x)):
        assert torch.equal(a, b)


def test_forced_kernels_still_raise(auto_on_cpu, monkeypatch):
    """``use_triton=True`` runs no check and takes no fallback: the kernel's error
    propagates (the user asked for the kernels)."""
    _inject(monkeypatch, 'fla', _oor)
    with pytest.raises(OutOfResources):
        _step(OPERATORS['fla-pvt-sr2'][0], True, _input((6, 8)))
    _inject(monkeypatch, 'quadtree', _compile_error)
    with pytest.raises(CompilationError):
        _step(OPERATORS['quadtree-b'][0], True, _input((16, 16)))


def test_later_failure_in_eager_mode_falls_back(auto_on_cpu, monkeypatch):
    """A kernel that passed its check but raises on a later call (a specialisation the
    check did not compile) falls back for that call and every later one, with one
    warning."""
    make = OPERATORS['fla-pvt-sr2'][0]
    x = _input((6, 8))
    _step(make, None, x)  # checked and used
    assert all(dispatch.verdicts().values())
    _inject(monkeypatch, 'fla', _compile_error, '_forward_kernels')
    with pytest.warns(RuntimeWarning, match=r'fla_core \(float32\) raised'):
        got = _step(make, None, x)
    for a, b in zip(got, _step(make, False, x)):
        assert torch.equal(a, b)
    assert not any(dispatch.verdicts().values())


def test_first_use_check_leaves_the_callers_state(auto_on_cpu):
    """The check draws from its own generator and runs with grad on, autocast off: the
    caller's RNG stream, grad mode and inference mode are as they were."""
    m, hw = _fla_pvt(None, 2)
    x = _input(hw)
    state = torch.get_rng_state()
    with torch.inference_mode():
        out = m(x, hw)
    assert torch.equal(torch.get_rng_state(), state)
    assert dispatch.verdicts() and all(dispatch.verdicts().values())
    torch.testing.assert_close(out, _fla_pvt(False, 2)[0](x, hw), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- gates
def _spy_launches(monkeypatch, family):
    calls = []
    module, names = LAUNCHERS[family]
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    return calls


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_mode_keeps_quadtree_training_off_the_atomics(
        auto_on_cpu, monkeypatch, deterministic):
    """With deterministic algorithms on, a QuadTree training step (whose kernel backward
    accumulates with float atomics) runs the PyTorch path, twice to the same bits;
    inference still takes the kernels (no atomics there); ``use_triton=True`` refuses."""
    calls = _spy_launches(monkeypatch, 'quadtree')
    make = OPERATORS['quadtree-b'][0]
    x = _input((16, 16))
    first, second = _step(make, None, x), _step(make, None, x)
    assert calls == []
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    m, hw = make(None)
    with torch.no_grad():
        m(x, hw)
    assert calls, 'inference should still use the kernels'
    with pytest.raises(RuntimeError, match='deterministic'):
        _step(make, True, x)


def test_deterministic_mode_keeps_fla_kernels(auto_on_cpu, monkeypatch, deterministic):
    """FLA's kernels reduce in a fixed order (no atomics): deterministic mode keeps them,
    and two steps agree bit for bit."""
    calls = _spy_launches(monkeypatch, 'fla')
    make = OPERATORS['fla-pvt-sr2'][0]
    x = _input((6, 8))
    first, second = _step(make, None, x), _step(make, None, x)
    assert '_backward_kernels' in calls
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_rocm_and_cuda_gates_on_fake_cuda_tensors(monkeypatch):
    """On a ROCm build the auto mode keeps every family on the PyTorch path (checked on
    fake CUDA tensors, no GPU needed); on CUDA it considers them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(2, 3, device='cuda')
    dispatch.reset()
    monkeypatch.setattr(torch.version, 'hip', None)
    assert dispatch.gate_problem('quadtree', x.device, True) is None
    assert dispatch.wanted(None, 'fla', x)
    monkeypatch.setattr(torch.version, 'hip', '6.2.0')
    for family in ('fla', 'quadtree'):
        assert 'ROCm' in dispatch.gate_problem(family, x.device, False)
        assert not dispatch.wanted(None, family, x)
    with pytest.raises(RuntimeError, match='ROCm'):
        dispatch.wanted(True, 'fla', x)


def test_shared_memory_gate_uses_the_limit_table(monkeypatch):
    """A configuration whose compiled shared memory (the committed ahead-of-time table)
    exceeds the device's is refused before any launch, with the reason; one that fits is
    not. The table covers every kernel the shipped backbones launch (head dims 32 / 64, 4K
    = 32 / 128) on every target."""
    from types import SimpleNamespace
    fits = set()
    for C, h in ((32, 1), (64, 1), (64, 2), (96, 3), (256, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            for key in _keys_without_interpreter('fla', C, h, dtype):
                row = kernel_limits.table()['fla'][key]
                assert set(row) == {'sm_75', 'sm_80', 'sm_86', 'sm_89', 'sm_90'}, key
                fits.add(max(row.values()))
    for K, d in ((128, 32), (128, 64), (32, 32), (32, 64)):
        for dtype in (torch.float32, torch.bfloat16):
            for key in _keys_without_interpreter('quadtree', K, d, dtype):
                assert len(kernel_limits.table()['quadtree'][key]) == 5, key
    row = max(kernel_limits.table()['fla'].items(), key=lambda kv: kv[1]['sm_90'])
    need = row[1]['sm_86']

    def props(limit):
        return SimpleNamespace(name='Fake GPU', major=8, minor=6,
                               shared_memory_per_block_optin=limit, shared_memory_per_block=0)

    dev = torch.device('cuda', 0)
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda d: props(need - 1))
    why = common.shared_memory_problem('fla', lambda: [row[0]], dev)
    assert why and f'needs {need} B' in why and 'Fake GPU' in why
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda d: props(need))
    assert common.shared_memory_problem('fla', lambda: [row[0]], dev) is None
    assert common.shared_memory_problem('fla', lambda: ['unknown|row'], dev) is None


def _keys_without_interpreter(family, a, b, dtype):
    """The limit-table rows a launch would use, as the compiled (GPU) kernels tile it:
    computed with the module's tiling rules, the interpreter switched off for the call."""
    module = fla_triton if family == 'fla' else qt_triton
    import flatten_mm.models.ops.triton_common as tc
    saved = (module.INTERPRETED, tc.INTERPRETED)
    module.INTERPRETED = tc.INTERPRETED = False
    try:
        if family == 'fla':
            return module.limit_keys(a, b, dtype, 'ieee') + module.limit_keys(a, b, dtype, 'tf32')
        return module.limit_keys(a, b, dtype)
    finally:
        module.INTERPRETED, tc.INTERPRETED = saved


# --------------------------------------------------------------------------- device guard
def test_launches_enter_the_tensors_device(monkeypatch):
    """Every launch helper, forward and backward, runs inside ``dispatch.device_guard`` of
    its tensors' device (Triton launches on the current CUDA device; a model on ``cuda:1``
    must not launch on ``cuda:0``)."""
    entered = []
    real = dispatch.device_guard
    monkeypatch.setattr(dispatch, 'device_guard',
                        lambda device: entered.append(device) or real(device))
    fla_calls, qt_calls = _spy_launches(monkeypatch, 'fla'), _spy_launches(monkeypatch, 'quadtree')
    for name in ('fla-pvt-sr2', 'quadtree-b', 'quadtree-a'):
        _step(OPERATORS[name][0], True, _input(OPERATORS[name][0](False)[1]))
    assert {'_forward_kernels', '_backward_kernels'} <= set(fla_calls)
    assert {'_launch', '_final_forward', '_final_backward_launch'} <= set(qt_calls)
    assert len(entered) == len(fla_calls) + len(qt_calls)  # one guard per launch helper
    assert set(entered) == {torch.device('cpu')}
    guard = dispatch.device_guard(torch.device('cuda', 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert dispatch.device_guard(torch.device('cpu')).__class__.__name__ == 'nullcontext'


# --------------------------------------------------------------------------- NaN / Inf
#: NVIDIA's canonical NaN (what a GPU's arithmetic produces); the CPU's is 0x7FC00000
GPU_NAN = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)[0]


def test_bf16_rounding_keeps_nan():
    """``cast_rne`` (all kernels' rounding to bfloat16) maps every NaN bit pattern, the
    GPU's canonical ``0x7FFFFFFF`` included, to a NaN, and Inf to Inf (the rounding bias
    used to carry ``0x7FFFFFFF`` into the sign bit: -0.0)."""
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, common.cast_rne(x, tl.bfloat16), mask=offs < n)

    bits = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x7F800000,
                         0xFF800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000],
                        dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    y = torch.empty(len(x), dtype=torch.bfloat16)
    cast[(1, )](x, y, len(x), BLOCK=16)
    assert y[:4].isnan().all(), y
    assert torch.equal(y[4:], x[4:].to(torch.bfloat16))  # Inf, -Inf, overflow, ties to even


def _with_nonfinite(t, nan_at, inf_at):
    t = t.detach().clone().float()
    t.view(-1)[nan_at] = GPU_NAN
    t.view(-1)[inf_at] = float('inf')
    return t


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
def test_fla_kernels_propagate_nan_and_inf(dtype):
    """NaN (the GPU's bit pattern) and Inf in a query token and in a value reach the
    output and the gradients in the same places as on the PyTorch path (a token's NaN
    must not turn into a finite value: ReLU keeps NaN, the backward passes it)."""
    g = torch.Generator().manual_seed(0)
    B, n, C, h = 1, 37, 32, 2
    q = _with_nonfinite(torch.randn(B, n, C, generator=g), 5 * C + 3, 9 * C + 1)
    k = torch.randn(B, n, C, generator=g)
    v = _with_nonfinite(torch.randn(B, n, C, generator=g), 20 * C + 7, 30 * C)
    scale = torch.randn(1, 1, C, generator=g) * 0.3
    grad = torch.randn(B, n, C, generator=g)
    results = []
    for use_triton in (True, False):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [scale.requires_grad_()]
        out = fla.focused_linear_core(*leaves[:3], leaves[3], h, 3, use_triton=use_triton)
        out.backward(grad.to(dtype))
        results.append([out.detach()] + [t.grad for t in leaves])
    for got, ref in zip(*results):
        assert torch.equal(got.isnan(), ref.isnan()), (got.isnan().sum(), ref.isnan().sum())
        assert torch.equal(got.isinf(), ref.isinf())
    assert results[0][0].isnan().any()


@pytest.mark.parametrize('variant', ['B', 'A'])
def test_quadtree_kernels_propagate_nan(variant):
    """A NaN query of the finest level gives NaN in the same output tokens and gradients
    with the kernels as on the PyTorch path."""
    torch.manual_seed(0)
    m = QuadTreeAttention(32, 2, attn_type=variant, num_levels=2, topk=4)
    x = torch.randn(1, 64, 32)
    x[0, 13, 5] = GPU_NAN
    results = []
    for use_triton in (True, False):
        mm = copy.deepcopy(m)
        mm.use_triton = use_triton
        xx = x.clone().requires_grad_()
        out = mm(xx, (8, 8))
        out.backward(torch.ones_like(out))
        results.append([out.detach(), xx.grad])
    for got, ref in zip(*results):
        assert torch.equal(got.isnan(), ref.isnan())
    assert results[0][0].isnan().any()


# --------------------------------------------------------------------------- torch.compile
def test_decision_is_a_graph_constant(auto_on_cpu, monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` the auto mode's decision (gates, input check,
    first-use check run at trace time) is a constant: no graph break, the kernel op in the
    graph when the check passes, none after an injected failure."""
    def graph_targets(fn, *args):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
        assert len(graphs) == 1
        return out, {str(n.target) for n in graphs[0].graph.nodes if n.op == 'call_function'}

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 20, 32, generator=g) for _ in range(3))
    s = torch.randn(1, 1, 32, generator=g) * 0.3

    def f(q, k, v, s):
        return fla.focused_linear_core(q, k, v, s, 2, 3)

    out, targets = graph_targets(f, q, k, v, s)
    assert any('fla_core' in t for t in targets), targets
    torch.testing.assert_close(out, fla.focused_linear_core(q, k, v, s, 2, 3, use_triton=False))
    dispatch.reset()
    _inject(monkeypatch, 'fla', _oor)
    with pytest.warns(RuntimeWarning, match='fla_core'):
        out, targets = graph_targets(f, q, k, v, s)
    assert not any('fla_core' in t for t in targets), targets
    assert torch.equal(out, fla.focused_linear_core(q, k, v, s, 2, 3, use_triton=False))


def test_cpu_tensors_cost_nothing_in_auto_mode(monkeypatch):
    """On CPU tensors the auto mode looks at nothing else (no import, no check)."""
    dispatch.reset()
    monkeypatch.setattr(dispatch, 'kernel_module', lambda *a: pytest.fail('looked further'))
    x = torch.randn(2, 3)
    assert not dispatch.use_kernels(None, 'fla', x, lambda: pytest.fail('checked inputs'),
                                    lambda: pytest.fail('made a key'))
    assert dispatch.verdicts() == {}


# --------------------------------------------------------------------------- compiled code
ROOT = __import__('os').path.dirname(__import__('os').path.dirname(
    __import__('os').path.dirname(__import__('os').path.abspath(__file__))))


def _compiled_env():
    import os
    return {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}


#: rows recompiled in CI: FLA as FLatten-Swin-T's first stage launches it in bf16 (head dim
#: 32), QuadTree as QuadTree-B-b0's stage 2 in fp32 (4K = 128, d = 32), and FLA's query-side
#: backward at head dim 128, fp32 (the configuration needing the most shared memory)
CI_ROWS = (r'^_(fla_\w+|focus_bwd)\|bfloat16\|(ieee|-)\|BD(32|-)\|BN64\|BC32\|'
           r'|^\w+\|float32\|P\d+\|K128\|D32\|'
           r'|^_fla_q_bwd\|float32\|ieee\|BD128\|')


def test_limit_table_is_reproducible_and_flags_what_does_not_fit():
    """``dev/kernel_limits.py --check`` compiles (Triton's bundled compiler and
    ptxas, no GPU, no interpreter) the kernels of two shipped backbones' stages and FLA's
    largest configuration for sm_75 and sm_90: every kernel compiles, the shared memory
    equals the committed table's, the shipped stages fit both targets, and head dim 128's
    query-side backward is reported not to fit sm_75 (64 KiB), which the dispatch's gate
    reads from the table."""
    import subprocess
    import sys
    res = subprocess.run(
        [sys.executable, 'dev/kernel_limits.py', '--archs', '75,90', '--check',
         '--match', CI_ROWS], cwd=ROOT, env=_compiled_env(), capture_output=True, text=True,
        timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    compiled = [line for line in lines if line.startswith('sm_')]
    assert len(compiled) == 2 * (5 + 8 + 1), res.stdout
    unfit = [line for line in compiled if 'DOES NOT FIT' in line]
    assert len(unfit) == 1 and unfit[0].startswith('sm_75') and 'BD128' in unfit[0], unfit
    row = next(v for k, v in kernel_limits.table()['fla'].items()
               if k.startswith('_fla_q_bwd|float32|ieee|BD128'))
    assert row['sm_75'] > 65536 and row['sm_90'] <= 232448


_PTX_SCRIPT = r'''
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flatten_mm.models.ops import fla_triton
name, fn, sig, const, opts = fla_triton.aot_specs(32, 1, 3, torch.bfloat16)[0]
ptx = triton.compile(ASTSource(fn, sig, const), target=GPUTarget('cuda', 80, 32),
                     options=opts).asm['ptx']
print(name, 'max.NaN.f32' in ptx, ptx.count('max.f32'))
'''


def test_compiled_relu_propagates_nan():
    """Compiled for a GPU (sm_80, no GPU needed), the kernels' ReLU is ``max.NaN.f32``, the
    NaN-propagating maximum (a plain ``tl.maximum`` compiles to ``max.f32``, which returns
    0 for a NaN input on NVIDIA GPUs, where the interpreter's NumPy keeps the NaN)."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, '-c', _PTX_SCRIPT], cwd=ROOT, env=_compiled_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    name, has_nan_max, _ = res.stdout.split()
    assert name == '_fla_kv_fwd' and has_nan_max == 'True', res.stdout


def test_gpu_check_tool_safety_checks_run_interpreted(auto_on_cpu):
    """``gpu_kernel_check.py --safety`` (what the GPU session runs), here on CPU tensors
    with interpreted kernels and small operators: every operator's first-use verdict is
    recorded and passed, TF32 matches, FLA repeats bitwise (QuadTree too in deterministic
    mode), NaN / Inf patterns match, and a single device says so."""
    import importlib.util
    import os.path as osp
    spec = importlib.util.spec_from_file_location(
        'gpu_kernel_check', osp.join(ROOT, 'benchmarks', 'gpu_kernel_check.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    args = tool.parse_args(['--out', 'unused', '--kernels', 'fla', '--safety', '--no-timing'])
    args.device, args.safety_small = 'cpu', True
    rec = tool.safety_checks(args)
    assert rec['passed'], rec
    ops = {v['key'][0] for v in rec['verdicts']}
    assert {'fla_projected', 'fla_core', 'qt_final_b', 'qt_final_a'} <= ops, ops
    assert all(v['passed'] for v in rec['verdicts']) and rec['warnings'] == []
    dtypes = {v['key'][1] for v in rec['verdicts']}
    assert {'float32', 'bfloat16', 'float16'} <= dtypes, dtypes
    assert all(r['bitwise_equal'] for n, r in rec['repeat'].items() if n.startswith('fla'))
    assert all(r['deterministic_mode_bitwise_equal'] for n, r in rec['repeat'].items()
               if n.startswith('quadtree'))
    assert len(rec['nan']) == 10 and all(r['same_pattern'] for r in rec['nan'].values())
    assert rec['second_device'] == 'one device only'
