"""The memory-lean training path of Focused Linear Attention (``FocusedLinearCore``,
issue #35): the same outputs and gradients as the op-by-op formula, non-finite values
handled as before, and only the inputs (plus ``d x d`` per head) kept for the backward."""
import pytest
import torch

from flatten_mm.models.layers import focused_linear_attention as fla
from flatten_mm.models.layers.focused_linear_attention import focused_linear_core_reference
from flatten_mm.models.layers.focused_linear_function import (FocusedLinearCore,
                                                              focused_linear_core_lean)
from flatten_mm.registry import MODELS

CASES = [  # (B, N, n, C, heads, p, with_pos)
    (2, 30, 30, 16, 1, 3, True),
    (1, 42, 20, 24, 3, 3, False),  # reduced keys (n != N)
    (2, 35, 12, 32, 4, 2, True),
    (1, 16, 16, 8, 2, 5, True),
]


def _inputs(B, N, n, C, with_pos, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, m, C, generator=g, dtype=dtype) for m in (N, n, n))
    scale = 0.5 * torch.randn(1, 1, C, generator=g, dtype=dtype)
    pos = torch.randn(1, n, C, generator=g, dtype=dtype) if with_pos else None
    return [t.requires_grad_() for t in (q, k, v, scale, pos) if t is not None]


def _reference(ins, h, p, with_pos):
    q, k, v, scale = ins[:4]
    return focused_linear_core_reference(q, k + ins[4] if with_pos else k, v, scale, h, p)


@pytest.mark.parametrize('B,N,n,C,h,p,with_pos', CASES)
def test_outputs_and_gradients_equal_the_formula_in_float64(B, N, n, C, h, p, with_pos):
    ins = _inputs(B, N, n, C, with_pos)
    out = focused_linear_core_lean(*ins[:4], h, p, k_pos=ins[4] if with_pos else None)
    ref = _reference(ins, h, p, with_pos)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, ins, grad)
    want = torch.autograd.grad(ref, ins, grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    ins = _inputs(1, 12, 9, 8, True)

    def f(q, k, v, scale, pos):
        return focused_linear_core_lean(q, k, v, scale, 2, 3, k_pos=pos)

    assert torch.autograd.gradcheck(f, tuple(ins), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_float32_gradients_are_float32_rounding_of_the_float64_ones():
    ins64 = _inputs(2, 300, 300, 64, True)
    ins32 = [t.detach().float().requires_grad_() for t in ins64]
    out = focused_linear_core_lean(*ins32[:4], 2, 3, k_pos=ins32[4])
    ref = _reference(ins64, 2, 3, True)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, ins32, grad.float())
    want = torch.autograd.grad(ref, ins64, grad)
    assert out.dtype == torch.float32
    # measured: 3e-7 (output) to 6e-7 (gradients) of the largest magnitude
    for a, b in zip((out, *got), (ref, *want)):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 4e-6


def _nonfinite_and_dead_tokens():
    ins = [t.detach() for t in _inputs(2, 40, 40, 16, True, dtype=torch.float64)]
    ins[0][0, 3, 5] = float('nan')  # a NaN query channel
    ins[1][1, 7, 2] = float('inf')  # an infinite key channel
    ins[0][1, 4] = -1.0  # a query token with every channel <= 0 (ReLU gives 1e-6 only)
    ins[1][0, 6] = -2.0  # a key token likewise
    return [t.requires_grad_() for t in ins]


def test_non_finite_inputs_and_dead_tokens_as_the_formula():
    """NaN / Inf reach the same outputs and gradients as the op-by-op computation, and a
    token whose channels are all <= 0 (its ||y|| ~ 1e-18) keeps finite gradients."""
    ins = _nonfinite_and_dead_tokens()
    out = focused_linear_core_lean(*ins[:4], 2, 3, k_pos=ins[4])
    got = torch.autograd.grad(out, ins, torch.ones_like(out))
    ins_ref = [t.detach().clone().requires_grad_() for t in ins]
    ref = _reference(ins_ref, 2, 3, True)
    want = torch.autograd.grad(ref, ins_ref, torch.ones_like(ref))
    for a, b in zip((out, *got), (ref, *want)):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        ok = torch.isfinite(b)
        torch.testing.assert_close(a[ok], b[ok], rtol=1e-9, atol=1e-12)
    # the dead query token's gradient is finite in the batch without NaN / Inf keys
    assert torch.isfinite(got[0][1, 4]).all() or not torch.isfinite(out[1]).all()


def _saved_bytes(fn, *args):
    total = []

    def pack(t):
        total.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(total)


def test_keeps_its_inputs_and_no_features_for_the_backward():
    """Saved for the backward: q, k, v, scale, the positional table and the per-head
    (d x d) and (d x 1) sums -- nothing else of size N, however large N is."""
    for N in (256, 1024):
        ins = [t.detach().float().requires_grad_() for t in _inputs(2, N, N, 32, True)]
        saved = _saved_bytes(lambda: focused_linear_core_lean(*ins[:4], 4, 3, k_pos=ins[4]))
        inputs = sum(t.numel() * 4 for t in ins)
        per_head = 2 * 4 * (8 * 8 + 8) * 4
        assert saved == inputs + per_head, (N, saved, inputs)
        formula = _saved_bytes(lambda: _reference(ins, 4, 3, True))
        assert formula > 4 * inputs  # what the lean path avoids


_PVT = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
            mlp_ratios=(2, 2, 2, 2))
TINY = dict(FLattenPVT=_PVT, FLattenPVTv2=_PVT,
            FLattenSwin=dict(embed_dims=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)),
            FLattenCSWin=dict(embed_dims=8, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4)))


def _tiny(cls_name, with_cp):
    torch.manual_seed(0)
    model = MODELS.get(cls_name)(arch=TINY[cls_name], with_cp=with_cp, drop_path_rate=0.)
    return model.train()


def _step(model, x):
    outs = model(x)
    loss = sum((o.float() * torch.linspace(0.5, 1.5, o.shape[1]).view(1, -1, 1, 1)).mean()
               for o in outs)
    loss.backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None}


def _op_by_op(q, k, v, scale, num_heads, focusing_factor, k_pos, residual):
    out = focused_linear_core_reference(q, k if k_pos is None else k + k_pos, v, scale,
                                        num_heads, focusing_factor)
    return out if residual is None else out + residual.to(out.dtype)


def _error_to_largest(a: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |a - reference| / max |reference|``."""
    return ((a - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize('with_cp', [False, True])
@pytest.mark.parametrize('cls_name', sorted(TINY))
def test_backbones_train_as_with_the_op_by_op_core(cls_name, with_cp, monkeypatch):
    """A training step of every FLatten family, with and without ``with_cp``: outputs and
    every parameter gradient as with the op-by-op core, within float32 rounding."""
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    calls = []
    apply = FocusedLinearCore.apply
    monkeypatch.setattr(FocusedLinearCore, 'apply',
                        lambda *a: calls.append(1) or apply(*a))
    outs, grads = _step(_tiny(cls_name, with_cp), x.clone().requires_grad_(with_cp))
    assert calls  # the lean path ran
    monkeypatch.setattr(fla, '_focused_linear_core_torch', _op_by_op)
    ref_outs, ref_grads = _step(_tiny(cls_name, with_cp), x.clone().requires_grad_(with_cp))
    assert grads.keys() == ref_grads.keys()
    # both relative to the reference's largest magnitude (an element-wise rtol fails on
    # entries near zero: 1.05e-6 off at a value of 3.6e-3 after eight Swin blocks on an
    # AVX-512 Xeon, while every output is within 6e-7 of its largest value)
    for a, b in zip(outs, ref_outs):
        assert a.shape == b.shape
        assert _error_to_largest(a, b) < 1e-5
    for name in grads:
        assert _error_to_largest(grads[name], ref_grads[name]) < 1e-4, name


def test_backward_inside_autocast_runs_as_outside():
    """A backward called inside a bf16 autocast region (as in a step that wraps both
    passes) computes the core's gradients in float32, as one outside it: equal bit for
    bit (and no error from a GEMM cast to bf16 under the hood)."""
    ins = [t.detach().float().requires_grad_() for t in _inputs(2, 40, 24, 16, True)]
    grad = torch.randn(2, 40, 16, dtype=torch.float32)
    want = torch.autograd.grad(focused_linear_core_lean(*ins[:4], 4, 3, k_pos=ins[4]),
                               ins, grad)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = focused_linear_core_lean(*ins[:4], 4, 3, k_pos=ins[4])
        got = torch.autograd.grad(out, ins, grad)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)


@pytest.mark.parametrize('strided,per_sample', [(False, False), (True, True), (False, True)])
def test_every_gemm_branch_gives_the_formula(monkeypatch, strided, per_sample):
    """Each branch of the head GEMMs gives the formula's outputs and gradients, with
    autograd and without: GEMMs writing head-strided views or not (``strided_out_ok``
    false: MPS and the other non-CPU / CUDA backends), the batch whole or one sample at a
    time (``batch_chunks``, by default only for maps of ``PER_SAMPLE_NUMEL`` and more)."""
    from flatten_mm.models.layers import focused_linear_function as flf
    if not strided:
        monkeypatch.setattr(flf, 'strided_out_ok', lambda out: False)
    if per_sample:
        monkeypatch.setattr(flf, 'PER_SAMPLE_NUMEL', 0)
    assert len(flf.batch_chunks(2, 4, 35, 32)) == (2 if per_sample else 1)
    ins = _inputs(2, 35, 12, 32, True)
    out = focused_linear_core_lean(*ins[:4], 4, 3, k_pos=ins[4])
    ref = _reference(ins, 4, 3, True)
    grad = torch.randn_like(ref)
    for a, b in zip((out, *torch.autograd.grad(out, ins, grad)),
                    (ref, *torch.autograd.grad(ref, ins, grad))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        plain = fla.focused_linear_core(*ins[:4], 4, 3, k_pos=ins[4])
    torch.testing.assert_close(plain, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize('B,N,n,C,h,p,with_pos', CASES)
def test_graph_capture_form_gives_the_formula(B, N, n, C, h, p, with_pos, monkeypatch):
    """While a graph is captured the key mean is a matrix product (``ops.capture``); the
    core still gives the formula's outputs and gradients, with and without autograd."""
    from flatten_mm.models.layers import focused_linear_function as flf
    products = []
    mean = torch.Tensor.mean
    monkeypatch.setattr(flf, 'graph_capture', lambda: True)
    monkeypatch.setattr(torch.Tensor, 'mean', lambda *a, **k: products.append(0) or mean(*a, **k))
    ins = _inputs(B, N, n, C, with_pos)
    pos = ins[4] if with_pos else None
    out = focused_linear_core_lean(*ins[:4], h, p, k_pos=pos)
    with torch.no_grad():
        plain = fla.focused_linear_core(*ins[:4], h, p, k_pos=pos)
    assert not products  # no Tensor.mean on the captured path
    monkeypatch.setattr(torch.Tensor, 'mean', mean)
    ref = _reference(ins, h, p, with_pos)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(plain, ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(torch.autograd.grad(out, ins, grad), torch.autograd.grad(ref, ins, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_batch_chunks_split_only_large_multi_head_batches():
    from flatten_mm.models.layers.focused_linear_function import PER_SAMPLE_NUMEL, batch_chunks
    big = PER_SAMPLE_NUMEL // 64
    assert batch_chunks(3, 4, big, 64) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert batch_chunks(3, 1, big, 64) == [slice(0, 3)]  # one head: the views fold
    assert batch_chunks(1, 4, big, 64) == [slice(0, 1)]
    assert batch_chunks(3, 4, big - 1, 64) == [slice(0, 3)]  # small maps: one call


def test_empty_batch_on_a_large_multi_head_map():
    """B = 0 on a map of ``PER_SAMPLE_NUMEL`` activations and more heads than one (where
    the batch would be split per sample): an empty output, empty gradients, with and
    without autograd (before: ``batch_chunks`` returned no chunk and the core failed)."""
    from flatten_mm.models.layers.focused_linear_function import PER_SAMPLE_NUMEL, batch_chunks
    N, C = PER_SAMPLE_NUMEL // 32, 32
    assert batch_chunks(0, 4, N, C) == [slice(0, 0)]
    ins = _inputs(0, N, N, C, True, dtype=torch.float32)
    out = focused_linear_core_lean(*ins[:4], 4, 3, k_pos=ins[4])
    assert out.shape == (0, N, C)
    grads = torch.autograd.grad(out.sum(), ins)
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in ins]
    assert all(not g.any() for g in grads)
    with torch.no_grad():
        assert fla.focused_linear_core(*ins[:4], 4, 3, k_pos=ins[4]).shape == (0, N, C)


@pytest.mark.parametrize('per_sample', [False, True])
def test_compiled_training_step_is_one_graph_and_equals_eager(monkeypatch, per_sample):
    """``torch.compile(fullgraph=True)`` traces forward and backward of the core (AOT
    autograd: the backward's GEMMs and quotients without strided ``out=``, which Dynamo
    refuses) and gives eager's outputs and gradients, the batch whole or per sample."""
    from flatten_mm.models.layers import focused_linear_function as flf
    if per_sample:
        monkeypatch.setattr(flf, 'PER_SAMPLE_NUMEL', 0)
    ins = _inputs(2, 35, 12, 32, True, dtype=torch.float32)
    grad = torch.randn(2, 35, 32, generator=torch.Generator().manual_seed(1))

    def step(*ins):
        return focused_linear_core_lean(*ins[:4], 4, 3, k_pos=ins[4])

    torch._dynamo.reset()
    compiled = torch.compile(step, backend='aot_eager', fullgraph=True)
    got = compiled(*ins)
    got_grads = torch.autograd.grad(got, ins, grad)
    want = step(*ins)
    want_grads = torch.autograd.grad(want, ins, grad)
    torch._dynamo.reset()
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_double_backward_equals_the_formula():
    """``create_graph=True`` (gradient penalties): the backward differentiates the op-by-op
    formula, so second derivatives are exact -- ``gradgradcheck`` in float64, and a
    gradient penalty's gradients equal the formula's (before: "trying to differentiate
    twice a function that was marked with @once_differentiable")."""
    ins = _inputs(1, 10, 7, 8, True)

    def f(q, k, v, scale, pos):
        return focused_linear_core_lean(q, k, v, scale, 2, 3, k_pos=pos)

    assert torch.autograd.gradgradcheck(f, tuple(ins), eps=1e-6, atol=1e-5, rtol=1e-4)
    w = torch.randn(1, 10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    results = []
    for fn in (f, lambda *t: _reference(t, 2, 3, True)):
        g = torch.autograd.grad((fn(*ins) * w).sum(), ins, create_graph=True)
        results.append(torch.autograd.grad(sum(t.square().sum() for t in g), ins))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_large_gradients_at_dead_tokens_stay_finite():
    """A token whose channels are all <= 0 has ``||y|| ~ 1e-18`` (p = 3): the backward's
    ``||y||`` terms are grouped so that a large incoming gradient there (a second-order
    pass gives up to 1e8) keeps every gradient finite and equal to float64's."""
    ins64 = _inputs(2, 40, 40, 8, False)
    with torch.no_grad():
        ins64[0][0, :3] = -ins64[0][0, :3].abs()  # dead query tokens
        ins64[1][1, :2] = -ins64[1][1, :2].abs()  # dead key tokens
    ins32 = [t.detach().float().requires_grad_() for t in ins64]
    grad = 1e8 * torch.randn(2, 40, 8, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(focused_linear_core_lean(*ins32, 1, 3), ins32, grad.float())
    want = torch.autograd.grad(_reference(ins64, 1, 3, False), ins64, grad)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert float((a.double() - b).abs().max() / b.abs().max()) < 1e-4
