"""Every fast path of the attention operators agrees with its reference path (the one
harness: on CPU here, and at realistic sizes on a GPU by the ``cuda``-marked tests at the
end, which ``scripts/gpu_session.sh`` runs with ``pytest -m cuda``).

Fast paths (see the benchmark in ``benchmarks/benchmark.py``): the fused FLA kernel
(in place without autograd, folded normalisation), convolutions on tokens as
channels-last views, SimA's folded
L1 normalisation, QuadTree's inference gathers, and XCiT's fused LayerScale residual.
Speed itself is measured by the benchmark, never asserted here.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.core.profiling import saved_for_backward
from flatten_mm.models.layers import (LPI, FocusedLinearAttention, FocusedLinearAttentionQKV,
                                      PVTMlp, QuadTreeAttention, ShiftedWindowAttention,
                                      nchw_to_nlc, nlc_to_nchw)
from flatten_mm.models.layers.conv import map_as_tokens, token_conv, tokens_as_map
from flatten_mm.models.layers.focused_linear_attention import (depthwise_conv_heads,
                                                               focused_linear_core,
                                                               focused_linear_core_reference)
from flatten_mm.models.layers.quadtree_attention import gathered_messages, gathered_scores
from flatten_mm.models.layers.sima_attention import sima_core, sima_core_reference
from flatten_mm.models.ops.dispatch import TOLERANCES


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------- FLA kernel
FLA_CASES = [  # (B, N, n, C, heads, p, with_pos)
    (2, 30, 30, 16, 1, 3, True),
    (1, 42, 42, 24, 3, 3, False),
    (2, 35, 12, 32, 4, 2, True),  # reduced keys (n != N)
    (1, 16, 16, 8, 2, 5, True),
]


@pytest.mark.parametrize('B,N,n,C,h,p,with_pos', FLA_CASES)
@pytest.mark.parametrize('grad', [False, True])
def test_fused_fla_core_matches_reference(B, N, n, C, h, p, with_pos, grad):
    q, k, v = _rand(B, N, C, seed=1), _rand(B, n, C, seed=2), _rand(B, n, C, seed=3)
    scale = 0.5 * _rand(1, 1, C, seed=4)
    pos = _rand(1, n, C, seed=5) if with_pos else None
    inputs = [t.clone() for t in (q, k, v)]
    ref = focused_linear_core_reference(q, k if pos is None else k + pos, v, scale, h, p)
    if grad:  # out-of-place path (autograd)
        q.requires_grad_(True)
        out = focused_linear_core(q, k, v, scale, h, p, k_pos=pos)
        assert out.grad_fn is not None
    else:  # in-place path
        with torch.no_grad():
            out = focused_linear_core(q, k, v, scale, h, p, k_pos=pos)
    # A token whose channels are all <= 0 has ||y^p|| underflow to 0 for large p: the
    # literal formula (and the official code) gives NaN there, the fused form (1e-6 / r
    # with r = inf) a finite result. Elsewhere both agree.
    assert torch.isfinite(out).all()
    ok = torch.isfinite(ref).all(-1)
    assert ok.float().mean() > 0.8
    torch.testing.assert_close(out[ok], ref[ok], rtol=1e-5, atol=1e-6)
    for before, after in zip(inputs, (q, k, v)):  # the inputs are never modified
        assert torch.equal(before, after.detach())


def test_fused_fla_core_gradients_match_reference():
    B, N, C, h = 2, 20, 12, 3
    args = [_rand(B, N, C, dtype=torch.float64, seed=s).requires_grad_(True) for s in (1, 2, 3)]
    scale = (0.5 * _rand(1, 1, C, dtype=torch.float64, seed=4)).requires_grad_(True)
    pos = _rand(1, N, C, dtype=torch.float64, seed=5).requires_grad_(True)
    leaves = args + [scale, pos]
    g = _rand(B, N, C, dtype=torch.float64, seed=6)
    q, k, v = args
    out = focused_linear_core(q, k, v, scale, h, 3, k_pos=pos)
    grads = torch.autograd.grad(out, leaves, g)
    ref = focused_linear_core_reference(q, k + pos, v, scale, h, 3)
    grads_ref = torch.autograd.grad(ref, leaves, g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_fused_fla_core_keeps_dtype_and_float32_kernel():
    q, k, v = (_rand(1, 64, 16, seed=s) for s in (1, 2, 3))
    scale = 0.5 * _rand(1, 1, 16, seed=4)
    ref = focused_linear_core_reference(q, k, v, scale, 2, 3)
    with torch.no_grad():
        out = focused_linear_core(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale, 2, 3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


# --------------------------------------------------------------------------- token convs
@pytest.mark.parametrize('groups,kernel', [(12, 3), (12, 5), (1, 3), (4, 1)])
@pytest.mark.parametrize('contiguous', [True, False])
def test_token_conv_equals_conv_on_nchw_map(groups, kernel, contiguous):
    torch.manual_seed(0)
    conv = nn.Conv2d(12, 12, kernel, padding=kernel // 2, groups=groups)
    hw = (5, 7)
    x = _rand(2, 35, 24)[..., :12] if not contiguous else _rand(2, 35, 12)
    ref = nchw_to_nlc(conv(nlc_to_nchw(x, hw)))
    torch.testing.assert_close(token_conv(conv, x, hw), ref, rtol=1e-5, atol=1e-6)


def test_token_conv_repeat_equals_heads_folded_into_batch():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 5, padding=2, groups=4)
    v = _rand(2, 6 * 9, 12)
    ref = depthwise_conv_heads(conv, v, (6, 9), num_heads=3)
    torch.testing.assert_close(token_conv(conv, v, (6, 9), repeat=3), ref, rtol=1e-5,
                               atol=1e-6)
    # gradients reach the shared weights
    conv.zero_grad()
    token_conv(conv, v, (6, 9), repeat=3).sum().backward()
    assert conv.weight.grad.abs().sum() > 0 and conv.bias.grad.abs().sum() > 0


def test_token_views_are_copy_free_and_checked():
    x = _rand(2, 12, 5)
    m = tokens_as_map(x, (3, 4))
    assert m.shape == (2, 5, 3, 4) and m.data_ptr() == x.data_ptr()
    assert map_as_tokens(m).data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match='does not match'):
        tokens_as_map(x, (3, 5))
    with pytest.raises(ValueError, match='size-preserving'):
        token_conv(nn.Conv2d(5, 5, 3), x, (3, 4))


def test_pvt_mlp_dwconv_matches_nchw_formula():
    torch.manual_seed(0)
    mlp = PVTMlp(8, 16, dwconv=True)
    x, hw = _rand(2, 20, 8), (4, 5)
    h = mlp.fc1(x)
    h = nchw_to_nlc(mlp.dwconv(nlc_to_nchw(h, hw)))
    ref = mlp.fc2(mlp.act(h))
    torch.testing.assert_close(mlp(x, hw), ref, rtol=1e-5, atol=1e-6)


def _mlp_step(mlp, x, hw, amp):
    """Output, gradients of ``x`` and the parameters, and the bytes of the storages kept
    for the backward (other than ``x``'s and the parameters') of one training step."""
    mlp.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    with saved_for_backward([x, *mlp.parameters()]) as kept, \
            torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
        out = mlp(x, hw)
    out.float().square().sum().backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in mlp.parameters()], \
        sum(kept.values())


@pytest.mark.parametrize('amp', [False, True], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('dwconv', [True, False])
def test_pvt_mlp_recomputed_activation_same_gradients_less_kept(dwconv, amp):
    """``PVTMlp(recompute_act=True)`` (the default): output and every gradient bit-identical
    to the plain modules, and exactly one hidden activation (the GELU output, in the
    compute dtype) less kept for the backward, two with ``dwconv`` (the conv's output
    too). With a dropout after the activation, or a swapped activation, the plain modules
    run (nothing less kept)."""
    torch.manual_seed(0)
    mlp = PVTMlp(8, 24, dwconv=dwconv)
    x, hw = _rand(2, 20, 8), (4, 5)
    results = {}
    for flag in (True, False):
        mlp.recompute_act = flag
        results[flag] = _mlp_step(mlp, x, hw, amp)
    (fast, fast_kept), (plain, plain_kept) = results[True], results[False]
    for a, b in zip(fast, plain):
        assert torch.equal(a, b)
    hidden_bytes = 2 * 20 * 24 * (2 if amp else 4)
    # (under autocast the recompute keeps its bf16 copy of fc2's weight, which fc2 keeps
    # too in the plain path: the same bytes on both sides; with the conv recomputed, its
    # bf16 bias copy, which the plain conv's backward does not need, is kept too; and the
    # bf16 copy of fc2's bias (8 values), which a double backward's formula reads)
    less = 2 * hidden_bytes - (24 * 2 if amp else 0) if dwconv else hidden_bytes
    less -= 8 * 2 if amp else 0
    assert plain_kept - fast_kept == less, (plain_kept, fast_kept, less)
    mlp.recompute_act = True
    mlp.act = nn.GELU(approximate='tanh')  # (still a GELU: its approximation is recomputed)
    tanh, tanh_kept = _mlp_step(mlp, x, hw, amp)
    mlp.recompute_act = False
    tanh_plain, _ = _mlp_step(mlp, x, hw, amp)
    assert all(torch.equal(a, b) for a, b in zip(tanh, tanh_plain))
    assert tanh_kept == fast_kept
    for swap in (dict(act=nn.ReLU()), dict(act=nn.GELU(), drop=nn.Dropout(0.5))):
        for name, mod in swap.items():
            setattr(mlp, name, mod)
        kept = []
        for flag in (True, False):
            mlp.recompute_act = flag
            assert not mlp._recomputes_act(x.detach().requires_grad_(True))
            torch.manual_seed(1)  # (the same dropout masks)
            kept.append(_mlp_step(mlp, x, hw, amp))
        assert all(torch.equal(a, b) for a, b in zip(kept[0][0], kept[1][0]))
        assert kept[0][1] == kept[1][1], swap


def test_pvt_mlp_recomputed_activation_compiles_in_one_graph():
    """The recomputing MLP traces as one graph when training (``fullgraph``: the
    ``autograd.Function`` is traced, no break) and AOT autograd (``aot_eager``: its forward
    and backward, no code generation) gives eager's output and gradients."""
    torch.manual_seed(0)
    mlp = PVTMlp(8, 24, dwconv=True)
    x, hw = _rand(2, 20, 8), (4, 5)
    assert mlp._recomputes_act(x.requires_grad_(True))
    eager, _ = _mlp_step(mlp, x, hw, False)
    compiled = torch.compile(mlp, backend='aot_eager', fullgraph=True)
    comp, _ = _mlp_step(compiled, x, hw, False)
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('norm', ['BN', 'SyncBN', 'reverted'])
def test_lpi_recomputed_activation_same_gradients_less_kept(norm):
    """``LPI(recompute_act=True)`` (the default) in a training step: the same output and
    running statistics, every gradient bit-identical to the plain modules' (the batch
    statistics are recomputed by the same kernel), and exactly the GELU output (one
    ``(B, C, H, W)`` float32 map) less kept; with BN, SyncBN outside a process group and
    mmengine's reverted SyncBN. Eval mode, autocast and another norm run the plain modules."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d if norm == 'BN' else nn.SyncBatchNorm  # (no process group)
    lpi = LPI(8, norm_layer=bn)
    if norm == 'reverted':  # what mmengine's runner makes of SyncBN outside DDP
        from mmengine.model.utils import revert_sync_batchnorm
        lpi = revert_sync_batchnorm(lpi)
    x, hw = _rand(2, 20, 8), (4, 5)
    results = {}
    for flag in (True, False):
        lpi.recompute_act = flag
        lpi.bn.reset_running_stats()
        results[flag] = _mlp_step(lpi, x, hw, False) + (lpi.bn.running_mean.clone(),
                                                        lpi.bn.running_var.clone())
    (fast, fast_kept, *fast_stats), (plain, plain_kept, *plain_stats) = \
        results[True], results[False]
    assert all(torch.equal(a, b) for a, b in zip(fast + fast_stats, plain + plain_stats))
    # (and the batch norm's four per-channel vectors its own backward keeps: batch mean,
    # inverse std, running mean and variance)
    assert plain_kept - fast_kept == 2 * 20 * 8 * 4 + 4 * 8 * 4, (plain_kept, fast_kept)
    lpi.recompute_act = True
    z = torch.randn(2, 8, 4, 5, requires_grad=True)
    assert lpi._recomputes_act(z)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert not lpi._recomputes_act(z)
    lpi.eval()
    assert not lpi._recomputes_act(z)
    assert not LPI(8, norm_layer=nn.InstanceNorm2d)._recomputes_act(z)


def test_recompute_mlp_act_reaches_every_mlp():
    """Every backbone's ``recompute_mlp_act`` (default ``True``) is each of its MLPs'
    ``recompute_act`` (one MLP per block), and SimA's LPIs' too."""
    from flatten_mm.models.backbones import (PVTv2, FLattenCSWin, FLattenPVT, FLattenPVTv2,
                                             FLattenSwin, QuadTreePVTv2, SimAXCiT)
    small = dict(embed_dims=(8, 16, 24, 32), depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4),
                 mlp_ratios=(2, 2, 2, 2))
    swin = dict(embed_dims=8, depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4))
    cases = [(FLattenPVTv2, dict(arch=small)), (FLattenPVT, dict(arch=small)),
             (QuadTreePVTv2, dict(arch=small, attn_cfg=dict(topk=2))), (PVTv2, dict(arch=small)),
             (FLattenSwin, dict(arch=dict(swin, window_size=2))),
             (FLattenCSWin, dict(arch=dict(swin, split_size=2))),
             (SimAXCiT, dict(arch=dict(embed_dims=16, depth=3, num_heads=2), patch_size=16,
                             block_indices=(0, 1, 2, 2)))]
    for cls, kwargs in cases:
        blocks = None
        for flag in (True, False):
            m = cls(**kwargs, recompute_mlp_act=flag)
            mlps = [mod for mod in m.modules() if isinstance(mod, PVTMlp)]
            blocks = sum(m.depths) if hasattr(m, 'depths') else m.depth
            assert len(mlps) == blocks, cls
            assert all(mod.recompute_act is flag for mod in mlps), cls
            lpis = [mod for mod in m.modules() if isinstance(mod, LPI)]
            assert len(lpis) == (blocks if cls is SimAXCiT else 0), cls
            assert all(mod.recompute_act is flag for mod in lpis), cls
        assert all(mod.recompute_act for mod in cls(**kwargs).modules()
                   if isinstance(mod, PVTMlp))  # (the default)


# ---------------------------------------------------- positional tables (never cached)
def test_fla_module_no_grad_and_grad_mode_equal_the_quadratic_formula_at_a_foreign_grid():
    """The no-grad path (in-place core, resized table) and the autograd path
    (``FocusedLinearCore``) each equal the explicit O(N^2) formula in float64
    (``reference_fla``), and two no-grad calls agree bit for bit (nothing cached)."""
    from test_focused_linear_attention import reference_fla
    torch.manual_seed(0)
    m = FocusedLinearAttention(16, 2, pretrain_hw_shape=(4, 4)).eval()
    with torch.no_grad():
        m.positional_encoding.normal_()
        m.scale.normal_(0, 0.3)
    x = _rand(1, 6 * 5, 16)
    with torch.no_grad():
        first, second = m(x, (6, 5)), m(x, (6, 5))
    grad_mode = m(x.requires_grad_(), (6, 5))
    assert grad_mode.grad_fn is not None
    ref = reference_fla(m, x.detach(), (6, 5))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_mode.detach().double(), ref, rtol=1e-5, atol=1e-6)


def test_window_bias_follows_the_table():
    torch.manual_seed(0)
    m = ShiftedWindowAttention(8, 2, window_size=3, shift=True).eval()
    x, hw = _rand(2, 7 * 8, 8), (7, 8)

    def reference():  # SDPA with the bias and mask recomputed
        B, N, C = x.shape
        xs = F.pad(x.reshape(B, 7, 8, C), (0, 0, 0, 1, 0, 2))  # 9 x 9
        xs = torch.roll(xs, (-1, -1), (1, 2))
        from flatten_mm.models.layers.window import shifted_window_mask, window_partition
        win = window_partition(xs, (3, 3))
        mask = shifted_window_mask((9, 9), (3, 3), (1, 1))
        q, k, v = m.qkv(win).reshape(-1, 9, 3, 2, 4).permute(2, 0, 3, 1, 4)
        bias = m.relative_position_bias().unsqueeze(0) + mask.unsqueeze(1)
        q, k, v = (t.reshape(B, 9, 2, 9, 4) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out = m.proj(out.reshape(-1, 2, 9, 4).transpose(1, 2).reshape(-1, 9, C))
        from flatten_mm.models.layers.window import window_reverse
        out = torch.roll(window_reverse(out, (3, 3), (9, 9)), (1, 1), (1, 2))
        return out[:, :7, :8].reshape(B, N, C)

    with torch.no_grad():
        torch.testing.assert_close(m(x, hw), reference(), rtol=1e-5, atol=1e-6)
        m.relative_position_bias_table.add_(0.5)
        torch.testing.assert_close(m(x, hw), reference(), rtol=1e-5, atol=1e-6)
        # a write that bypasses the version counter is followed too
        m.relative_position_bias_table.data.mul_(-2.0)
        torch.testing.assert_close(m(x, hw), reference(), rtol=1e-5, atol=1e-6)
    out = m(x, hw)  # autograd: a gradient path to the table
    out.sum().backward()
    assert m.relative_position_bias_table.grad.abs().sum() > 0


def test_fla_qkv_windowed_no_grad_and_grad_mode_equal_the_reference():
    """Shifted windows: the no-grad and the autograd path each equal the float64 formula
    of windowed FLA (``reference_qkv_attention``)."""
    from test_focused_linear_qkv import perturb, reference_qkv_attention
    torch.manual_seed(0)
    m = FocusedLinearAttentionQKV(12, 3, window_size=4, shift=True).eval()
    perturb(m)
    x = _rand(2, 9 * 10, 12)
    with torch.no_grad():
        fast = m(x, (9, 10))
    grad_mode = m(x.requires_grad_(), (9, 10))
    assert grad_mode.grad_fn is not None
    ref = reference_qkv_attention(m, x.detach(), (9, 10))
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_mode.detach().double(), ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- SimA
@pytest.mark.parametrize('order', ['qk_first', 'kv_first', 'auto'])
@pytest.mark.parametrize('N,d', [(7, 16), (40, 8), (64, 64)])
def test_sima_folded_normalisation_matches_reference(order, N, d):
    B, h = 2, 3
    qkv = _rand(B, N, 3 * h * d, dtype=torch.float64)  # strided head views, as in the module
    q, k, v = qkv.reshape(B, N, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
    q = q.clone()
    q[..., 0] = 0.  # an all-zero column: the 1e-12 clamp of F.normalize
    torch.testing.assert_close(sima_core(q, k, v, order), sima_core_reference(q, k, v, order),
                               rtol=1e-10, atol=1e-12)


def test_sima_orders_agree_in_float32():
    q, k, v = (_rand(1, 2, 50, 16, seed=s) for s in (1, 2, 3))
    torch.testing.assert_close(sima_core(q, k, v, 'qk_first'), sima_core(q, k, v, 'kv_first'),
                               rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- QuadTree
def test_quadtree_inference_kernels_equal_autograd_kernels():
    gen = torch.Generator().manual_seed(0)
    B, h, L, M, K, d = 2, 3, 10, 40, 6, 5
    query = torch.randn(B, h, L, 4, d, generator=gen)
    key = torch.randn(B, h, M, d, generator=gen)
    weight = torch.randn(B, h, L, 4, K, generator=gen)
    index = torch.randint(0, M, (B, h, L, K), generator=gen)
    with torch.no_grad():
        fast_s = gathered_scores(query, key, index)
        fast_s_chunked = gathered_scores(query, key, index, chunk_elements=1)
        fast_m = gathered_messages(weight, key, index)
    slow_s = gathered_scores(query.requires_grad_(True), key, index)
    slow_m = gathered_messages(weight.requires_grad_(True), key, index)
    torch.testing.assert_close(fast_s, slow_s.detach())
    torch.testing.assert_close(fast_s_chunked, slow_s.detach())
    torch.testing.assert_close(fast_m, slow_m.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('cpu_kernels', [True, False], ids=['cpu-kernels', 'pytorch'])
@pytest.mark.parametrize('attn_type', ['A', 'B'])
def test_quadtree_module_no_grad_and_grad_mode_equal_the_official_pipeline(attn_type,
                                                                           cpu_kernels):
    """The no-grad path (chunked levels) and the autograd path (the CPU training kernel,
    or the batched gathers) each equal a literal port of the official computation
    (``module_reference``), with and without the compiled CPU kernels."""
    from test_quadtree_attention import module_reference
    from flatten_mm.models.ops import quadtree_cpu
    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, attn_type=attn_type, num_levels=3, topk=3,
                          value_act='gelu').eval()
    x = _rand(2, 16 * 20, 16)
    with quadtree_cpu.use_cpu_kernels(cpu_kernels):
        with torch.no_grad():
            fast = m(x, (16, 20))
        grad_mode = m(x.requires_grad_(), (16, 20))
    assert grad_mode.grad_fn is not None
    ref = module_reference(m, x.detach(), (16, 20))
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_mode.detach(), ref, rtol=1e-5, atol=1e-5)


def test_quadtree_projections_equal_1x1_convs_on_the_map():
    torch.manual_seed(0)
    m = QuadTreeAttention(8, 1, num_levels=2, topk=2).eval()
    x, hw = _rand(1, 8 * 8, 8), (8, 8)
    q_ref = nchw_to_nlc(m.q_proj(nlc_to_nchw(x, hw)))
    q = F.linear(x, m.q_proj.weight.reshape(8, 8), m.q_proj.bias)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- XCiT block
def test_xcit_block_fused_layer_scale_equals_residual_form():
    pytest.importorskip('mmengine')
    from flatten_mm.models.backbones.sima_xcit import XCiTBlock
    torch.manual_seed(0)
    block = XCiTBlock(16, 2, layer_scale_init_value=0.5).eval()
    with torch.no_grad():
        for g in (block.gamma1, block.gamma2, block.gamma3):
            g.normal_()
    x, hw = _rand(2, 12, 16), (3, 4)
    with torch.no_grad():
        ref = x + block.gamma1 * block.attn(block.norm1(x), hw)
        ref = ref + block.gamma3 * block.local_mp(block.norm3(ref), hw)
        ref = ref + block.gamma2 * block.mlp(block.norm2(ref), hw)
        torch.testing.assert_close(block(x, hw), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('attn_type,levels,hw,heads,d,topks', [
    ('B', 3, (16, 12), 2, 4, (3, 4, 4)),  # gathered key rows on every level
    ('A', 3, (12, 16), 1, 4, (4, 3, 3)),
    ('B', 4, (16, 16), 3, 4, (2, 3, 3, 3)),
    ('B', 3, (16, 16), 2, 32, (4, 4, 4)),  # level 1 dense (4 M <= 4K d), level 2 gathered
    ('A', 3, (16, 20), 1, 32, (4, 4, 4)),
])
@pytest.mark.parametrize('chunk_elements', [1, 1 << 18])
def test_quadtree_chunked_inference_core_equals_batched_autograd_core(
        monkeypatch, attn_type, levels, hw, heads, d, topks, chunk_elements):
    import flatten_mm.models.layers.quadtree_attention as qt
    from flatten_mm.models.ops import quadtree_rows
    monkeypatch.setattr(quadtree_rows, '_LEVEL_CHUNK_ELEMENTS', chunk_elements)  # 1: a row
    monkeypatch.setattr(quadtree_rows, '_LEVEL_ONE_CHUNK_ELEMENTS', chunk_elements)
    monkeypatch.setattr(quadtree_rows, '_DENSE_ONE_CHUNK_ELEMENTS', chunk_elements)
    gen = torch.Generator().manual_seed(0)
    C = d * heads
    maps = [[torch.randn(2, C, hw[0] >> s, hw[1] >> s, generator=gen)
             for s in range(levels)][::-1] for _ in range(3)]
    weight = lepes = None
    if attn_type == 'B':
        weight = torch.softmax(torch.randn(levels, generator=gen), 0)
        lepes = [torch.randn_like(v) for v in maps[2]]
    recorded = []
    with torch.no_grad():
        fast = qt.quadtree_attention_core(*maps, heads, topks, attn_type, weight,
                                          [(lambda t: lambda: t)(t) for t in lepes]
                                          if lepes else None,
                                          margin_recorder=lambda lv, m: recorded.append(lv))
    for t in maps[0]:
        t.requires_grad_(True)
    slow = qt.quadtree_attention_core(*maps, heads, topks, attn_type, weight, lepes)
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-6)
    assert set(recorded) == set(range(levels - 1))  # every used top-k reported a margin


# ---------------------------------------------------------- on the GPU, at realistic sizes
# ``scripts/gpu_session.sh`` runs these (``pytest -m cuda``); without CUDA they skip. TF32
# is off (the fixture), so float32 paths are compared at float32 tolerances.
on_cuda = [pytest.mark.cuda,
           pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')]


@pytest.fixture
def no_tf32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize('B,N,C,h', [(2, 4096, 64, 1), (1, 3136, 96, 3), (2, 784, 160, 5)])
@pytest.mark.usefixtures('no_tf32')
@pytest.mark.parametrize('_', [pytest.param(0, marks=on_cuda)])
def test_fla_core_on_the_device_matches_the_float64_formula(B, N, C, h, _):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, C, generator=g) for _ in range(3))
    pos, scale = torch.randn(1, N, C, generator=g), 0.5 * torch.randn(1, 1, C, generator=g)
    ref = focused_linear_core_reference(q.double(), (k + pos).double(), v.double(),
                                        scale.double(), h, 3)
    dev = [t.cuda() for t in (q, k, v, scale, pos)]
    with torch.no_grad():
        fast = focused_linear_core(*dev[:4], h, 3, k_pos=dev[4])
        half = focused_linear_core(*(t.bfloat16() for t in dev[:3]), dev[3], h, 3,
                                   k_pos=dev[4])
    leaf = dev[0].clone().requires_grad_(True)
    grad_path = focused_linear_core(leaf, *dev[1:4], h, 3, k_pos=dev[4])
    assert _rel(fast, ref) < TOLERANCES['float32']
    assert _rel(grad_path.detach(), ref) < TOLERANCES['float32']
    assert _rel(half, ref) < 4 * TOLERANCES['bfloat16']  # inputs rounded to bf16 too


@pytest.mark.parametrize('attn_type', ['A', 'B'])
@pytest.mark.usefixtures('no_tf32')
@pytest.mark.parametrize('_', [pytest.param(0, marks=on_cuda)])
def test_quadtree_on_the_device_matches_cpu_and_grad_mode(attn_type, _):
    torch.manual_seed(0)
    m = QuadTreeAttention(64, 2, attn_type=attn_type, num_levels=4, topk=32).eval()
    x = torch.randn(2, 120 * 100, 64)
    with torch.no_grad():
        ref = m(x, (120, 100))
        m.cuda()
        fast = m(x.cuda(), (120, 100))
    assert _rel(fast, ref) < TOLERANCES['float32']
    assert _rel(m(x.cuda(), (120, 100)).detach(), fast) < TOLERANCES['float32']


@pytest.mark.usefixtures('no_tf32')
@pytest.mark.parametrize('_', [pytest.param(0, marks=on_cuda)])
def test_sima_token_convs_and_caches_on_the_device(_):
    torch.manual_seed(0)
    qkv = torch.randn(2, 4096, 3 * 8 * 48, device='cuda')
    q, k, v = qkv.reshape(2, 4096, 3, 8, 48).permute(2, 0, 3, 1, 4).unbind(0)
    for order in ('qk_first', 'kv_first'):
        assert _rel(sima_core(q, k, v, order), sima_core_reference(q, k, v, order)) \
            < TOLERANCES['float32']
    conv = nn.Conv2d(96, 96, 3, padding=1, groups=96).cuda()
    x = torch.randn(2, 64 * 48, 96, device='cuda')
    with torch.no_grad():
        assert _rel(token_conv(conv, x, (64, 48)),
                    nchw_to_nlc(conv(nlc_to_nchw(x, (64, 48))))) < TOLERANCES['float32']
    w = ShiftedWindowAttention(96, 3, window_size=7, shift=True).cuda().eval()
    f = FocusedLinearAttention(32, 1, pretrain_hw_shape=(56, 56)).cuda().eval()
    nn.init.normal_(f.positional_encoding)
    y = torch.randn(1, 100 * 80, 32, device='cuda')
    with torch.no_grad():  # the second call reads the cached bias / positional table
        first_w, first_f = w(x[:, :60 * 45], (60, 45)), f(y, (100, 80))
        assert torch.equal(w(x[:, :60 * 45], (60, 45)), first_w)
        assert torch.equal(f(y, (100, 80)), first_f)


@pytest.mark.parametrize('_', [pytest.param(0, marks=on_cuda)])
@pytest.mark.usefixtures('no_tf32')
def test_backbones_on_the_device_match_the_cpu(_):
    from benchmarks.core.cases import tiny_backbones
    for name, (model, hw) in tiny_backbones().items():
        x = torch.randn(2, 3, *hw)
        model.eval()
        with torch.no_grad():
            ref = model(x)
            got = model.cuda()(x.cuda())
        assert max(_rel(a, b) for a, b in zip(got, ref)) < TOLERANCES['float32'], name
