"""The fused Triton kernels of FLA (``ops.fla_triton``) on the CPU, under
Triton's interpreter: forward and gradients (q, k, v, scale, positional encoding) against
the float64 formula and the PyTorch path, and the operator-level switch.

Triton decides at decoration time (when the kernel module is imported) whether kernels are
interpreted, so ``TRITON_INTERPRET=1`` is set before the import below; it is set again
around each test (``triton_interpreter`` fixture) because the interpreter also reads it while a
kernel runs, and removed afterwards so other test modules never see it. These tests are
never skipped: without Triton the import fails.
"""
import operator
import os

import pytest
import torch
from conftest import import_interpreted

# (the kernels need Triton: fail, never skip, without it)
triton, fla_triton = import_interpreted(
    'triton', 'flatten_mm.models.ops.fla_triton')
from flatten_mm.models.layers import focused_linear_attention as fla  # noqa: E402
from flatten_mm.models.ops import dispatch  # noqa: E402
from flatten_mm.models.layers import (FocusedLinearAttention,  # noqa: E402
                                      FocusedLinearAttentionQKV)

pytestmark = pytest.mark.usefixtures('triton_interpreter')


def test_kernels_are_interpreted():
    assert fla_triton.INTERPRETED, (
        'the Triton kernel module was imported before TRITON_INTERPRET=1 was set (by another '
        'test module of this process?): its kernels cannot run on CPU tensors')
    assert triton.knobs.runtime.interpret


def _rand(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64)


def _problem(B, N, n, C, with_pos, amp=1.0, seed=0):
    """float64 q, k, v, raw scale and optional positional encoding."""
    return (_rand(B, N, C, seed=seed + 1, scale=amp), _rand(B, n, C, seed=seed + 2, scale=amp),
            _rand(B, n, C, seed=seed + 3), _rand(1, 1, C, seed=seed + 4, scale=0.5),
            _rand(1, n, C, seed=seed + 5, scale=0.3) if with_pos else None)


def _run(fn, inputs, grad_out):
    """``fn(q, k, v, scale, pos)`` and the gradients of ``(out * grad_out).sum()`` w.r.t.
    every input tensor (``pos`` included when present)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in inputs]
    out = fn(*leaves)
    used = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, used, grad_out.to(out.dtype))
    return out.detach(), [g.detach() for g in grads]


def _reference(inputs, h, p):
    """The formula step by step in float64 (``k + pos`` added outside)."""
    def fn(q, k, v, s, pos):
        return fla.focused_linear_core_reference(q, k if pos is None else k + pos, v, s, h, p)
    return fn


def _core(h, p, use_triton, dtype=torch.float32):
    def fn(q, k, v, s, pos):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return fla.focused_linear_core(q, k, v, s.float(), h, p,
                                       k_pos=None if pos is None else pos.float(),
                                       use_triton=use_triton)
    return fn


def _max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.abs().max().clamp_min(1.0)).item()


# (B, H, W, key grid (None: = map), C, heads, p, with_pos)
CASES = {
    'odd-map-3-heads-pos': (2, 5, 7, None, 48, 3, 3, True),
    'sr2-reduced-keys': (1, 6, 9, (3, 5), 32, 2, 3, True),  # N_q = 54 != N_kv = 15
    'one-head-d24-p2': (1, 4, 5, None, 24, 1, 2, False),  # head dim not a power of two
    'p4-8-heads': (1, 3, 4, (2, 2), 64, 8, 4, True),
}


@pytest.mark.parametrize('case', list(CASES))
def test_forward_and_gradients_match_float64(case):
    """fp32 kernels within 1e-5 (relative to the largest value) of the float64 formula,
    forward and every gradient; the fp32 PyTorch path is held to the same bound (observed:
    both about 5e-7)."""
    B, H, W, kv_grid, C, h, p, with_pos = CASES[case]
    N = H * W
    n = N if kv_grid is None else kv_grid[0] * kv_grid[1]
    inputs = _problem(B, N, n, C, with_pos)
    g = _rand(B, N, C, seed=9)
    ref, ref_grads = _run(_reference(inputs, h, p), inputs, g)
    out, grads = _run(_core(h, p, True), inputs, g)
    torch_out, torch_grads = _run(_core(h, p, False), inputs, g)
    assert out.dtype == torch.float32
    names = ['q', 'k', 'v', 'scale', 'pos'][:len(grads)]
    assert _max_rel(out, ref) < 1e-5 and _max_rel(torch_out, ref) < 1e-5
    for name, a, t, r in zip(names, grads, torch_grads, ref_grads):
        assert a.shape == r.shape, name
        assert _max_rel(a, r) < 1e-5, (name, _max_rel(a, r))
        assert _max_rel(t, r) < 1e-5, (name, _max_rel(t, r))


def test_residual_is_added_before_the_one_rounding():
    """The residual (the operators' DWC branch) is added in the output kernel: in float32
    the result and every gradient equal the kernel without it plus ``residual`` (bit for
    bit), the residual's gradient is the output's; with bfloat16 inputs and residual the
    output is the float32 result of the same values rounded once (bit for bit), where
    adding after the kernel would round twice."""
    B, H, W, C, h = 2, 5, 7, 32, 2
    N = H * W
    q, k, v, s, pos = (t.float() for t in _problem(B, N, N, C, True))
    # a channels-last map's tokens, as token_conv returns them (non-contiguous view)
    res = _rand(B, C, H, W, seed=7).float().to(memory_format=torch.channels_last)
    res = res.flatten(2).transpose(1, 2)
    g = _rand(B, N, C, seed=9).float()

    def run(residual):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, s, pos)]
        extra = [] if residual is None else [residual.clone().requires_grad_(True)]
        out = fla.focused_linear_core(*leaves[:4], h, 3, k_pos=leaves[4], use_triton=True,
                                      residual=extra[0] if extra else None)
        return out, torch.autograd.grad(out, leaves + extra, g)

    fused, fused_grads = run(res)
    plain, plain_grads = run(None)
    assert torch.equal(fused, plain + res)
    for a, b in zip(fused_grads[:5], plain_grads):
        assert torch.equal(a, b)
    assert torch.equal(fused_grads[5], g)
    # bfloat16: one rounding of the float32 sum
    qb, kb, vb, posb, rb = (t.bfloat16() for t in (q, k, v, pos, res))
    half = fla.focused_linear_core(qb, kb, vb, s, h, 3, k_pos=posb, use_triton=True,
                                   residual=rb)
    exact = fla.focused_linear_core(qb.float(), kb.float(), vb.float(), s, h, 3,
                                    k_pos=posb.float(), use_triton=True, residual=rb.float())
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, exact.bfloat16())
    twice = fla.focused_linear_core(qb, kb, vb, s, h, 3, k_pos=posb, use_triton=True) + rb
    assert not torch.equal(twice, half)  # (so the test tells the two apart)
    # the PyTorch path takes the same argument; a residual of another shape is refused
    torch.testing.assert_close(
        fla.focused_linear_core(q, k, v, s, h, 3, k_pos=pos, use_triton=False, residual=res),
        fused, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match='residual'):
        fla.focused_linear_core(q, k, v, s, h, 3, residual=res[:, :-1])


def test_extreme_activations_stay_exact():
    """Activations of 1e6 with p = 5 (``||base^p||`` ~ 1e33, its square overflows float32)
    and tokens whose channels are all negative (``base`` = the 1e-6 floor, ``base^5`` ~
    1e-30): the kernels scale by the token's largest entry before the power, so forward and
    gradients still match the float64 formula to 1e-5."""
    B, N, C, h, p = 1, 12, 16, 2, 5
    q, k, v, s, pos = _problem(B, N, N, C, True, amp=1e6)
    q[0, :3] = -q[0, :3].abs()
    k[0, 4:6] = -k[0, 4:6].abs() - 1e6  # (pos of 0.3 cannot lift them above 0)
    inputs = (q, k, v, s, pos)
    g = _rand(B, N, C, seed=9)
    ref, ref_grads = _run(_reference(inputs, h, p), inputs, g)
    assert torch.isfinite(ref).all() and all(torch.isfinite(r).all() for r in ref_grads)
    out, grads = _run(_core(h, p, True), inputs, g)
    assert _max_rel(out, ref) < 1e-5
    for name, a, r in zip(['q', 'k', 'v', 'scale', 'pos'], grads, ref_grads):
        assert _max_rel(a, r) < 1e-5, (name, _max_rel(a, r))


def test_non_contiguous_inputs():
    """q, k, v as the chunks of one ``qkv`` projection (row stride 3C) and a transposed
    positional table: read through their strides, same results as contiguous copies."""
    B, N, C, h = 2, 20, 32, 2
    qkv = _rand(B, N, 3 * C, seed=1).float()
    q, k, v = qkv.chunk(3, dim=-1)
    pos = _rand(1, C, N, seed=2).float().transpose(1, 2)
    scale = _rand(1, 1, C, seed=3).float()
    assert not (q.is_contiguous() or pos.is_contiguous())
    inputs = (q, k, v, scale, pos)
    g = _rand(B, N, C, seed=4).float()
    out, grads = _run(_core(h, 3, True), inputs, g)
    ref, ref_grads = _run(_core(h, 3, True), [t.contiguous() for t in inputs], g)
    assert torch.equal(out, ref)
    for a, r in zip(grads, ref_grads):
        assert torch.equal(a, r)
    f64, f64_grads = _run(_reference(inputs, h, 3), [t.double() for t in inputs], g.double())
    assert _max_rel(out, f64) < 1e-5
    assert all(_max_rel(a, r) < 1e-5 for a, r in zip(grads, f64_grads))


# unit roundoff of the output / gradient dtype: the kernels compute in float32, so the only
# error beyond fp32 rounding is the final cast (|round(x) - x| <= u |x|).
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize('dtype,amp', [(torch.bfloat16, 1.0), (torch.float16, 30.0)])
def test_half_inputs_accumulate_in_float32(dtype, amp):
    """bf16 / fp16 inputs: every output and gradient element within one rounding of its
    dtype (plus 1e-5 of the largest value) of the float64 formula on the same (rounded)
    inputs -- a half-precision accumulation would be far off. ``amp=30`` makes
    ``(q / softplus(s))^3`` exceed the fp16 range (65504) by orders of magnitude: no
    overflow, no NaN."""
    B, N, C, h = 1, 24, 32, 2
    q, k, v, s, pos = _problem(B, N, N, C, True, amp=amp)
    q, k, v = (t.to(dtype).double() for t in (q, k, v))  # the rounded inputs, exactly
    if dtype == torch.float16:
        assert ((q.clamp_min(0) / torch.nn.functional.softplus(s))**3).max() > 1e6
    inputs = (q, k, v, s, pos)
    g = _rand(B, N, C, seed=9).to(dtype).double()
    ref, ref_grads = _run(_reference(inputs, h, 3), inputs, g)
    out, grads = _run(_core(h, 3, True, dtype=dtype), inputs, g)
    assert out.dtype == dtype and grads[0].dtype == torch.float64  # (cast back by .to)
    u = _UNIT_ROUNDOFF[dtype]
    for name, a, r in zip(['out', 'q', 'k', 'v', 'scale', 'pos'], [out] + grads,
                          [ref] + ref_grads):
        a = a.double()
        assert torch.isfinite(a).all(), name
        bound = u * r.abs() + 1e-5 * r.abs().max()
        assert ((a - r).abs() <= bound).all(), (name, ((a - r).abs() - bound).max().item())


def test_half_gradients_keep_input_dtypes():
    """The gradients reaching bf16 q, k, v are bf16 (the cast is inside the op)."""
    q, k, v = (_rand(1, 9, 16, seed=i).bfloat16().requires_grad_(True) for i in range(3))
    s = torch.zeros(1, 1, 16, requires_grad=True)
    out = fla.focused_linear_core(q, k, v, s, 1, 3, use_triton=True)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype, s.grad.dtype) == (
        torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)


def _count_kernel_calls(monkeypatch):
    calls = []
    real = fla_triton.fla_core_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(fla_triton, 'fla_core_triton', spy)
    return calls


def test_switches(monkeypatch):
    """``use_triton=True`` runs the kernels; ``False``, ``None`` on CPU tensors and
    ``FLATTEN_MM_TRITON=0`` (even with ``True``) run the PyTorch path."""
    calls = _count_kernel_calls(monkeypatch)
    q, k, v, s, _ = (t.float() if t is not None else None
                     for t in _problem(1, 8, 8, 16, False))
    ref = fla.focused_linear_core(q, k, v, s, 2, 3, use_triton=True)
    assert len(calls) == 1
    for flag in (False, None):
        out = fla.focused_linear_core(q, k, v, s, 2, 3, use_triton=flag)
        assert len(calls) == 1
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv(dispatch.TRITON_ENV, '0')
    fla.focused_linear_core(q, k, v, s, 2, 3, use_triton=True)
    assert len(calls) == 1
    monkeypatch.setenv(dispatch.TRITON_ENV, '1')
    fla.focused_linear_core(q, k, v, s, 2, 3, use_triton=True)
    assert len(calls) == 2


def test_forced_kernels_refuse_what_they_cannot_take():
    q = torch.zeros(1, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match='float64'):
        fla.focused_linear_core(q, q, q, torch.zeros(1, 1, 8), 2, 3, use_triton=True)
    x = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match='focusing_factor'):
        fla.focused_linear_core(x, x, x, torch.zeros(1, 1, 8), 2, 1.5, use_triton=True)
    with pytest.raises(ValueError, match='use_triton'):
        FocusedLinearAttention(16, 2, use_triton='yes')
    many = torch.zeros(65536, 1, 8)  # e.g. tiny windows folded into the batch
    with pytest.raises(ValueError, match='batch 65536'):
        fla.focused_linear_core(many, many, many, torch.zeros(1, 1, 8), 2, 3, use_triton=True)


def test_reduced_keys_operator_with_kernels_matches_pytorch_path(monkeypatch):
    """FLatten-PVT's operator with key reduction (sr_ratio 2: resized positional table,
    reduced keys, interpolated V for the DWC; the core's kernels, unfused) with
    ``use_triton=True`` gives the output and parameter gradients of ``use_triton=False``,
    and really ran the kernels. (The operators without key reduction:
    ``test_projected_operator_matches_the_unfused_kernels``.)"""
    calls = _count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    m = FocusedLinearAttention(32, 2, sr_ratio=2, pretrain_hw_shape=(8, 8))
    with torch.no_grad():
        for prm in (m.scale, m.positional_encoding):
            prm.normal_(0, 0.5)
    x = torch.randn(2, 5 * 7, 32)
    results = []
    for flag in (True, False):
        m.use_triton = flag
        out, _, grads = _forward_backward(lambda t: m(t, (5, 7)), m, x)
        results.append((out, grads))
    (out_t, grads_t), (out_p, grads_p) = results
    torch.testing.assert_close(out_t, out_p, rtol=1e-5, atol=1e-5)
    # (two float32 computations of the same gradients, each ~1e-6 norm-wise from float64:
    # compared on the scale of each tensor, as the projected operators' test does)
    for name in grads_p:
        assert _max_rel(grads_t[name], grads_p[name]) < 1e-5, name
    assert len(calls) == 1


# operators whose FLA layers have a packed projection and no key reduction:
# FLatten-PVT's (kv), FLatten-Swin's global and windowed / shifted (qkv)
PROJECTED = {
    'pvt': lambda: FocusedLinearAttention(32, 2, sr_ratio=1, pretrain_hw_shape=(5, 7)),
    'swin-global': lambda: FocusedLinearAttentionQKV(32, 2, pretrain_hw_shape=(5, 7)),
    'swin-windows': lambda: FocusedLinearAttentionQKV(32, 2, window_size=4, shift=True,
                                                      pretrain_hw_shape=(4, 4)),
}


def _projected_operator(kind, seed=0):
    """The operator with random scale, positional table and biases."""
    torch.manual_seed(seed)
    m = PROJECTED[kind]()
    with torch.no_grad():
        for name, prm in m.named_parameters():
            if name in ('scale', 'positional_encoding') or name.endswith('bias'):
                prm.normal_(0, 0.5)
    m.use_triton = True
    return m


def _projected_calls(monkeypatch):
    calls = []
    real = fla_triton.fla_projected_triton
    monkeypatch.setattr(fla_triton, 'fla_projected_triton',
                        lambda *a, **kw: calls.append(a[0] is None) or real(*a, **kw))
    return calls


def _unfused(monkeypatch):
    """The kernels of the core with the projection, split and DWC left to autograd (the
    path before ``fla_projected_triton``; the DWC as torch's convolution, not the CPU
    path's ``DepthwiseConvCPU``) while the block is active."""
    import contextlib

    from flatten_mm.models.layers import conv

    @contextlib.contextmanager
    def ctx():
        with monkeypatch.context() as mp:
            mp.setattr(fla, '_projected_path', lambda *a: False)
            mp.setattr(conv, '_fast_depthwise', lambda *a: False)
            yield
    return ctx()


def _forward_backward(fn, m, x):
    m.zero_grad()
    xi = x.clone().requires_grad_(True)
    out = fn(xi)
    out.float().square().sum().backward()
    return out.detach(), xi.grad, {k: p.grad.clone() for k, p in m.named_parameters()}


@pytest.mark.parametrize('kind', list(PROJECTED))
def test_projected_operator_matches_the_unfused_kernels(kind, monkeypatch):
    """Without key reduction the operators run ``fla_projected_triton`` (packed projection,
    DWC and core in one ``autograd.Function``, the projection recomputed in the backward):
    in float32 output, input gradient and every parameter gradient equal those of the same
    kernels with the projection, split and DWC left to autograd, bit for bit, and the
    PyTorch path's within 1e-5 of the largest value."""
    calls = _projected_calls(monkeypatch)
    m = _projected_operator(kind)
    hw = (5, 7)
    x = torch.randn(2, 35, 32)
    out, dx, grads = _forward_backward(lambda t: m(t, hw), m, x)
    assert calls == [kind != 'pvt']  # once (windows folded into the batch); q packed or not
    with _unfused(monkeypatch):
        ref, ref_dx, ref_grads = _forward_backward(lambda t: m(t, hw), m, x)
    assert len(calls) == 1
    assert torch.equal(out, ref) and torch.equal(dx, ref_dx)
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    m.use_triton = False
    out_p, dx_p, grads_p = _forward_backward(lambda t: m(t, hw), m, x)
    assert len(calls) == 1
    assert _max_rel(out, out_p) < 1e-5 and _max_rel(dx, dx_p) < 1e-5
    for name in grads:
        assert _max_rel(grads[name], grads_p[name]) < 1e-5, name


@pytest.mark.parametrize('kind', ['pvt', 'swin-global'])
def test_projected_operator_under_bf16_autocast(kind, monkeypatch):
    """Under bf16 autocast the projection and DWC run in bf16 as ``nn.Linear`` /
    ``nn.Conv2d`` would: the bf16 output and every float32 parameter gradient not
    downstream of dv equal the unfused kernels' bit for bit; dv's two parts are summed in
    float32 inside the key kernel (the unfused path rounds each to bf16 first), so the
    projection's gradients and dx differ from it within bf16 rounding (norm-wise relative
    2^-8; observed about 3e-3 and below, where both paths are about 1e-2 from float32)."""
    m = _projected_operator(kind, seed=1)
    proj = 'kv.' if kind == 'pvt' else 'qkv.'
    hw = (5, 7)
    x = torch.randn(2, 35, 32)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out, dx, grads = _forward_backward(lambda t: m(t, hw), m, x)
        with _unfused(monkeypatch):
            ref, ref_dx, ref_grads = _forward_backward(lambda t: m(t, hw), m, x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    assert 0 < rel(dx, ref_dx) < 2**-8
    for name in grads:
        assert grads[name].dtype == torch.float32, name
        if name.startswith(proj):
            assert rel(grads[name], ref_grads[name]) < 2**-8, name
        else:
            assert torch.equal(grads[name], ref_grads[name]), name


@pytest.mark.parametrize('kind', ['pvt', 'swin-global'])
def test_projected_operator_keeps_no_projection(kind, monkeypatch):
    """What a training forward saves for the backward: the unfused kernels keep the packed
    projection ``(B, N, 2C)`` (PVT's kv) / ``(B, N, 3C)`` (Swin's qkv) -- the core needs
    its parts, the DWC v; the projected function keeps none of it (it recomputes the
    projection from x, which is kept anyway), so the layer saves exactly that less, but
    for the DWC bias repeated over the heads (C values), which a double backward's
    formula reads."""
    m = _projected_operator(kind)
    hw = (5, 7)
    x = torch.randn(2, 35, 32, requires_grad=True)

    def saved():
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(x, hw)
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        return {k: v for k, v in storages.items() if k not in params}

    fused = saved()
    with _unfused(monkeypatch):
        unfused = saved()
    packed_bytes = 2 * 35 * (64 if kind == 'pvt' else 96) * 4
    assert packed_bytes in unfused.values()
    assert packed_bytes not in fused.values(), fused
    assert sum(unfused.values()) - sum(fused.values()) == packed_bytes - 32 * 4


@pytest.mark.parametrize('name', ['flatten-pvt-v2', 'flatten-pvt-v2-cp', 'flatten-swin'])
def test_backbones_with_kernels_match_pytorch_path(name, monkeypatch):
    """Whole tiny FLatten backbones (no key reduction, every FLA layer on the projected
    path; with block checkpointing, which reruns the function's forward in the backward)
    with the kernels forced on give the multi-scale outputs and every parameter gradient
    of the PyTorch path: within 5e-5 of the largest value (float32 rounding of each FLA
    layer compounds over the four stages; observed at most 1.5e-5, on the last stage's
    patch-embedding weight)."""
    from flatten_mm.models import FLattenPVTv2, FLattenSwin
    calls = _projected_calls(monkeypatch)
    torch.manual_seed(0)
    pvt_arch = dict(embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                    mlp_ratios=(2, 2, 2, 2))
    model = {
        'flatten-pvt-v2': lambda: FLattenPVTv2(arch=pvt_arch, pretrain_img_size=64,
                                               drop_path_rate=0.),
        'flatten-pvt-v2-cp': lambda: FLattenPVTv2(arch=pvt_arch, pretrain_img_size=64,
                                                  drop_path_rate=0., with_cp=True),
        'flatten-swin': lambda: FLattenSwin(
            arch=dict(embed_dims=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)),
            pretrain_img_size=64, window_size=3, drop_path_rate=0.),
    }[name]().train()  # (training mode, no stochastic depth: the two runs must agree)
    fla_layers = [m for m in model.modules() if hasattr(m, 'use_triton')]
    with torch.no_grad():
        for m in fla_layers:
            m.scale.normal_(0, 0.5)
            m.positional_encoding.normal_(0, 0.5)
    x = torch.randn(2, 3, 64, 48)
    results = []
    for flag in (True, False):
        for m in fla_layers:
            m.use_triton = flag
        model.zero_grad()
        outs = model(x)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        results.append(([o.detach() for o in outs],
                        {k: p.grad.clone() for k, p in model.named_parameters()
                         if p.grad is not None}))
    # every FLA layer ran the projected path, once per forward (twice with checkpointing)
    assert len(calls) == len(fla_layers) * (2 if name.endswith('-cp') else 1) > 0
    (outs_k, grads_k), (outs_p, grads_p) = results
    for a, b in zip(outs_k, outs_p):
        assert _max_rel(a, b) < 5e-5
    assert set(grads_k) == set(grads_p)
    for key in grads_p:
        assert _max_rel(grads_k[key], grads_p[key]) < 5e-5, key


def test_packed_backward_op_registration():
    """Schema and fake implementation of ``flatten_mm::fla_core_backward_packed`` (the
    backward of the projected operators), with and without the positional table, the
    extra dv and q in the packed gradient (``torch.library.opcheck``); its ``[dq |] dk | dv``
    equal the unpacked op's (``dv`` plus the extra)."""
    B, N, C, h = 2, 12, 16, 2
    q, k, v, s, pos = (t.float() for t in _problem(B, N, N, C, True))
    g, extra = _rand(B, N, C, seed=8).float(), _rand(B, N, C, seed=9).float()
    _, kv, ks = torch.ops.flatten_mm.fla_core(q, k, v, s, pos, None, h, 3)
    for table, dv_extra, with_q in ((pos, extra, False), (None, None, True)):
        torch.library.opcheck(torch.ops.flatten_mm.fla_core_backward_packed.default,
                              (g, q, k, v, s, table, kv, ks, dv_extra, with_q, h, 3),
                              test_utils=('test_schema', 'test_faketensor'))
    ref = torch.ops.flatten_mm.fla_core_backward(g, q, k, v, s, pos, kv, ks, h, 3)
    dq, dkv, dscale, dpos = torch.ops.flatten_mm.fla_core_backward_packed(
        g, q, k, v, s, pos, kv, ks, extra, False, h, 3)
    assert torch.equal(dq, ref[0]) and torch.equal(dscale, ref[3])
    assert torch.equal(dpos, ref[4])
    assert torch.equal(dkv[..., :C], ref[1]) and torch.equal(dkv[..., C:], ref[2] + extra)
    empty, dqkv, dscale, dpos = torch.ops.flatten_mm.fla_core_backward_packed(
        g, q, k, v, s, pos, kv, ks, None, True, h, 3)
    assert empty.numel() == 0 and dqkv.shape == (B, N, 3 * C)
    assert torch.equal(dqkv, torch.cat(ref[:3], dim=-1))
    assert torch.equal(dscale, ref[3]) and torch.equal(dpos, ref[4])


def test_projected_inputs_refused_with_reasons():
    C = 8
    q = torch.zeros(1, 6, C)
    w, dw = torch.zeros(2 * C, C), torch.zeros(C, 1, 3, 3)
    check = fla_triton.check_projected_inputs
    assert check(q, q, w, None, dw, None, (2, 3)) is None
    assert 'no key reduction' in check(q, q[:, :4], w, None, dw, None, (2, 3))
    assert 'map' in check(q, q, w, None, dw, None, (2, 2))
    assert 'C -> 2C' in check(q, q, w[:C], None, dw, None, (2, 3))
    assert check(None, q, torch.zeros(3 * C, C), None, dw, None, (2, 3)) is None
    assert 'C -> 3C' in check(None, q, w, None, dw, None, (2, 3))
    assert 'odd-k' in check(q, q, w, None, torch.zeros(C, 1, 4, 4), None, (2, 3))
    assert 'dtypes' in check(q, q, w.double(), None, dw, None, (2, 3))
    with pytest.raises(ValueError, match='C -> 2C'):
        fla_triton.fla_projected_triton(q, q, w[:C], None, torch.zeros(1, 1, C), 2, 3,
                                        (2, 3), dw)


def test_backbone_attn_cfg_reaches_the_operator():
    from flatten_mm.models.backbones import FLattenPVTv2
    model = FLattenPVTv2(arch='b0', attn_cfg=dict(use_triton=False))
    flags = {m.use_triton for m in model.modules() if isinstance(m, FocusedLinearAttention)}
    assert flags == {False}


def test_custom_op_registration():
    """Schema, fake (meta) implementation and autograd registration of
    ``flatten_mm::fla_core`` (``torch.library.opcheck``)."""
    q, k, v, s, pos = (t.float() for t in _problem(1, 6, 6, 16, True))
    for t in (q, k, v, s):
        t.requires_grad_(True)
    res = torch.randn(1, 6, 16).bfloat16().requires_grad_(True)
    for residual in (None, res):
        torch.library.opcheck(torch.ops.flatten_mm.fla_core.default,
                              (q, k, v, s, pos, residual, 2, 3),
                              test_utils=('test_schema', 'test_autograd_registration',
                                          'test_faketensor'))


def test_dynamo_sees_one_node():
    """``torch.compile`` captures the kernels as the single ``flatten_mm::fla_core`` node,
    without graph break (the interpreter cannot run inductor / AOT tracing of Triton
    kernels on CPU; ``benchmarks/gpu_kernel_check.py`` compiles them on CUDA)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, s, pos):
        return fla.focused_linear_core(q, k, v, s, 2, 3, k_pos=pos, use_triton=True)

    q, k, v, s, pos = (t.float() for t in _problem(1, 6, 6, 16, True))
    out = torch.compile(f, backend=backend, fullgraph=True)(q, k, v, s, pos)
    assert len(graphs) == 1
    op = torch.ops.flatten_mm.fla_core
    targets = [n.target for n in graphs[0].graph.nodes if n.op == 'call_function'
               and n.target is not operator.getitem and 'autocast' not in str(n.target)]
    assert targets in ([op], [op.default]), targets  # nothing but the op
    assert torch.equal(out, f(q, k, v, s, pos))


def test_dynamo_captures_the_projected_operator_whole():
    """FLatten-PVT's operator with the kernels (the projected path) compiles in one graph
    (``fullgraph``: the ``autograd.Function`` is traced, no break) whose forward and
    backward bodies hold one ``fla_core`` / ``fla_core_backward_packed`` node each, and the
    compiled output equals eager."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = _projected_operator('pvt')
    x = torch.randn(2, 35, 32)
    out = torch.compile(lambda t: m(t, (5, 7)), backend=backend, fullgraph=True)(x)
    assert len(graphs) == 1
    top = [str(n.target) for n in graphs[0].graph.nodes if n.op == 'call_function']
    assert 'autograd_function_apply' in top, top
    # the Function's forward and backward bodies are subgraphs of the captured graph
    inner = [str(n.target) for _, sub in graphs[0].named_modules() if hasattr(sub, 'graph')
             for n in sub.graph.nodes if n.op == 'call_function']
    for op in ('flatten_mm.fla_core', 'flatten_mm.fla_core_backward_packed'):
        assert sum(t in (op, op + '.default') for t in inner) == 1, (op, inner)
    assert torch.equal(out, m(x, (5, 7)))


# --------------------------------------------------------------------------- GPU check tool
def _load_tool():
    import importlib.util
    import os.path as osp
    path = osp.join(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))),
                    'benchmarks', 'gpu_kernel_check.py')
    spec = importlib.util.spec_from_file_location('gpu_kernel_check', path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_gpu_check_tool_arguments_and_refusal(tmp_path, monkeypatch, capsys):
    """Argument parsing, and without CUDA exit code 2 with a message and nothing written."""
    tool = _load_tool()
    args = tool.parse_args(['--out', str(tmp_path)])
    assert (args.batch, args.dtypes, args.kernels, args.device) == (8, ['fp32', 'bf16'],
                                                                    ['fla', 'quadtree'], 'cuda')
    assert tool.CASES_OF['fla'](args) == list(tool.DEFAULT_CASES)
    assert set(tool.DEFAULT_CASES) <= set(tool.FLA_CASES)
    with pytest.raises(SystemExit):
        tool.parse_args(['--out', str(tmp_path), '--cases', 'swin-t-stage1,nope'])
    assert 'nope' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.parse_args(['--out', str(tmp_path), '--dtypes', 'fp64'])
    with pytest.raises(SystemExit):
        tool.parse_args([])  # --out is required
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    out = tmp_path / 'out'
    assert tool.main(['--out', str(out)]) == 2
    assert 'CUDA' in capsys.readouterr().err
    assert not out.exists()


def test_gpu_check_tool_check_runs_interpreted(monkeypatch):
    """The tool's per-case check on CPU (interpreted kernels, a tiny case): every error
    record present, finite and passing."""
    tool = _load_tool()
    monkeypatch.setitem(tool.FLA_CASES, 'tiny', (4, 16, 2, 2))
    args = tool.parse_args(['--out', 'unused', '--cases', 'tiny', '--batch', '1',
                            '--no-timing'])
    args.device = 'cpu'
    for dtype in ('fp32', 'bf16'):
        rec = tool.check_fla('tiny', dtype, args)
        assert set(rec['errors']) == {'out', 'dq', 'dk', 'dv', 'dscale', 'dpos',
                                      'out+residual'}
        assert rec['passed'], rec
        assert (rec['tokens'], rec['keys']) == (16, 4)
        assert 'operator' not in rec  # (key reduction: no projected path)


def test_gpu_check_tool_checks_the_projected_operators(monkeypatch):
    """Cases without key reduction also check the whole operator (FLatten-PVT's for
    ``pvt*``, FLatten-Swin's for ``swin*``) on the projected path against the float64
    PyTorch path: the path really ran, every gradient is recorded and passes."""
    tool = _load_tool()
    for case in ('pvt-tiny', 'swin-tiny'):
        monkeypatch.setitem(tool.FLA_CASES, case, (4, 16, 2, 1))
    args = tool.parse_args(['--out', 'unused', '--cases', 'pvt-tiny,swin-tiny', '--batch', '2',
                            '--no-timing', '--dtypes', 'fp32'])
    args.device = 'cpu'
    for case, module, proj in (('pvt-tiny', 'FocusedLinearAttention', 'dkv.weight'),
                               ('swin-tiny', 'FocusedLinearAttentionQKV', 'dqkv.weight')):
        rec = tool.check_fla(case, 'fp32', args)
        op = rec['operator']
        assert op['module'] == module and op['projected_path'], op
        assert {'out', 'dx', 'dscale', 'dpositional_encoding', 'ddwc.weight', proj} <= set(
            op['errors']), op['errors']
        assert op['passed'] and rec['passed'], op


