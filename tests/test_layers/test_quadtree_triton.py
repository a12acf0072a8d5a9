"""The Triton kernels of QuadTree attention (``ops.quadtree_triton``: gathered
scores, gathered messages, the fused final level of variants B and A) on the CPU, under
Triton's interpreter: forward and gradients against the PyTorch path (``_GatheredMatmul``)
and a float64 gather reference, the whole core (A and B, training and inference paths)
with the kernels on and off, the switches and the custom-op registration (the compile for
GPU targets without a GPU: test_kernel_dispatch.py).

As in test_fla_triton.py, ``TRITON_INTERPRET=1`` is set before the kernel module is
imported (Triton decides at decoration time) and around each test. Never skipped: without
Triton the import fails.
"""
import operator
import os
import re

import pytest
import torch
from conftest import import_interpreted

# (the kernels need Triton: fail, never skip, without it)
_, qt = import_interpreted('triton', 'flatten_mm.models.ops.quadtree_triton')
from benchmarks.core.profiling import saved_for_backward  # noqa: E402
from flatten_mm.models.layers import QuadTreeAttention  # noqa: E402
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels  # noqa: E402
from flatten_mm.models.layers import focused_linear_attention as fla  # noqa: E402
from flatten_mm.models.ops import dispatch  # noqa: E402
from flatten_mm.models.ops import quadtree_paths  # noqa: E402
from flatten_mm.models.layers import quadtree_attention as qa  # noqa: E402
from flatten_mm.models.ops.quadtree_gather import _GatheredMatmul  # noqa: E402

pytestmark = pytest.mark.usefixtures('triton_interpreter')


def test_kernels_are_interpreted():
    assert qt.INTERPRETED, (
        'the QuadTree kernel module was imported before TRITON_INTERPRET=1 was set: its '
        'kernels cannot run on CPU tensors')


# --------------------------------------------------------------------------- helpers
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _gather(src, index):
    """``src[b, j, index[b, j]]`` by advanced indexing: ``(B, h, L, K, d)``."""
    B, h = index.shape[:2]
    return src[torch.arange(B).view(B, 1, 1, 1), torch.arange(h).view(1, h, 1, 1), index]


#: the four kernels: gathered scores, gathered messages, the fused final level of B
#: (without and with its level weight) and of A; each as (kernel, PyTorch path,
#: reference): the PyTorch path is the operator's (chunks of 2 parents, so several chunks
#: run), the reference a float64 gather by advanced indexing, independent of both. ``src``
#: holds the key table (and the value table for the final levels, and A's prev_score ``(B,
#: h, L, K / 4)`` or B's 0-d level weight third; the kernel takes the weight in float32)
KINDS = {
    'scores': (
        lambda a, src, index: qt.gathered_scores_triton(a, src[0], index),
        lambda a, src, index: _GatheredMatmul.apply(a, src[0], index, True, 2),
        lambda a, src, index: a @ _gather(src[0], index).transpose(-1, -2)),
    'messages': (
        lambda a, src, index: qt.gathered_messages_triton(a, src[0], index),
        lambda a, src, index: _GatheredMatmul.apply(a, src[0], index, False, 2),
        lambda a, src, index: a @ _gather(src[0], index)),
    'final-b': (
        lambda a, src, index: qt.final_level_b_triton(a, src[0], src[1], index),
        lambda a, src, index: _GatheredMatmul.apply(
            _GatheredMatmul.apply(a, src[0], index, True, 2).softmax(-1), src[1], index,
            False, 2),
        lambda a, src, index: (a @ _gather(src[0], index).transpose(-1, -2)).softmax(-1)
        @ _gather(src[1], index)),
    'final-b-scaled': (
        lambda a, src, index: qt.final_level_b_triton(a, src[0], src[1], index,
                                                      src[2].float()),
        lambda a, src, index: _GatheredMatmul.apply(
            _GatheredMatmul.apply(a, src[0], index, True, 2).softmax(-1), src[1], index,
            False, 2) * src[2],
        lambda a, src, index: (a @ _gather(src[0], index).transpose(-1, -2)).softmax(-1)
        @ _gather(src[1], index) * src[2]),
    'final-a': (
        lambda a, src, index: qt.final_level_a_triton(a, src[0], src[1], index, src[2]),
        lambda a, src, index: _GatheredMatmul.apply(
            _grouped_weights(_GatheredMatmul.apply(a, src[0], index, True, 2), src[2]),
            src[1], index, False, 2),
        lambda a, src, index: _grouped_weights(
            a @ _gather(src[0], index).transpose(-1, -2), src[2]) @ _gather(src[1], index)),
}


def _grouped_weights(scores, prev_score):
    """Variant A's final-level weights, as ``quadtree_attention_core`` computes them:
    softmax within groups of 4 consecutive candidates, times the parent's prev_score."""
    attn = torch.softmax(scores.unflatten(-1, (prev_score.shape[-1], 4)), -1)
    return (attn * prev_score[:, :, :, None, :, None]).flatten(-2)


def _run(fn, a, srcs, index, grad, dtype):
    """Output and gradients w.r.t. ``a`` and every ``src`` of ``(fn(a, srcs, index) *
    grad).sum()``, inputs cast to ``dtype``; results in float64."""
    a = a.detach().to(dtype).requires_grad_(True)
    srcs = [s.detach().to(dtype).requires_grad_(True) for s in srcs]
    out = fn(a, srcs, index)
    grads = torch.autograd.grad(out, [a] + srcs, grad.to(out.dtype))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    return [out.double()] + [g.double() for g in grads]


def _problem(B, h, L, nf, M, d, K, kind, seed=0, index=None):
    """float64 ``a`` (queries or weights), the key / value tables, candidate rows and an
    output gradient for ``kind``."""
    a = torch.randn(B, h, L, nf, K if kind == 'messages' else d, generator=_gen(seed),
                    dtype=torch.float64)
    srcs = [torch.randn(B, h, M, d, generator=_gen(seed + 1 + i), dtype=torch.float64)
            for i in range(2 if kind.startswith('final') else 1)]
    if kind == 'final-a':  # prev_score: positive weights of the K / 4 candidate parents
        srcs.append(torch.rand(B, h, L, K // 4, generator=_gen(seed + 4), dtype=torch.float64))
    if kind == 'final-b-scaled':  # a level weight (softmax of the level logits: in (0, 1))
        srcs.append(torch.rand((), generator=_gen(seed + 4), dtype=torch.float64) * 0.9 + 0.05)
    if index is None:
        index = torch.randint(0, M, (B, h, L, K), generator=_gen(seed + 5))
    grad = torch.randn(B, h, L, nf, K if kind == 'scores' else d, generator=_gen(seed + 6),
                       dtype=torch.float64)
    return a, srcs, index, grad


def _max_rel(a, b, magnitude=None):
    """Largest error relative to the largest reference value, or to ``magnitude``: for the
    gradient of B's level weight, a sum of ``g . out`` over all rows with cancellations,
    the sum of the terms' absolute values (what the float32 sums' rounding scales with)."""
    return ((a - b).abs().max() / (b.abs().max() if magnitude is None else magnitude)).item()


def _terms(kind, ref, srcs, grad):
    """Per result of ``_run`` (out, da, dsrc...), the magnitude ``_max_rel`` takes: None,
    but for the level weight's gradient (``final-b-scaled``) the sum over rows of
    ``|g . out / scale|`` (float64 reference)."""
    mags = [None] * len(ref)
    if kind == 'final-b-scaled':
        mags[-1] = (grad * ref[0] / srcs[2]).sum(-1).abs().sum().item()
    return mags


# (B, h, L, F, M, d, K): several heads and odd L (a masked tail in the 2-parent blocks),
# K and d not powers of two (masked lanes; for A also padded groups of 4), few key rows
# (every row chosen by many parents and, in the first case, repeated inside a parent and
# inside a group of 4: the atomic adds must accumulate)
CASES = {
    'dup-rows-3-heads-odd-L': (2, 3, 7, 4, 5, 8, 12),
    'd24-K20': (1, 2, 5, 4, 40, 24, 20),
    'one-head-F4-K128': (1, 1, 3, 4, 150, 32, 128),  # QuadTree-B's topk 32: 4K = 128
}
#: observed max relative errors (forward and every gradient, fp32 vs float64, over CASES x
#: KINDS): kernels <= 6.7e-7, PyTorch path <= 6.6e-7. Bound: about 8x.
_FP32_BOUND = 5e-6


@pytest.mark.parametrize('kind', list(KINDS))
@pytest.mark.parametrize('case', list(CASES))
def test_forward_and_gradients_match_float64_and_torch_path(case, kind):
    kernel, torch_path, reference = KINDS[kind]
    a, srcs, index, grad = _problem(*CASES[case], kind=kind)
    ref = _run(reference, a, srcs, index, grad, torch.float64)
    ours = _run(kernel, a, srcs, index, grad, torch.float32)
    torch_out = _run(torch_path, a, srcs, index, grad, torch.float32)
    assert len(ours) == 2 + len(srcs)
    mags = _terms(kind, ref, srcs, grad)
    for name, x, t, r, m in zip(('out', 'da', 'dsrc', 'dsrc2', 'dprev'), ours, torch_out, ref,
                                mags):
        assert _max_rel(x, r, m) < _FP32_BOUND, (name, _max_rel(x, r, m))
        assert _max_rel(t, r, m) < _FP32_BOUND, (name, _max_rel(t, r, m))
        assert _max_rel(x, t, m) < _FP32_BOUND, (name, _max_rel(x, t, m))


@pytest.mark.parametrize('kind', list(KINDS))
def test_all_parents_on_two_rows_accumulate(kind):
    """The candidates of every parent (several per program, both programs) alternate
    between key rows 3 and 1: the table gradients are zero except those rows, which hold
    the sums of all ``L * F * K / 2`` terms each."""
    B, h, L, nf, M, d, K = 1, 2, 5, 4, 6, 8, 4
    index = torch.tensor([3, 1] * (K // 2)).expand(B, h, L, K)
    kernel, _, reference = KINDS[kind]
    a, srcs, index, grad = _problem(B, h, L, nf, M, d, K, kind, seed=5, index=index)
    ours = _run(kernel, a, srcs, index, grad, torch.float32)
    ref = _run(reference, a, srcs, index, grad, torch.float64)
    tables = 2 if kind.startswith('final') else 1
    for dsrc, r in zip(ours[2:2 + tables], ref[2:2 + tables]):
        assert dsrc[:, :, [1, 3]].abs().min() > 1e-3
        assert torch.equal(dsrc[:, :, [0, 2, 4, 5]], torch.zeros_like(dsrc[:, :, :4]))
        assert _max_rel(dsrc, r) < _FP32_BOUND
    mags = _terms(kind, ref, srcs, grad)
    for x, r, m in zip(ours[2 + tables:], ref[2 + tables:], mags[2 + tables:]):
        assert _max_rel(x, r, m) < _FP32_BOUND  # A's prev_score, B's level weight


@pytest.mark.parametrize('kind', list(KINDS))
def test_non_contiguous_inputs(kind):
    """``a`` as a permuted view, the tables as the head split of channels-last tokens (as
    ``_to_heads`` makes them), ``index`` as a strided slice: read through their strides,
    bit-identical results to contiguous copies."""
    B, h, L, nf, M, d, K = 2, 2, 5, 4, 9, 8, 8 if kind == 'final-a' else 6
    kernel, _, reference = KINDS[kind]
    a, srcs, index, grad = _problem(B, h, L, nf, M, d, K, kind, seed=9)
    a = a.float().transpose(2, 3).contiguous().transpose(2, 3)
    srcs = [s.float().transpose(1, 2).contiguous().transpose(1, 2) if s.dim() == 4
            else s.float() for s in srcs]  # (B's 0-d level weight as it is)
    index = torch.stack([index, index], -1).flatten(-2)[..., ::2]
    assert not (a.is_contiguous() or index.is_contiguous()
                or any(s.is_contiguous() for s in srcs if s.dim() == 4))
    out = _run(kernel, a, srcs, index, grad, torch.float32)
    ref = _run(kernel, a.contiguous(), [s.contiguous() for s in srcs], index.contiguous(),
               grad, torch.float32)
    for x, r in zip(out, ref):
        assert torch.equal(x, r)
    f64 = _run(reference, a.double(), [s.double() for s in srcs], index, grad, torch.float64)
    mags = _terms(kind, f64, [s.double() for s in srcs], grad)
    assert all(_max_rel(x, r, m) < _FP32_BOUND for x, r, m in zip(out, f64, mags))


_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize('kind', list(KINDS))
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_float32(dtype, kind):
    """bf16 / fp16 inputs: output and gradients (in the input dtype) within one rounding
    of that dtype (+ 1e-5 of the largest value) of float64 on the same rounded inputs; an
    accumulation in the half dtype over K = 64 terms would be far outside."""
    kernel, _, reference = KINDS[kind]
    a, srcs, index, grad = _problem(1, 2, 5, 4, 30, 16, 64, kind, seed=7)
    a, grad = a.to(dtype).double(), grad.to(dtype).double()  # rounded, exactly
    srcs = [s.to(dtype).double() for s in srcs]
    ref = _run(reference, a, srcs, index, grad, torch.float64)
    ours = _run(kernel, a, srcs, index, grad, dtype)
    u = _UNIT_ROUNDOFF[dtype]
    mags = _terms(kind, ref, srcs, grad)
    for name, x, r, m in zip(('out', 'da', 'dsrc', 'dsrc2', 'dprev'), ours, ref, mags):
        # (B's level weight: its gradient, a sum with cancellations, to 1e-5 of its terms)
        bound = u * r.abs() + 1e-5 * (r.abs().max() if m is None else m)
        assert ((x - r).abs() <= bound).all(), (name, ((x - r).abs() - bound).max().item())


#: the kernels on parent lists (``parent_width``: each entry is a cell of a coarser grid
#: that wide, whose 4 children are the candidates), as the core calls them
PARENT_KERNELS = {
    'scores': lambda a, src, cells, pw: qt.gathered_scores_triton(a, src[0], cells, pw),
    'messages': lambda a, src, cells, pw: qt.gathered_messages_triton(a, src[0], cells, pw),
    'final-b': lambda a, src, cells, pw: qt.final_level_b_triton(a, src[0], src[1], cells,
                                                                 None, pw),
    'final-b-scaled': lambda a, src, cells, pw: qt.final_level_b_triton(
        a, src[0], src[1], cells, src[2].float(), pw),
    'final-a': lambda a, src, cells, pw: qt.final_level_a_triton(a, src[0], src[1], cells,
                                                                 src[2], pw),
}


@pytest.mark.parametrize('cells_dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('kind', list(KINDS))
def test_parent_lists_give_the_candidate_lists_results(kind, cells_dtype):
    """Kernels handed parent cells (``(B, h, L, K / 4)`` of a 3 x 5 grid: odd, not square,
    repeated cells, a strided view) derive their children themselves: output and every
    gradient bit-identical to the same kernels on the expanded candidate lists
    (``_child_candidates``), and within the fp32 bound of float64. A wrong child order or
    row stride in the derivation changes the gathered rows."""
    B, h, L, nf, d, Kp, hc, pw = 2, 2, 7, 4, 8, 3, 3, 5
    M = 4 * hc * pw  # the finer grid: 6 x 10
    cells = torch.randint(0, hc * pw, (B, h, L, 2 * Kp), generator=_gen(31))
    cells = cells.to(cells_dtype)[..., ::2]
    assert not cells.is_contiguous()
    cand = qa.child_candidates(cells.long(), pw)
    a, srcs, _, grad = _problem(B, h, L, nf, M, d, 4 * Kp, kind, seed=33, index=cand)
    ours = _run(lambda a, s, i: PARENT_KERNELS[kind](a, s, cells, pw), a, srcs, None, grad,
                torch.float32)
    expanded = _run(KINDS[kind][0], a, srcs, cand, grad, torch.float32)
    ref = _run(KINDS[kind][2], a, srcs, cand, grad, torch.float64)
    mags = _terms(kind, ref, srcs, grad)
    for x, e, r, m in zip(ours, expanded, ref, mags):
        assert torch.equal(x, e)
        assert _max_rel(x, r, m) < _FP32_BOUND


def test_parent_lists_refused_when_the_grid_does_not_fit():
    a, src, index = _small_level()  # (M = 6 key rows)
    qt.gathered_scores_triton(a, src, index[..., :1] % 2, 2)  # (a 2 x 2 map of 2 x 1 cells)
    with pytest.raises(ValueError, match='not a map of width 6'):
        qt.gathered_scores_triton(a, src, index[..., :1], 3)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match='parent_width must be an int'):
            qt.gathered_scores_triton(a, src, index[..., :1], bad)


# --------------------------------------------------------------------------- the core
def _pyramids(B, C, hw, levels, seed):
    gen = _gen(seed)
    out = []
    for _ in range(3):
        maps = [torch.randn(B, C, hw[0] >> s, hw[1] >> s, generator=gen)
                for s in range(levels)]
        out.append(maps[::-1])
    return out


def _count_kernel_calls(monkeypatch):
    calls = []
    for name in ('gathered_scores_triton', 'gathered_messages_triton', 'final_level_b_triton',
                 'final_level_a_triton', 'final_level_projected_triton'):
        real = getattr(qt, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(qt, name, spy)
    return calls


@pytest.mark.parametrize('attn_type', ['A', 'B'])
@pytest.mark.parametrize('grad', [False, True], ids=['infer', 'train'])
def test_path_hook_names_the_triton_paths_that_ran(attn_type, grad, monkeypatch):
    """With the kernels forced, ``quadtree_paths.record_paths`` reports the table's Triton
    paths, and the kernels that ran are those paths' kernels: the fused one for the final
    level (and B's inner levels when training), the gathered ones otherwise."""
    calls = _count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, attn_type=attn_type, num_levels=3, topk=4, use_triton=True)
    x = torch.randn(1, 8 * 8, 16)
    with torch.set_grad_enabled(grad), quadtree_paths.record_paths() as taken:
        m(x, (8, 8))
    inner = 'triton_fused' if attn_type == 'B' and grad else 'triton_gathers'
    assert [(t.level, t.path) for t in taken] == [(1, inner), (2, 'triton_fused')]
    fused = {'final_level_a_triton', 'final_level_b_triton', 'final_level_projected_triton'}
    gathered = {'gathered_scores_triton', 'gathered_messages_triton'}
    assert fused & set(calls)
    if inner == 'triton_gathers':
        assert gathered <= set(calls)
    else:  # (B training: the inner level's top-k comes from the scores kernel only)
        assert 'gathered_messages_triton' not in calls


CORE_CASES = [  # (attn_type, levels, finest hw, heads, topks)
    ('B', 3, (8, 12), 2, (4, 6)),
    ('A', 3, (12, 8), 3, (4, 5)),
    ('A', 2, (6, 10), 1, (5, )),
]


@pytest.mark.parametrize('attn_type,levels,hw,heads,topks', CORE_CASES)
def test_core_with_kernels_matches_pytorch_path(attn_type, levels, hw, heads, topks,
                                                monkeypatch):
    """``quadtree_attention_core`` with ``use_triton=True`` against ``False``: forward and
    the gradients of all pyramid maps (training path), and the no-grad output (inference:
    batched path with the kernels vs the chunked / fused-CPU path). Every used top-k has
    a relative margin above 1e-4 (recorded), so no selection can flip between the paths."""
    calls = _count_kernel_calls(monkeypatch)
    C = 8 * heads
    qs, ks, vs = _pyramids(2, C, hw, levels, seed=11)
    weight = lepes = None
    if attn_type == 'B':
        weight = torch.softmax(torch.randn(levels, generator=_gen(12)), 0)
        lepes = [torch.randn(v.shape, generator=_gen(13 + i)) for i, v in enumerate(vs)]
    leaves = qs + ks + vs
    g = torch.randn(2, heads, hw[0] * hw[1], C // heads, generator=_gen(20))
    results, margins = {}, []
    for flag in (True, False):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        S = len(qs)
        out = qa.quadtree_attention_core(xs[:S], xs[S:2 * S], xs[2 * S:], heads, topks,
                                         attn_type, weight, lepes,
                                         margin_recorder=lambda lvl, m: margins.append(m),
                                         use_triton=flag)
        grads = torch.autograd.grad(out, xs, g)
        with torch.no_grad():
            inf = qa.quadtree_attention_core(qs, ks, vs, heads, topks, attn_type, weight,
                                             lepes, use_triton=flag)
        results[flag] = (out.detach(), grads, inf)
    # per non-final finer level: scores + messages, except when B trains: the scores (for
    # the selection, without autograd) + the fused kernel (the messages; it saves no
    # weights); the final level: the fused kernel of the variant. Training, then inference
    final = f'final_level_{attn_type.lower()}_triton'
    inference_calls = ['gathered_scores_triton', 'gathered_messages_triton'] * (levels - 2)
    training_calls = ['gathered_scores_triton', final] * (levels - 2) if attn_type == 'B' \
        else inference_calls
    assert calls == training_calls + [final] + inference_calls + [final], calls
    assert min(margins) > 1e-4, min(margins)
    (out_t, grads_t, inf_t), (out_p, grads_p, inf_p) = results[True], results[False]
    scale = out_p.abs().max()
    # observed (relative to the largest value): outputs <= 2.2e-7, gradients <= 3.4e-7;
    # the kernels' inference and training outputs are identical
    torch.testing.assert_close(out_t, out_p, rtol=0, atol=3e-6 * scale)
    torch.testing.assert_close(inf_t, inf_p, rtol=0, atol=3e-6 * scale)
    torch.testing.assert_close(inf_t, out_t, rtol=0, atol=3e-6 * scale)
    for i, (a, b) in enumerate(zip(grads_t, grads_p)):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-6 * b.abs().max(),
                                   msg=lambda m, i=i: f'grad of leaf {i}: {m}')


def test_b_training_saves_no_level_weights_or_int64_indices():
    """What a training forward of B (4 levels, level weights, LePE convs) keeps for the
    backward, with the kernels: no softmax weights ``(.., 4, 4Kp)`` of any level (the fused
    kernel recomputes them from its max / sum statistics), no int64 tensor (the top-k
    selections carry no gradient; the index lists are int32) and no candidate list (the
    kernels take the ``Kp`` parent cells, not their ``4Kp`` children), and no finer level's
    messages ``(B, h, N_i, d)`` other than views of the inputs (the kernel applies the level
    weight, whose gradient it forms from its per-row ``g . out``; the LePE conv has the
    weight folded in). The PyTorch path keeps all three, which this would catch."""
    heads, topks, hw, levels, C = 2, (4, 6, 5), (16, 24), 4, 16
    qs, ks, vs = _pyramids(2, C, hw, levels, seed=3)
    torch.manual_seed(0)
    convs = [torch.nn.Conv2d(C, C, 3, 1, 1, groups=C) for _ in range(levels)]
    logits = torch.randn(levels, generator=_gen(4)).requires_grad_(True)

    def saved(flag):
        xs = [t.clone().requires_grad_(True) for t in qs + ks + vs]
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t,
                                                      lambda t: t):
            qa.quadtree_attention_core(
                xs[:levels], xs[levels:2 * levels], xs[2 * levels:], heads, topks, 'B',
                torch.softmax(logits, 0),
                [qa.LePEConv(v, conv) for v, conv in zip(xs[2 * levels:], convs)],
                use_triton=flag)
        inputs = {t.untyped_storage().data_ptr() for t in xs}
        return kept, inputs

    def level_weights(kept):  # one per storage (softmax and messages save the same)
        return list({t.untyped_storage().data_ptr(): t for t in kept
                     if t.dim() == 5 and t.shape[3] == 4 and t.is_floating_point()
                     and t.shape[4] in [4 * k for k in topks]}.values())

    def messages(kept, inputs):  # finer levels' (B, h, N_i, d) maps not held by the inputs
        shapes = [(2, heads, (hw[0] >> s) * (hw[1] >> s), C // heads) for s in range(levels - 1)]
        return [t for t in kept if tuple(t.shape) in shapes
                and t.untyped_storage().data_ptr() not in inputs]

    with_kernels, inputs = saved(True)
    with cpu_kernels.use_cpu_kernels(False):  # the batched PyTorch path (other devices)
        pytorch_path, inputs_p = saved(False)
    assert not level_weights(with_kernels), [t.shape for t in level_weights(with_kernels)]
    assert not [t for t in with_kernels if t.dtype == torch.int64]
    # the kernels keep the parent lists (Kp = a coarser level's top-k entries), never the
    # 4x longer candidate lists
    kept_indices = [t for t in with_kernels if t.dtype == torch.int32]
    assert kept_indices and all(t.shape[-1] in topks for t in kept_indices), [
        t.shape for t in kept_indices]
    assert not messages(with_kernels, inputs), [t.shape for t in messages(with_kernels,
                                                                            inputs)]
    assert len(level_weights(pytorch_path)) == levels - 1
    assert any(t.dtype == torch.int64 for t in pytorch_path)
    assert len(messages(pytorch_path, inputs_p)) >= levels - 1


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('attn_type,levels,hw,heads,topks', CORE_CASES[:2])
def test_core_reads_half_keys_and_values_as_they_are(attn_type, levels, hw, heads, topks,
                                                     dtype, monkeypatch):
    """With the kernels, half-precision key / value maps of the finer levels go to them
    uncast (no float32 copy of both maps per level): the output and every gradient are
    bit-identical to passing their float32 copies (the upcast in registers is exact), and
    the PyTorch path (``use_triton=False``) still casts them itself."""
    qs, ks, vs = _pyramids(2, 8 * heads, hw, levels, seed=11)
    ks, vs = [t.to(dtype) for t in ks], [t.to(dtype) for t in vs]
    weight = torch.softmax(torch.randn(levels, generator=_gen(12)), 0) \
        if attn_type == 'B' else None
    g = torch.randn(2, heads, hw[0] * hw[1], 8, generator=_gen(20))
    seen = []
    real = qt.final_level_b_triton if attn_type == 'B' else qt.final_level_a_triton
    monkeypatch.setattr(qt, real.__name__,
                        lambda q, k, v, *a: seen.append((k.dtype, v.dtype)) or real(q, k, v, *a))

    def run(keys, values, flag):
        xs = [t.clone().requires_grad_(True) for t in qs + keys + values]
        S = len(qs)
        out = qa.quadtree_attention_core(xs[:S], xs[S:2 * S], xs[2 * S:], heads, topks,
                                         attn_type, weight, use_triton=flag)
        return [out] + list(torch.autograd.grad(out, xs, g))

    half = run(ks, vs, True)
    # the fused kernel got the half maps: at the final level, and at the others when B
    # trains
    fused = levels - 1 if attn_type == 'B' else 1
    assert seen == [(dtype, dtype)] * fused
    upcast = run([t.float() for t in ks], [t.float() for t in vs], True)
    assert seen[fused:] == [(torch.float32, torch.float32)] * fused
    for a, b in zip(half, upcast):
        assert a.dtype == b.dtype or (a.dtype == dtype and b.dtype == torch.float32)
        assert torch.equal(a.float(), b.to(a.dtype).float())
    reference = run(ks, vs, False)  # (casts to float32 on its own; no kernels)
    torch.testing.assert_close(half[0], reference[0], rtol=0,
                               atol=3e-6 * float(reference[0].detach().abs().max()))


def test_module_with_kernels_matches_pytorch_path(monkeypatch):
    """``QuadTreeAttention(use_triton=True)`` (B, 3 levels, odd map: padded) gives the
    output and parameter gradients of ``use_triton=False`` and really runs the kernels."""
    calls = _count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, attn_type='B', num_levels=3, topk=4)
    x = torch.randn(2, 11 * 13, 16)
    results = []
    for flag in (True, False):
        m.zero_grad()
        m.use_triton = flag
        out = m(x, (11, 13))
        out.square().sum().backward()
        results.append((out.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}))
    # training: level 1 the scores (for the top-k) and the fused kernel; final level 2 the
    # fused kernel on the projected maps (with the level weights and the LePE conv folded,
    # both variants of which get their gradients checked below)
    assert calls == ['gathered_scores_triton', 'final_level_b_triton',
                     'final_level_projected_triton'], calls
    (out_t, grads_t), (out_p, grads_p) = results
    # observed (relative to each tensor's largest value): output 8e-8, parameter
    # gradients <= 4.8e-7
    assert ((out_t - out_p).abs().max() / out_p.abs().max()).item() < 5e-6
    # k_proj.bias shifts every score of a query by the same amount (softmax-invariant):
    # its gradient is zero up to rounding (observed 4e-7 against 287 for proj.bias)
    biggest = max(g.abs().max() for g in grads_p.values())
    for t in (grads_t.pop('k_proj.bias'), grads_p.pop('k_proj.bias')):
        assert t.abs().max() < 1e-6 * biggest
    for name, g in grads_p.items():
        err = ((grads_t[name] - g).abs().max() / g.abs().max()).item()
        assert err < 5e-6, (name, err)


def _module_run(m, x, hw, amp, projected):
    """Output, input gradient, parameter gradients and the saved-for-backward storages
    (not the parameters' or ``x``'s) of one training step of ``m``; ``projected=False``
    runs ``attend`` without the ``Projections`` (the final level keeps its maps)."""
    m.zero_grad()
    x = x.clone().requires_grad_(True)
    if not projected:
        attend = type(m).attend
        m.attend = lambda q, k, v, hw_shape, **kwargs: attend(m, q, k, v, hw_shape)
    try:
        with saved_for_backward([x, *m.parameters()]) as kept, \
                torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
            out = m(x, hw)
    finally:
        m.__dict__.pop('attend', None)
    out.float().square().sum().backward()
    return (out.detach(), x.grad, {k: p.grad.clone() for k, p in m.named_parameters()},
            sum(kept.values()))


@pytest.mark.parametrize('amp', [False, True], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('attn_type', ['B', 'A'])
def test_final_level_recomputes_the_projected_maps(attn_type, amp, monkeypatch):
    """A training forward of the operator runs its final level as
    ``final_level_projected_triton`` (the finest query and key, and A's value, given as
    projections of the block input): the output and every gradient are bit-identical to
    the same kernels keeping those maps, and the step keeps exactly their bytes less for the
    backward: the float32 grouped queries and the key map (A: and the value map) of the
    finest level, in their dtypes (fp32, or bf16 under autocast), less the bf16 copies of
    their biases under autocast. An 11x13 map (padded to 12x16), 2 heads, 3 levels."""
    calls = _count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, attn_type=attn_type, num_levels=3, topk=4, use_triton=True)
    x = torch.randn(2, 11 * 13, 16)
    proj = _module_run(m, x, (11, 13), amp, True)
    assert calls[-1] == 'final_level_projected_triton', calls
    del calls[:]
    kept = _module_run(m, x, (11, 13), amp, False)
    assert 'final_level_projected_triton' not in calls, calls
    for a, b in zip(proj[:2], kept[:2]):
        assert torch.equal(a, b)
    assert proj[2].keys() == kept[2].keys()
    for name in proj[2]:
        assert torch.equal(proj[2][name], kept[2][name]), name
    tokens = 2 * 12 * 16 * 16  # B * padded N * C
    map_bytes = tokens * (2 if amp else 4)
    expected = tokens * 4 + map_bytes * (2 if attn_type == 'A' else 1)
    if amp:  # (for the recompute: the bf16 copies of the recomputed maps' biases, 16 each)
        expected -= 16 * 2 * (3 if attn_type == 'A' else 2)
    assert kept[3] - proj[3] == expected, (kept[3], proj[3], expected)


def test_projected_final_level_refuses_projections_that_do_not_fit():
    """``final_level_projected_triton`` checks what it can of its ``Projections`` (the
    input's shape, the weights' shapes and dtypes) and the variant, naming the problem."""
    B, h, Hf, Wf, d, Kp = 1, 2, 4, 6, 4, 2
    C = h * d
    gen = _gen(5)
    x = torch.randn(B, Hf * Wf, C, generator=gen)
    w, b = torch.randn(C, C, generator=gen), torch.randn(C, generator=gen)
    q_map = qa.tokens_as_map(torch.nn.functional.linear(x, w, b), (Hf, Wf))
    q = qa.level_queries(q_map, h, d ** -0.5)
    k = qa.to_heads(q_map, h)
    index = torch.randint(0, (Hf // 2) * (Wf // 2), (B, h, q.shape[2], Kp), generator=gen,
                          dtype=torch.int32)
    good = qa.Projections(x, (w, b), (w, b))
    out = qt.final_level_projected_triton(q, k, k, index, None, Wf // 2, good, (Hf, Wf), h,
                                          d ** -0.5, 'B')
    assert torch.equal(out, qt.final_level_b_triton(q, k, k, index, None, Wf // 2))
    bad = {
        'is not (1, 24, C_in)': good._replace(x=x[:, :-1]),
        'is not 8 -> 8': good._replace(key=(w[:, :-1], b)),
        'differs from its input': good._replace(query=(w.double(), b.double())),
    }
    for message, projections in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            qt.final_level_projected_triton(q, k, k, index, None, Wf // 2, projections,
                                            (Hf, Wf), h, d ** -0.5, 'B')
    with pytest.raises(ValueError, match='does not match query'):
        qt.final_level_projected_triton(q, k, k, index, None, Wf // 2,
                                        good._replace(x=x.reshape(B, Hf, Wf, C)[:, :2]
                                                      .reshape(B, -1, C)), (2, Wf), h,
                                        d ** -0.5, 'B')
    with pytest.raises(ValueError, match="variant must be 'A' or 'B'"):
        qt.final_level_projected_triton(q, k, k, index, None, Wf // 2, good, (Hf, Wf), h,
                                        d ** -0.5, 'C')


# --------------------------------------------------------------------------- switches
def _small_level():
    a, srcs, index, _ = _problem(1, 2, 3, 4, 8, 4, 5, 'final-b')
    return a.float(), srcs[0].float(), index


def test_switches(monkeypatch):
    """``use_triton=True`` runs the kernels; ``False``, ``None`` on CPU tensors and
    ``FLATTEN_MM_TRITON=0`` (even with ``True``) run the PyTorch path (same values)."""
    calls = _count_kernel_calls(monkeypatch)
    a, src, index = _small_level()
    ref = qa.gathered_scores(a, src, index, use_triton=True)
    assert calls == ['gathered_scores_triton']
    for flag in (False, None):
        torch.testing.assert_close(qa.gathered_scores(a, src, index, use_triton=flag), ref,
                                   rtol=1e-6, atol=1e-6)
    assert len(calls) == 1
    monkeypatch.setenv(dispatch.TRITON_ENV, '0')
    qa.gathered_scores(a, src, index, use_triton=True)
    m = QuadTreeAttention(8, 2, num_levels=2, topk=2, use_triton=True)
    m(torch.randn(1, 16, 8), (4, 4))
    assert len(calls) == 1
    monkeypatch.setenv(dispatch.TRITON_ENV, '1')
    m(torch.randn(1, 16, 8), (4, 4))  # (training: the final level on the projected maps)
    assert calls[1:] == ['final_level_projected_triton']
    m.use_triton = None  # auto: CPU tensors take the PyTorch path
    m(torch.randn(1, 16, 8), (4, 4))
    assert len(calls) == 2


def test_invalid_and_refused_values():
    with pytest.raises(ValueError, match='use_triton'):
        QuadTreeAttention(8, 2, use_triton='yes')
    a, src, index = _small_level()
    with pytest.raises(ValueError, match='use_triton'):
        qa.gathered_scores(a, src, index, use_triton=1)
    with pytest.raises(ValueError, match='float64'):
        qa.gathered_scores(a.double(), src.double(), index, use_triton=True)
    big = torch.zeros(1, 1, 2, 4, 129)  # 129 candidates pad to 256 x head dim 64
    with pytest.raises(ValueError, match='register budget'):
        qa.gathered_messages(big, torch.zeros(1, 1, 3, 64), torch.zeros(1, 1, 2, 129,
                                                                         dtype=torch.long),
                             use_triton=True)
    # variant A's fused final level: groups of 4 candidates, prev_score (B, h, L, K / 4)
    # in the query dtype
    q, srcs, index, _ = _problem(1, 2, 3, 4, 8, 4, 8, 'final-a')
    q, k, v, ps = (t.float() for t in [q] + srcs)
    qt.final_level_a_triton(q, k, v, index, ps)  # (accepted as made)
    for args, match in (((q, k, v, index[..., :6], ps), 'not groups of 4'),
                        ((q, k, v, index, ps[..., :1]), 'prev_score'),
                        ((q, k, v, index, ps.double()), 'prev_score dtype'),
                        ((q, k, v[:, :, :5], index, ps), 'does not match key')):
        with pytest.raises(ValueError, match=match):
            qt.final_level_a_triton(*args)


def test_backbone_attn_cfg_reaches_the_operator():
    from flatten_mm.models.backbones import QuadTreePVTv2
    model = QuadTreePVTv2(arch='b0', attn_cfg=dict(use_triton=False))
    flags = {m.use_triton for m in model.modules() if isinstance(m, QuadTreeAttention)}
    assert flags == {False}
    model = QuadTreePVTv2(arch='a-b0')
    flags = {m.use_triton for m in model.modules() if isinstance(m, QuadTreeAttention)}
    assert flags == {None}


# --------------------------------------------------------------------------- registration
_OPS = {'scores': 'qt_gathered_scores', 'messages': 'qt_gathered_messages',
        'final-b': 'qt_final_level_b', 'final-b-scaled': 'qt_final_level_b',
        'final-a': 'qt_final_level_a'}


@pytest.mark.parametrize('kind', list(KINDS))
def test_custom_op_registration(kind):
    """Schema, fake (meta) implementation and autograd registration of
    ``flatten_mm::qt_gathered_scores`` / ``qt_gathered_messages`` / ``qt_final_level_b``
    / ``qt_final_level_a`` (``opcheck``)."""
    a, srcs, index, _ = _problem(1, 2, 3, 4, 8, 4, 8 if kind == 'final-a' else 5, kind)
    args = [t.float().requires_grad_(True) for t in [a] + srcs]
    # (q, k, v, index) + A's prev_score / B's scale
    args.insert(3 if kind in ('final-a', 'final-b-scaled') else len(args), index)
    op = getattr(torch.ops.flatten_mm, _OPS[kind])
    torch.library.opcheck(op.default, tuple(args),
                          test_utils=('test_schema', 'test_autograd_registration',
                                      'test_faketensor'))


def test_dynamo_sees_one_node_each():
    """``torch.compile`` captures scores + softmax + messages as the two custom ops (plus
    the softmax), without graph break."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, index):
        s = qa.gathered_scores(q, k, index, use_triton=True)
        return qa.gathered_messages(s.softmax(-1), k, index, use_triton=True)

    a, src, index = _small_level()
    out = torch.compile(f, backend=backend, fullgraph=True)(a, src, index)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes
               if n.op in ('call_function', 'call_method')
               and n.target is not operator.getitem and 'autocast' not in str(n.target)]
    assert sum('qt_gathered_scores' in t for t in targets) == 1, targets
    assert sum('qt_gathered_messages' in t for t in targets) == 1, targets
    assert len(targets) == 3, targets
    assert torch.equal(out, f(a, src, index))


@pytest.mark.parametrize('attn_type', ['B', 'A'])
def test_module_compiles_to_one_graph_with_the_ops(attn_type):
    """``torch.compile(fullgraph=True)`` of the whole operator with the kernels: one graph
    (no break), holding the custom ops of a training forward, the variant's fused final
    level inside the traced ``autograd.Function`` of the projected maps (its forward and
    backward bodies hold the op and its backward op once each), with the eager output."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, attn_type=attn_type, num_levels=3, topk=4, use_triton=True)
    x = torch.randn(2, 8 * 12, 16)
    out = torch.compile(m, backend=backend, fullgraph=True)(x, (8, 12))
    assert len(graphs) == 1
    top = [str(n.target) for n in graphs[0].graph.nodes if n.op == 'call_function']
    ops = [t for t in top if 'flatten_mm' in t]
    final = f'flatten_mm.qt_final_level_{attn_type.lower()}'
    # (a training forward: B's middle level selects on scores computed without autograd
    # and takes its messages from the fused kernel)
    middle = final if attn_type == 'B' else 'flatten_mm.qt_gathered_messages'
    assert ops == ['flatten_mm.qt_gathered_scores', middle], ops
    assert 'autograd_function_apply' in top, top
    inner = [str(n.target) for name, sub in graphs[0].named_modules()
             if name and hasattr(sub, 'graph')  # (the subgraphs, not the top graph)
             for n in sub.graph.nodes if n.op == 'call_function']
    for op in (final, final + '_backward'):
        assert sum(t in (op, op + '.default') for t in inner) == 1, (op, inner)
    assert torch.equal(out, m(x, (8, 12)))


# --------------------------------------------------------------------------- GPU check tool
def _load_tool():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), 'benchmarks', 'gpu_kernel_check.py')
    spec = importlib.util.spec_from_file_location('gpu_kernel_check', path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize('arch', ['b0', 'b1'])
def test_gpu_check_tool_cases_are_the_backbone_stages(arch):
    """``QT_CASES`` holds, for every stage with finer levels, what the built backbone
    declares: map side at 512² (``out_strides``), channels, and its attention's heads,
    levels and top-k."""
    from flatten_mm.models.backbones import QuadTreePVTv2
    tool = _load_tool()
    m = QuadTreePVTv2(arch=arch)
    expected = {}
    for i, (stride, C) in enumerate(zip(m.out_strides, m.out_channels)):
        attn = m.stages[i].blocks[0].attn
        if attn.num_levels > 1:
            expected[f'qt-{arch}-stage{i + 1}'] = (512 // stride, C, attn.num_heads,
                                                   attn.num_levels, attn.topks[0])
    got = {k: v for k, v in tool.QT_CASES.items() if k.startswith(f'qt-{arch}-')}
    assert got == expected and len(got) == 3
    assert {C // h for _, C, h, _, _ in got.values()} == ({32} if arch == 'b0' else {64})
    assert set(tool.QT_DEFAULT_CASES) <= set(tool.QT_CASES)
    assert {tool.QT_CASES[c][1] // tool.QT_CASES[c][2] for c in tool.QT_DEFAULT_CASES} == {32, 64}


def test_gpu_check_tool_quadtree_arguments(tmp_path, capsys):
    tool = _load_tool()
    args = tool.parse_args(['--out', str(tmp_path)])
    assert args.kernels == ['fla', 'quadtree']
    assert tool.CASES_OF['quadtree'](args) == list(tool.QT_DEFAULT_CASES)
    assert tool.CASES_OF['fla'](args) == list(tool.DEFAULT_CASES)
    assert 'qt-b0-stage2' in args.compile_cases and args.margin_threshold == 1e-5
    args = tool.parse_args(['--out', str(tmp_path), '--cases', 'swin-t-stage1'])
    assert tool.CASES_OF['quadtree'](args) == []  # quadtree then checks nothing
    with pytest.raises(SystemExit):  # but a kernel without any of its cases is refused
        tool.parse_args(['--out', str(tmp_path), '--kernels', 'quadtree', '--cases',
                         'swin-t-stage1'])
    assert 'none of --cases' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.parse_args(['--out', str(tmp_path), '--kernels', 'quadtree,nope'])
    with pytest.raises(SystemExit):
        tool.parse_args(['--out', str(tmp_path), '--margin-threshold', '-1'])


def _tiny_args(tool, monkeypatch, *extra):
    monkeypatch.setitem(tool.QT_CASES, 'tiny', (8, 16, 2, 3, 2))  # 3 levels, 8 candidates
    args = tool.parse_args(['--out', 'unused', '--kernels', 'quadtree', '--cases', 'tiny',
                            '--batch', '1', '--no-timing', *extra])
    args.device = 'cpu'
    return args


def test_gpu_check_tool_quadtree_check_runs_interpreted(monkeypatch):
    """The tool's QuadTree check on CPU (interpreted kernels, a tiny 3-level case): the
    ops' outputs and gradients (the kernels on parent cells, as the core calls them; B's
    final level also with its level weight) in fp32 and bf16 pass against float64, the core A / B
    comparison covers every result with no near tie at this size, and the op shapes are
    the case's."""
    tool = _load_tool()
    args = _tiny_args(tool, monkeypatch)
    names = {f'{op}.{r}' for op, rs in (('scores', 'out dq dk'), ('messages', 'out dw dv'),
                                        ('final_level_b', 'out dq dk dv'),
                                        ('final_level_b_scaled', 'out dq dk dv dscale'),
                                        ('final_level_a', 'out dq dk dv dps'))
             for r in rs.split()}
    records = {}
    for dtype in ('fp32', 'bf16'):
        rec = records[dtype] = tool.check_quadtree('tiny', dtype, args)
        assert set(rec['errors']) == names and rec['passed'], rec
        assert (rec['parents'], rec['keys'], rec['candidates'], rec['head_dim']) == (16, 64, 8, 8)
        assert ('core' in rec) == (dtype == 'fp32')  # the core once, in the first dtype
    rec = records['fp32']
    for attn_type, c in rec['core'].items():
        assert c['passed'] and c['near_tie_tokens'] == 0 and not c['skipped'], c
        assert c['min_margin'] > args.margin_threshold
        assert set(c['max_rel']) == {f'd{x}{i}' for x in 'qkv' for i in range(3)} | {'out'}
    assert set(rec['module']) == {'A', 'B'}
    for c in rec['module'].values():
        assert c['passed'] and c['projected_path'] and c['near_tie_tokens'] == 0, c
        assert set(c['max_rel']) == {'out', 'gradients'}


def test_gpu_check_tool_module_check_fails_a_wrong_recompute(monkeypatch):
    """The tool's module check fails when the projected final level's backward recomputes
    its queries wrongly (0.1 % off): the gradients differ, the output does not."""
    tool = _load_tool()
    args = _tiny_args(tool, monkeypatch)
    assert tool._qt_module_check('tiny', 'B', args)['passed']
    real = qt.level_queries
    monkeypatch.setattr(qt, 'level_queries', lambda *a: real(*a) * 1.001)
    for attn_type in ('A', 'B'):
        c = tool._qt_module_check('tiny', attn_type, args)
        assert not c['passed'] and c['max_rel']['out'] <= args.tol, c
        assert c['max_rel']['gradients'] > args.tol, c


def test_gpu_check_tool_quadtree_near_ties_are_masked_and_recorded(monkeypatch):
    """A margin threshold above the smallest margins: the tokens below near ties are left
    out of the output / query-gradient comparison (counted), key / value gradients are
    skipped and named, and the rest still passes."""
    tool = _load_tool()
    args = _tiny_args(tool, monkeypatch, '--margin-threshold', '0.3')
    for c in tool.check_quadtree('tiny', 'fp32', args)['core'].values():
        assert 0 < c['near_tie_tokens'] < c['tokens'] == 2 * 64, c
        assert c['skipped'] == [f'd{x}{i}' for x in 'kv' for i in range(3)]
        assert set(c['max_rel']) == {'out', 'dq0', 'dq1', 'dq2'} and c['passed']
        assert 'skip_reason' in c


def test_gpu_check_tool_quadtree_check_fails_a_broken_kernel(monkeypatch):
    """The check is evidence: a fused final level off by 1e-4 of its largest value fails
    the op comparison (fp32 and bf16 alike) and the core B comparison."""
    tool = _load_tool()
    args = _tiny_args(tool, monkeypatch)
    real = qt.final_level_b_triton

    def broken(q, k, v, index, scale=None, parent_width=0):
        out = real(q, k, v, index, scale, parent_width)
        return out + 1e-4 * out.detach().abs().max()

    monkeypatch.setattr(qt, 'final_level_b_triton', broken)
    rec = tool.check_quadtree('tiny', 'fp32', args)
    assert not rec['errors']['final_level_b_scaled.out']['passed']
    assert not rec['passed']
    assert not rec['errors']['final_level_b.out']['passed']
    assert rec['errors']['scores.out']['passed'] and rec['errors']['final_level_b.dk']['passed']
    assert not rec['core']['B']['passed'] and rec['core']['A']['passed']
    assert not tool.check_quadtree('tiny', 'bf16', args)['errors']['final_level_b.out']['passed']

    def wrong_dscale(q, k, v, index, scale=None, parent_width=0):
        # the same output, a level-weight gradient off by 1e-3 of the output's largest value
        out = real(q, k, v, index, scale, parent_width)
        if scale is None:
            return out
        return out + (scale - scale.detach()) * 1e-3 * out.detach().abs().max()

    monkeypatch.setattr(qt, 'final_level_b_triton', wrong_dscale)
    errors = tool.check_quadtree('tiny', 'fp32', args)['errors']
    assert not errors['final_level_b_scaled.dscale']['passed']
    assert errors['final_level_b_scaled.out']['passed'] and errors['final_level_b.out']['passed']


def test_gpu_check_tool_quadtree_compile_and_timing_paths(monkeypatch):
    """The ``--compile`` and timing parts of the QuadTree check, on CPU: the module check
    under ``torch.compile(fullgraph=True)`` (here with the ``aot_eager`` backend instead
    of inductor, and the CPU PyTorch path: the interpreter cannot be compiled; the GPU run
    uses inductor and the kernels) matches eager, and every op and the core are timed for
    both paths (CUDA events replaced by a counter)."""
    tool = _load_tool()
    args = _tiny_args(tool, monkeypatch, '--compile', '--compile-cases', 'tiny')
    args.no_timing = False
    real_compile = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda m, backend, fullgraph: real_compile(
        m, backend='aot_eager', fullgraph=fullgraph))
    timed = []
    monkeypatch.setattr(tool, '_median_ms', lambda fn, reps: timed.append(fn()) or 1.0)
    rec = tool.check_quadtree('tiny', 'fp32', args)
    assert rec['passed'] and rec['compile']['passed'], rec.get('compile')
    assert rec['compile']['near_tie_tokens'] == 0 and 'skipped' not in rec['compile']
    assert set(rec['compile']['max_rel_vs_eager']) == {'out', 'gradients'}
    assert max(rec['compile']['max_rel_vs_eager'].values()) <= args.tol
    assert set(rec['ms']) == {'scores', 'messages', 'final_level_b', 'final_level_b_scaled',
                              'final_level_a', 'core_b'}
    for t in rec['ms'].values():
        assert set(t) == {'kernels', 'pytorch'}
        assert all(set(v) == {'forward', 'forward_backward'} for v in t.values())
    assert len(timed) == 6 * 2 * 2
    rec = tool.check_quadtree('tiny', 'bf16', args)  # not the first dtype: ops only
    assert 'compile' not in rec and 'core_b' not in rec['ms'] and rec['passed']
    args.margin_threshold = 1e-3  # near ties: the output outside them, no gradients
    c = tool._qt_compile_check('tiny', args)
    assert 0 < c['near_tie_tokens'] < c['tokens'] == 64 and c['skipped'] == ['gradients']
    assert set(c['max_rel_vs_eager']) == {'out'} and c['passed'], c


def test_gpu_check_tool_near_tie_masks_cover_the_descendants():
    """A near tie of one query at level ``i`` masks exactly its ``2**(j-i)``-square block
    of descendants at every level ``j >= i`` (and nothing coarser); masks of two levels
    are united."""
    tool = _load_tool()
    tie0 = torch.zeros(1, 2, 2, 2, dtype=torch.bool)
    tie0[0, 1, 1, 0] = True  # head 1, row 1, column 0 of the 2x2 level
    tie1 = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    tie1[0, 0, 0, 3] = True  # head 0, row 0, column 3 of the 4x4 level
    masks = tool._tie_masks([(0, tie0), (1, tie1)], 3, 8)
    assert [m.shape for m in masks] == [(1, 2, 4), (1, 2, 16), (1, 2, 64)]
    expected = torch.zeros(1, 2, 8, 8, dtype=torch.bool)
    expected[0, 1, 4:8, 0:4] = True
    expected[0, 0, 0:2, 6:8] = True
    assert torch.equal(masks[2], expected.flatten(-2))
    assert torch.equal(masks[0], tie0.flatten(-2))
    assert int(masks[1].sum()) == 4 + 1
    # variant A's query gradients: the whole quad-trees holding a near tie
    trees = tool._tie_masks([(0, tie0), (1, tie1)], 3, 8, whole_trees=True)
    expected[0, 0, 0:4, 4:8] = True  # tie1's level-0 ancestor: head 0, row 0, column 1
    assert torch.equal(trees[2], expected.flatten(-2))
    assert int(trees[0].sum()) == 2 and int(trees[1].sum()) == 8


def test_gpu_check_tool_main_writes_quadtree_records(tmp_path, monkeypatch, capsys):
    """``main`` end to end on CPU (CUDA faked, interpreted kernels, tiny case, two
    dtypes): one JSON record per case and dtype, passing, with its summary line; a
    broken kernel makes the exit status 1 and the record say which result failed."""
    import json
    tool = _load_tool()
    monkeypatch.setitem(tool.QT_CASES, 'tiny', (8, 16, 2, 3, 2))
    real_parse = tool.parse_args

    def parse_on_cpu(argv=None):
        args = real_parse(argv)
        args.device = 'cpu'
        return args

    monkeypatch.setattr(tool, 'parse_args', parse_on_cpu)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda *a: 'cpu (test)')
    argv = ['--out', str(tmp_path), '--kernels', 'quadtree', '--cases', 'tiny', '--batch', '1',
            '--no-timing']
    assert tool.main(argv) == 0
    report = json.loads((tmp_path / 'gpu_kernel_check.json').read_text())
    assert report['passed'] and [(r['case'], r['dtype']) for r in report['records']] == [
        ('tiny', 'fp32'), ('tiny', 'bf16')]
    assert 'core-A=' in capsys.readouterr().out
    real = qt.gathered_messages_triton
    monkeypatch.setattr(qt, 'gathered_messages_triton',
                        lambda w, v, i, pw=0: real(w, v, i, pw) * (1 + 1e-3))
    assert tool.main(argv) == 1
    report = json.loads((tmp_path / 'gpu_kernel_check.json').read_text())
    bad = {k for r in report['records'] for k, e in r['errors'].items() if not e['passed']}
    assert 'messages.out' in bad and not any(k.startswith('scores') for k in bad)
