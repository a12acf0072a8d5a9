"""QuadTree attention: optimized core vs a literal port of the official computation,
closed forms (one level = softmax attention + LePE, all-ones values), memory, dtypes."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from flatten_mm.models.layers import QuadTreeAttention, build_attention
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels
from flatten_mm.models.layers.quadtree_attention import (gathered_messages, gathered_scores,
                                                         quadtree_attention_core)


# --------------------------------------------------------------------------- reference
def ref_score_computation(query, key, index):
    """Official ``score_computation`` (spec §3.6): query ``[B,N1,4,H,D]``, key ``[B,N2,H,D]``,
    index ``[B,N1,K,H]`` -> ``[B,N1,4,K,H]``."""
    B, N1, _, H, D = query.shape
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, 1, 1, H)
    gathered = key[b, index, h]  # [B, N1, K, H, D]
    return torch.einsum('bnfhd,bnkhd->bnfkh', query, gathered)


def ref_value_aggregation(score, value, index):
    """Official ``value_aggregation``: score/index ``[B,N,4,K,H]``, value ``[B,M,H,D]`` ->
    ``[B,N,4,H,D]``."""
    B, N, f, K, H = score.shape
    b = torch.arange(B).view(B, 1, 1, 1, 1)
    h = torch.arange(H).view(1, 1, 1, 1, H)
    gathered = value[b, index, h]  # [B, N, 4, K, H, D]
    return torch.einsum('bnfkh,bnfkhd->bnfhd', score, gathered)


def tokens(x, nhead):
    """``[B, C, h, w]`` -> ``[B, h*w, H, D]`` (official rearrange + view)."""
    B, C, hh, ww = x.shape
    return x.flatten(2).transpose(1, 2).reshape(B, hh * ww, nhead, C // nhead)


def to_raster(x, hw):
    """``[B, (h w), (t1 t2), *rest]`` -> ``[B, (h t1 w t2), *rest]`` with h, w the coarse grid."""
    B = x.shape[0]
    rest = x.shape[3:]
    hh, ww = hw
    x = x.reshape(B, hh, ww, 2, 2, *rest).transpose(2, 3)
    return x.reshape(B, 4 * hh * ww, *rest)


def reference_quadtree(queries, keys, values, nhead, topks, attn_type, weight=None, lepes=None):
    """Literal port of QTAttA/QTAttB (spec §3.2-3.4) in the official layouts; lists are
    coarsest first, maps ``[B, C, h, w]``. Returns ``[B, h*w, H, D]`` at the finest level."""
    S = len(queries)
    B, C, hc, wc = queries[0].shape
    D = C // nhead
    temp = 1.0 / D**0.5
    q, k, v = (tokens(t, nhead) for t in (queries[0], keys[0], values[0]))
    A = torch.softmax(temp * torch.einsum('nlhd,nshd->nlsh', q, k), dim=-2)
    score, idx = torch.topk(A, dim=-2, k=topks[0])
    W = A
    if attn_type == 'A':
        W = A * torch.ones_like(A).scatter(-2, idx, 0.)
    msgs = [torch.einsum('nlsh,nshd->nlhd', W, v)]
    pos = (idx // wc, idx % wc)
    for i in range(1, S):
        final = i == S - 1
        _, _, hi, wi = queries[i].shape
        key, value = tokens(keys[i], nhead), tokens(values[i], nhead)
        query = queries[i].reshape(B, C, hi // 2, 2, wi // 2, 2).permute(0, 2, 4, 3, 5, 1)
        query = query.reshape(B, -1, 4, nhead, D)
        L, Kp = query.shape[1], idx.shape[2]
        cand = torch.stack([(pos[0] * 2 + a) * wi + pos[1] * 2 + b for a in (0, 1)
                            for b in (0, 1)], dim=3)  # [B, L, Kp, 4, H]
        cand = cand.reshape(B, L, 4 * Kp, nhead)
        QK = ref_score_computation(query, key, cand)  # [B, L, 4, 4Kp, H]
        if attn_type == 'B':
            A = torch.softmax(temp * QK, dim=-2)
        else:
            A = torch.softmax(temp * QK.reshape(B, L, 4, Kp, 4, nhead), dim=-2)
            A = (A * score.reshape(B, L, 1, Kp, 1, nhead)).reshape(B, L, 4, 4 * Kp, nhead)
        cand = cand[:, :, None].expand(B, L, 4, 4 * Kp, nhead)
        W = A
        if not final:
            score, sel = torch.topk(A, dim=-2, k=topks[i])
            if attn_type == 'A':
                W = A * torch.ones_like(A).scatter(-2, sel, 0.)
            idx = to_raster(torch.gather(cand, -2, sel), (hi // 2, wi // 2))
            score = to_raster(score, (hi // 2, wi // 2))
            pos = (idx // wi, idx % wi)
        msgs.append(ref_value_aggregation(W, value, cand))  # [B, L, 4, H, D]
    out = None
    for i, m in enumerate(msgs):
        hi, wi = queries[i].shape[-2:]
        if attn_type == 'B':
            if lepes is not None:
                lepe = tokens(lepes[i], nhead)  # raster [B, h*w, H, D]
                if i > 0:  # group by parent like the messages: [B, L, 4, H, D]
                    lepe = lepe.reshape(B, hi // 2, 2, wi // 2, 2, nhead, D)
                    lepe = lepe.permute(0, 1, 3, 2, 4, 5, 6).reshape(B, -1, 4, nhead, D)
                m = m + lepe
            m = m * weight[i] if weight is not None else m
        if out is None:
            out = m
        else:
            out = to_raster(out[:, :, None] + m, (hi // 2, wi // 2))
    return out


def pyramid(B, C, hw, levels, gen):
    """Random q/k/v pyramids (coarsest first) with the finest level of size ``hw``."""
    out = []
    for _ in range(3):
        maps = [torch.randn(B, C, hw[0] >> s, hw[1] >> s, generator=gen) for s in range(levels)]
        out.append(maps[::-1])
    return out


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize('chunk', [1, 1 << 25])
def test_kernels_match_reference(chunk):
    gen = torch.Generator().manual_seed(1)
    B, L, H, D, M, K = 2, 6, 3, 4, 20, 5
    query = torch.randn(B, L, 4, H, D, generator=gen)
    key = torch.randn(B, M, H, D, generator=gen)
    index = torch.randint(0, M, (B, L, K, H), generator=gen)
    ref = ref_score_computation(query, key, index)
    ours = gathered_scores(query.permute(0, 3, 1, 2, 4), key.transpose(1, 2),
                           index.permute(0, 3, 1, 2), chunk_elements=chunk)
    torch.testing.assert_close(ours.permute(0, 2, 3, 4, 1), ref)

    score = torch.randn(B, L, 4, K, H, generator=gen)
    ref = ref_value_aggregation(score, key, index[:, :, None].expand(B, L, 4, K, H))
    ours = gathered_messages(score.permute(0, 4, 1, 2, 3), key.transpose(1, 2),
                             index.permute(0, 3, 1, 2), chunk_elements=chunk)
    torch.testing.assert_close(ours.permute(0, 2, 3, 1, 4), ref)


@pytest.mark.parametrize('fn', [gathered_scores, gathered_messages])
def test_kernel_gradients(fn):
    gen = torch.Generator().manual_seed(2)
    B, h, L, M, K, d = 1, 2, 3, 7, 4, 3
    a_last = d if fn is gathered_scores else K
    a = torch.randn(B, h, L, 4, a_last, generator=gen, dtype=torch.float64, requires_grad=True)
    src = torch.randn(B, h, M, d, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, M, (B, h, L, K), generator=gen)  # repeated rows accumulate
    assert torch.autograd.gradcheck(lambda a, s: fn(a, s, index, chunk_elements=8), (a, src))


# --------------------------------------------------------------------------- core vs reference
CASES = [  # (attn_type, levels, finest hw, heads, topks, B: with LePE)
    ('B', 1, (5, 7), 2, (4, ), True),
    ('B', 2, (8, 6), 2, (4, 4), True),
    ('B', 2, (8, 6), 2, (4, 4), False),
    ('B', 3, (12, 8), 1, (3, 6, 6), True),
    ('B', 3, (8, 16), 2, (6, 4, 4), True),
    ('A', 1, (4, 6), 2, (5, ), False),
    ('A', 2, (6, 10), 3, (4, 4), False),
    ('A', 3, (8, 12), 2, (4, 5, 5), False),
]


def _cpu_kernels_or_skip(on: bool) -> None:
    """Skip a case of the compiled CPU kernels where they are not built (CI requires them:
    there ``quadtree_level_kernel`` raises instead)."""
    if on and cpu_kernels.quadtree_level_kernel() is None:
        pytest.skip(f'fused CPU kernel: {cpu_kernels.status()}')


@pytest.mark.parametrize('attn_type,levels,hw,heads,topks,with_lepe', CASES)
@pytest.mark.parametrize('path,chunk', [('batched', 1), ('batched', 1 << 25),
                                        ('cpu_kernel', 1 << 25)])
def test_core_matches_reference(attn_type, levels, hw, heads, topks, with_lepe, path, chunk):
    """Values and gradients of the core's training paths on CPU (the batched gathers in
    chunks of one parent or one chunk, and the compiled kernels) against the reference."""
    _cpu_kernels_or_skip(path == 'cpu_kernel')
    gen = torch.Generator().manual_seed(3)
    C = 4 * heads
    qs, ks, vs = pyramid(2, C, hw, levels, gen)
    weight = lepes = None
    if attn_type == 'B':
        weight = torch.softmax(torch.randn(levels, generator=gen), 0)
        lepes = [torch.randn_like(v) for v in vs] if with_lepe else None
    for t in qs + ks + vs:
        t.requires_grad_(True)
    ref = reference_quadtree(qs, ks, vs, heads, topks, attn_type, weight, lepes)
    with cpu_kernels.use_cpu_kernels(path == 'cpu_kernel'):
        ours = quadtree_attention_core(qs, ks, vs, heads, topks, attn_type, weight, lepes,
                                       chunk_elements=chunk)
    B, N = ref.shape[:2]
    ours_tokens = ours.transpose(1, 2)  # (B, N, h, d)
    torch.testing.assert_close(ours_tokens, ref, atol=1e-5, rtol=1e-5)
    # the custom backward of the gathers / the kernels agrees with autograd through the
    # reference
    g = torch.randn(ref.shape, generator=gen)
    grads_ref = torch.autograd.grad(ref, qs + ks + vs, g)
    grads = torch.autograd.grad(ours_tokens, qs + ks + vs, g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_all_ones_values_give_ones():
    """Attention weights of all levels sum to 1 (A: redistribution; B: per level + level
    weights); A with a single level drops the top-k keys (official behaviour)."""
    gen = torch.Generator().manual_seed(4)
    for attn_type in ('A', 'B'):
        qs, ks, vs = pyramid(2, 6, (8, 12), 3, gen)
        ones = [torch.ones_like(v) for v in vs]
        w = torch.softmax(torch.randn(3, generator=gen), 0) if attn_type == 'B' else None
        out = quadtree_attention_core(qs, ks, ones, 2, (5, 7), attn_type, level_weights=w)
        torch.testing.assert_close(out, torch.ones_like(out))
    q, k = torch.randn(1, 4, 3, 4, generator=gen), torch.randn(1, 4, 3, 4, generator=gen)
    out = quadtree_attention_core([q], [k], [torch.ones_like(q)], 1, (5, ), 'A')
    attn = torch.softmax(_tok(q) @ _tok(k).transpose(-1, -2) / 2.0, -1)
    dropped = attn.topk(5, dim=-1).values.sum(-1, keepdim=True)
    torch.testing.assert_close(out, (1 - dropped).expand_as(out))


def _tok(x, heads=1):
    B, C, H, W = x.shape
    return x.reshape(B, heads, C // heads, H * W).transpose(-1, -2)


# --------------------------------------------------------------------------- module
def test_one_level_b_is_softmax_attention_plus_lepe():
    torch.manual_seed(0)
    C, heads, (H, W) = 12, 3, (5, 7)
    m = QuadTreeAttention(C, heads, num_levels=1, topk=100).eval()
    x = torch.randn(2, H * W, C)
    x_map = x.transpose(1, 2).reshape(2, C, H, W)
    q = _tok(m.q_proj(x_map), heads)
    k = _tok(m.k_proj(x_map), heads)
    v_map = m.v_proj(x_map)
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(C // heads), dim=-1)
    out = attn @ _tok(v_map, heads) + _tok(m.py_att.get_vs[0](v_map), heads)
    out = m.proj(out.transpose(1, 2).reshape(2, H * W, C))
    torch.testing.assert_close(m(x, (H, W)), out, atol=1e-5, rtol=1e-5)


def module_reference(m: QuadTreeAttention, x: torch.Tensor, hw) -> torch.Tensor:
    """``m(x, hw)`` (a map whose sides are multiples of ``2^(levels-1)``) by the literal
    port: pyramid construction (avg pool / value branches, LePE on each level) as in spec
    §3.1, then ``reference_quadtree``."""
    B, _, C = x.shape
    with torch.no_grad():
        x_map = x.transpose(1, 2).reshape(B, C, *hw)
        q, k, v = m.q_proj(x_map), m.k_proj(x_map), m.v_proj(x_map)
        qs, ks, vs = [q], [k], [v]
        for t in range(m.num_levels - 1):
            q, k = F.avg_pool2d(q, 2), F.avg_pool2d(k, 2)
            v = m.value_branchs[t](v) if m.attn_type == 'B' else F.avg_pool2d(v, 2)
            qs.append(q)
            ks.append(k)
            vs.append(v)
        qs, ks, vs = qs[::-1], ks[::-1], vs[::-1]
        weight = lepes = None
        if m.attn_type == 'B':
            weight = torch.softmax(m.py_att.weight, 0)
            lepes = [conv(val) for conv, val in zip(m.py_att.get_vs, vs)]
        topks = tuple(m.topks) + (m.topks[-1], ) * m.num_levels
        ref = reference_quadtree(qs, ks, vs, m.num_heads, topks, m.attn_type, weight, lepes)
        return m.proj(ref.reshape(B, -1, C))


@pytest.mark.parametrize('attn_type', ['A', 'B'])
def test_module_matches_reference_pipeline(attn_type):
    """Pyramid construction (avg pool / value branches, LePE on each level) as in spec §3.1."""
    torch.manual_seed(0)
    C, heads, levels, hw = 8, 2, 3, (8, 12)
    m = QuadTreeAttention(C, heads, attn_type=attn_type, num_levels=levels, topk=6,
                          value_act='gelu').eval()
    x = torch.randn(2, hw[0] * hw[1], C)
    torch.testing.assert_close(m(x, hw), module_reference(m, x, hw), atol=1e-5, rtol=1e-5)


def test_non_divisible_map_is_zero_padded_and_cropped():
    torch.manual_seed(0)
    C, (H, W) = 8, (13, 10)
    m = QuadTreeAttention(C, 2, num_levels=3, topk=4).eval()
    x = torch.randn(1, H * W, C)
    out = m(x, (H, W))
    assert out.shape == x.shape
    padded = F.pad(x.transpose(1, 2).reshape(1, C, H, W), (0, 2, 0, 3))  # to 16 x 12
    ref = m(padded.flatten(2).transpose(1, 2), (16, 12)).reshape(1, 16, 12, C)[:, :H, :W]
    torch.testing.assert_close(out, ref.reshape(1, H * W, C))


def test_too_small_map_names_the_minimum():
    m = QuadTreeAttention(8, 2, num_levels=3, topk=32)
    assert m.min_map_size() == 4 * 6
    m(torch.randn(1, 24 * 24, 8), (24, 24))  # coarsest 6x6 = 36 >= 32
    with pytest.raises(ValueError, match=r'5x5 = 25 tokens.*topk=32.*24x24'):
        m(torch.randn(1, 20 * 20, 8), (20, 20))
    # one-level B never uses its top-k: any size works
    QuadTreeAttention(8, 2, num_levels=1, topk=32)(torch.randn(1, 6, 8), (2, 3))
    with pytest.raises(ValueError, match='fewer than topk=32'):
        QuadTreeAttention(8, 2, attn_type='A', num_levels=1, topk=32)(torch.randn(1, 6, 8), (2, 3))


@pytest.mark.parametrize('kwargs,match', [
    (dict(attn_type='C'), 'attn_type'),
    (dict(value_act='silu'), 'value_act'),
    (dict(num_levels=0), 'num_levels'),
    (dict(num_levels=3, topk=(4, 20)), 'exceeds'),
    (dict(num_levels=3, topk=(4, )), 'at least 2'),
    (dict(num_heads=3), 'divisible'),
])
def test_bad_arguments(kwargs, match):
    args = dict(embed_dims=8, num_heads=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        QuadTreeAttention(**args)
    with pytest.raises(NotImplementedError):
        QuadTreeAttention(8, 2, attn_drop=0.1)


@pytest.mark.parametrize('attn_type', ['A', 'B'])
def test_gradients_reach_every_parameter(attn_type):
    m = QuadTreeAttention(8, 2, attn_type=attn_type, num_levels=3, topk=4)
    x = torch.randn(2, 8 * 12, 8, requires_grad=True)
    m(x, (8, 12)).square().sum().backward()
    # k_proj.bias shifts all scores of a query equally, which softmax ignores: its gradient
    # is zero up to rounding (also in the official model)
    missing = [n for n, p in m.named_parameters()
               if p.grad is None or (not p.grad.any() and n != 'k_proj.bias')]
    assert not missing
    assert m.k_proj.bias.grad.abs().max() < 1e-4 * m.k_proj.weight.grad.abs().max()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_bf16_autocast_runs_core_in_float32():
    m = build_attention(dict(type='flatten_mm.QuadTreeAttention', num_levels=3, topk=4),
                        embed_dims=16, num_heads=2)
    x = torch.randn(2, 16 * 12, 16)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = m(x, (16, 12))
    assert torch.isfinite(out).all()
    ref = m(x, (16, 12))
    assert (out.float() - ref).abs().max() < 0.1  # bf16 projections only
    m_bf16 = m.to(torch.bfloat16)
    out = m_bf16(x.bfloat16(), (16, 12))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize('channels_last', [False, True])
def test_pyramid_pooling_saves_nothing_and_has_avg_pool2d_gradient(channels_last):
    """The 2x2 pooling that builds the query / key pyramids: the output and the input
    gradient are bit-identical to ``F.avg_pool2d``'s (the gradient in the input's memory
    format), and the autograd graph keeps no tensor (``avg_pool2d``'s node keeps its whole
    input map alive until the backward)."""
    from flatten_mm.models.layers.quadtree_attention import _avg_pool_2x2
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 6, 8, 10).contiguous(memory_format=fmt).requires_grad_(True)
    g = torch.randn(2, 6, 4, 5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _avg_pool_2x2(x)
    assert saved == []
    ref = F.avg_pool2d(x, 2, 2)
    assert torch.equal(out, ref)
    grad, = torch.autograd.grad(out, x, g)
    ref_grad, = torch.autograd.grad(ref, x, g)
    assert torch.equal(grad, ref_grad)
    assert grad.is_contiguous(memory_format=fmt)
    # (the same op with avg_pool2d's own node saves its input: what this test guards)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.avg_pool2d(x, 2, 2)
    assert any(t.shape == x.shape for t in saved)


@pytest.mark.parametrize('value_act', ['relu', 'gelu'])
def test_value_branches_are_recomputed_with_the_same_gradients(value_act):
    """B's value branches under ``recompute_values`` (the default): output and
    every gradient bit-identical to running them as they are, and the training forward
    keeps exactly the branches' inner maps less (per branch: the first activation's output
    at the branch's input size -- GELU also its input --, the 2x2 conv's output and the
    second activation's output (GELU: also its input) at the output size, and GroupNorm's
    mean / rstd)."""
    torch.manual_seed(0)
    B, C, hw = 2, 16, (8, 12)
    m = QuadTreeAttention(C, 2, attn_type='B', num_levels=3, topk=4, value_act=value_act,
                          use_triton=False)
    assert m.recompute_values
    x = torch.randn(B, hw[0] * hw[1], C)
    g = torch.randn(B, hw[0] * hw[1], C)

    def run(flag):
        m.recompute_values = flag
        xs = x.clone().requires_grad_(True)
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = m(xs, hw)
        params = [p for p in m.parameters()]
        grads = torch.autograd.grad(out, [xs] + params, g)
        resident = {p.untyped_storage().data_ptr() for p in params}
        return out, grads, sum(n for p, n in saved.items() if p not in resident)

    out_cp, grads_cp, saved_cp = run(True)
    out, grads, saved = run(False)
    assert torch.equal(out_cp, out)
    for a, b in zip(grads_cp, grads):
        assert torch.equal(a, b)
    per_act = 2 if value_act == 'gelu' else 1
    inner = 0
    for t in range(m.num_levels - 1):  # branch t: a (H_t, W_t) map to (H_t / 2, W_t / 2)
        n_in = B * C * (hw[0] >> t) * (hw[1] >> t)
        inner += 4 * (per_act * n_in + (1 + per_act) * n_in // 4) + 4 * (4 * B)
    assert saved - saved_cp == inner, (saved, saved_cp, inner)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
@pytest.mark.parametrize('with_scale', [False, True])
def test_lepe_conv_keeps_no_float32_copy_of_a_half_value_map(dtype, with_scale):
    """``LePEConv`` (``recompute`` on): the float32 depth-wise conv of a value map, times a
    level weight folded into the conv. Output and gradients (map, conv weight and bias,
    level weight) those of the plain computation ``conv(value.float()) * scale``
    (bit-identical without the weight, within float32 rounding with it); of a bf16 map
    (autocast), the training forward keeps no float32 copy of it (the cast is redone in
    the backward; without ``recompute`` it does) and nothing the size of the output (the
    weight's gradient needs no copy of the unweighted map)."""
    from flatten_mm.models.layers.quadtree_attention import LePEConv
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 8, 3, 1, 1, groups=8)
    v = torch.randn(2, 8, 6, 10).to(dtype).requires_grad_(True)
    scale = torch.tensor(0.3, requires_grad=True) if with_scale else None
    g = torch.randn(2, 8, 6, 10)
    leaves = [v, conv.weight, conv.bias] + ([scale] if with_scale else [])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = LePEConv(v, conv)(scale)
    grads = torch.autograd.grad(out, leaves, g)
    ref = F.conv2d(v.float(), conv.weight, conv.bias, padding=1, groups=8)
    ref = ref * scale if with_scale else ref
    ref_grads = torch.autograd.grad(ref, leaves, g)
    assert out.dtype == torch.float32
    if not with_scale:
        assert torch.equal(out, ref)
        for a, b in zip(grads, ref_grads):
            assert torch.equal(a, b)
    else:  # conv(v, s w, s b) vs s conv(v, w, b): float32 rounding (observed <= 1.2e-7
        # of each tensor's largest value; the weight's gradient, a sum with cancellations,
        # 2e-8 of the sum of its terms' magnitudes)
        mags = [None] * (len(leaves) - 1) + [(g * ref / scale).abs().sum()]
        for name, a, b, m in zip(('out', 'v', 'w', 'b', 'scale'), (out, ) + grads,
                                 (ref, ) + ref_grads, [None] + mags):
            err = ((a - b).abs().max() / (b.abs().max() if m is None else m)).item()
            assert err < 1e-6, (name, err)
    big = [t for t in saved if t.numel() >= v.numel()]
    if dtype == torch.bfloat16:
        assert not [t for t in big if t.dtype == torch.float32], \
            [(t.shape, t.dtype) for t in big]
        kept = []  # (recompute=False: the float32 copy is what the conv keeps)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t,
                                                      lambda t: t):
            LePEConv(v, conv, recompute=False)(scale)
        assert [t for t in kept if t.numel() >= v.numel() and t.dtype == torch.float32]
    if with_scale:  # (the map itself may be kept: the conv's weight gradient needs it)
        assert all(t.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                   or t.dtype == torch.float32 and dtype == torch.float32 for t in big), \
            [(t.shape, t.dtype) for t in big]


class _MaxNumel(TorchDispatchMode):
    """Largest tensor produced by any op (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out, )):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_memory_is_linear_in_tokens():
    """128 x 128 tokens (N = 16384): no tensor of a training step gets anywhere near N x N
    elements; on the batched path (other devices) the largest are the gathered rows and
    the (N, 4K) scores, with the CPU kernels the (N, K) selections."""
    H = W = 128
    N = H * W
    C, heads, K = 16, 1, 32
    m = QuadTreeAttention(C, heads, num_levels=4, topk=K)
    x = torch.randn(1, N, C, requires_grad=True)
    if cpu_kernels.quadtree_level_kernel() is not None:
        with _MaxNumel() as mode:
            m(x, (H, W)).sum().backward()
        assert mode.max_numel <= max(N * K, N * C)
    with _MaxNumel() as mode, cpu_kernels.use_cpu_kernels(False):
        m(x, (H, W)).sum().backward()
    # largest legitimate tensors: the gathered candidate rows of the finest level,
    # (N/4 parents) x 4K candidates x d, and the 4K scores of every query
    bound = max(N // 4 * 4 * K * (C // heads), N * 4 * K * heads)
    assert mode.max_numel <= bound
    assert mode.max_numel * 16 <= N * N
    # chunking bounds the gathered rows further
    small = QuadTreeAttention(C, heads, num_levels=4, topk=K, chunk_elements=1 << 18)
    small.load_state_dict(m.state_dict())
    with _MaxNumel() as mode_small, cpu_kernels.use_cpu_kernels(False):
        small(x, (H, W)).sum().backward()
    assert mode_small.max_numel <= N * 4 * K * heads  # now only the score tensors


def test_chunking_does_not_change_results():
    torch.manual_seed(0)
    m = QuadTreeAttention(8, 2, num_levels=3, topk=4).eval()
    small = QuadTreeAttention(8, 2, num_levels=3, topk=4, chunk_elements=1).eval()
    small.load_state_dict(m.state_dict())
    x = torch.randn(2, 16 * 8, 8)
    torch.testing.assert_close(small(x, (16, 8)), m(x, (16, 8)))


def test_graph_capture_takes_the_tile_form(monkeypatch):
    """While a graph is captured for a runtime, each finer inference level runs once in
    the tile form (no chunks), with the chunked path's values."""
    from flatten_mm.models.ops import quadtree_paths, quadtree_rows, quadtree_tiles
    # tiny budgets so that the finer levels of a 32x24 map are chunked
    monkeypatch.setattr(quadtree_rows, '_LEVEL_ONE_CHUNK_ELEMENTS', 64)
    monkeypatch.setattr(quadtree_rows, '_DENSE_ONE_CHUNK_ELEMENTS', 64)
    monkeypatch.setattr(quadtree_rows, '_LEVEL_CHUNK_ELEMENTS', 64)
    calls = []
    tiles = quadtree_tiles.finer_level_tiles
    monkeypatch.setattr(quadtree_tiles, 'finer_level_tiles',
                        lambda *a: calls.append(1) or tiles(*a))
    torch.manual_seed(0)
    x = torch.randn(1, 32 * 24, 8)
    for attn_type in ('A', 'B'):
        m = QuadTreeAttention(8, 2, num_levels=3, topk=4, attn_type=attn_type).eval()
        # the PyTorch inference path (the fused CPU kernel has no chunks)
        with torch.no_grad(), cpu_kernels.use_cpu_kernels(False):
            chunked = m(x, (32, 24))
            assert not calls
            with monkeypatch.context() as mp, quadtree_paths.record_paths() as taken:
                mp.setattr(quadtree_paths, 'graph_capture', lambda: True)
                mp.setattr(quadtree_rows, 'graph_capture', lambda: True)
                captured = m(x, (32, 24))
        assert len(calls) == 2  # 2 finer levels, one call each
        assert [t.path for t in taken] == ['tiles', 'tiles']
        calls.clear()
        torch.testing.assert_close(captured, chunked, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('attn_type', ['A', 'B'])
@pytest.mark.parametrize('B,h,C,hw,Kp,topk', [(2, 2, 16, (8, 12), 4, 4),
                                              (1, 1, 8, (16, 16), 8, 8),
                                              (1, 2, 8, (8, 8), 16, None)])
def test_tile_level_equals_the_chunked_level(attn_type, B, h, C, hw, Kp, topk):
    """``ops.quadtree_tiles.finer_level_tiles`` against ``quadtree_rows.finer_level_rows`` in
    float64: messages, the next level's selected keys (as sets) and, for A, their scores."""
    from flatten_mm.models.ops.quadtree_layout import to_heads
    from flatten_mm.models.ops.quadtree_rows import finer_level_rows
    from flatten_mm.models.ops.quadtree_tiles import finer_level_tiles
    g = torch.Generator().manual_seed(0)
    hi, wi = hw
    P = hi * wi // 4
    q = torch.randn(B, C, hi, wi, dtype=torch.float64, generator=g)
    k, v = (to_heads(torch.randn(B, C, hi, wi, dtype=torch.float64, generator=g), h)
            for _ in range(2))
    prev_idx = torch.stack([torch.randperm(P, generator=g)[:Kp]
                            for _ in range(B * h * P)]).view(B, h, P, Kp)
    prev_score = (torch.rand(B, h, P, Kp, dtype=torch.float64, generator=g)
                  if attn_type == 'A' else None)
    init = torch.randn(B, h, hi * wi, C // h, dtype=torch.float64, generator=g)
    ref = finer_level_rows(q, k, v, prev_idx, prev_score, h, 0.3, attn_type, topk,
                           init.clone())
    got = finer_level_tiles(q, k, v, prev_idx, prev_score, h, 0.3, attn_type, topk, init)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    if topk is None:
        assert got[1] is None and got[2] is None
        return
    order_got, order_ref = got[1].argsort(-1), ref[1].argsort(-1)
    assert torch.equal(got[1].gather(-1, order_got), ref[1].gather(-1, order_ref))
    if attn_type == 'A':
        torch.testing.assert_close(got[2].gather(-1, order_got),
                                   ref[2].gather(-1, order_ref), rtol=1e-12, atol=1e-12)
    else:
        assert got[2] is None
