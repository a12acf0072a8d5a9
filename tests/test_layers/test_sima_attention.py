"""SimA attention: reference formula, both matmul orders, order rule, numerics."""
import math

import pytest
import torch

from flatten_mm.models.layers import (ATTENTIONS, FourierPositionalEncoding, SimAAttention,
                                      build_attention)
from flatten_mm.models.layers import sima_attention as sima_mod
from flatten_mm.models.layers.sima_attention import sima_core, sima_order


def reference_sima(module: SimAAttention, x: torch.Tensor) -> torch.Tensor:
    """Literal per-head formula in float64: column-wise L1 normalisation over tokens,
    no softmax, ``(Q_n K_n^T) V`` via an explicit N x N matrix, then ``proj``."""
    x = x.double()
    B, N, C = x.shape
    h, d = module.num_heads, module.head_dims
    qkv = x @ module.qkv.weight.double().t() + module.qkv.bias.double()
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    out = torch.empty(B, N, C, dtype=torch.float64)
    for b in range(B):
        for head in range(h):
            sl = slice(head * d, (head + 1) * d)
            qh, kh, vh = q[b, :, sl], k[b, :, sl], v[b, :, sl]
            qh = qh / qh.abs().sum(0, keepdim=True).clamp_min(1e-12)
            kh = kh / kh.abs().sum(0, keepdim=True).clamp_min(1e-12)
            attn = qh @ kh.t()  # (N, N), signed, not a softmax
            out[b, :, sl] = attn @ vh
    return out @ module.proj.weight.double().t() + module.proj.bias.double()


@pytest.mark.parametrize('order', ['auto', 'qk_first', 'kv_first'])
@pytest.mark.parametrize('num_tokens', [5, 16, 40])  # N < d, N == d, N > d (d = 16)
def test_matches_reference_formula(order, num_tokens):
    module = SimAAttention(32, 2, order=order).eval()
    x = torch.randn(2, num_tokens, 32)
    out = module(x, (1, num_tokens))
    ref = reference_sima(module, x)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('num_tokens', [3, 24, 32, 100])
def test_both_orders_agree(num_tokens):
    q, k, v = (torch.randn(2, 3, num_tokens, 32, dtype=torch.float64) for _ in range(3))
    a = sima_core(q, k, v, 'qk_first')
    b = sima_core(q, k, v, 'kv_first')
    assert a.dtype == torch.float64  # float64 is not demoted to float32
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    a32 = sima_core(q.float(), k.float(), v.float(), 'qk_first')
    b32 = sima_core(q.float(), k.float(), v.float(), 'kv_first')
    torch.testing.assert_close(a32, b32, rtol=1e-5, atol=1e-6)


def test_token_permutation_equivariance():
    module = SimAAttention(24, 3).eval()
    x = torch.randn(2, 50, 24, dtype=torch.float64)
    module.double()
    perm = torch.randperm(50)
    out = module(x, (5, 10))
    out_perm = module(x[:, perm], (5, 10))
    torch.testing.assert_close(out_perm, out[:, perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('num_tokens,head_dims', [(1, 8), (7, 8), (8, 8), (9, 8), (48, 48),
                                                  (196, 48), (4096, 64), (20, 64)])
def test_auto_order_is_the_cheaper_one(num_tokens, head_dims):
    cost = {'qk_first': 2 * num_tokens**2 * head_dims, 'kv_first': 2 * num_tokens * head_dims**2}
    chosen = sima_order(num_tokens, head_dims)
    assert cost[chosen] <= min(cost.values())
    if num_tokens == head_dims:  # tie: the official code takes kv_first
        assert chosen == 'kv_first'


def test_forward_uses_resolved_order(monkeypatch):
    seen = []
    real = sima_mod.sima_core

    def spy(q, k, v, order='auto'):
        seen.append(order)
        return real(q, k, v, order)

    monkeypatch.setattr(sima_mod, 'sima_core', spy)
    module = SimAAttention(32, 2)  # d = 16
    module(torch.randn(1, 10, 32), (2, 5))
    module(torch.randn(1, 30, 32), (5, 6))
    assert seen == ['qk_first', 'kv_first']
    forced = SimAAttention(32, 2, order='qk_first')
    forced(torch.randn(1, 30, 32), (5, 6))
    assert seen[-1] == 'qk_first'


# max |out - fp32| / max |fp32|, measured for seeds 0-3 (2-core AMD EPYC, torch 2.14):
# bf16 2.5e-3 .. 2.9e-3, fp16 4.6e-4 .. 5.0e-4 (the output's own rounding: a third / half
# of each format's eps); the bounds are twice the largest
AUTOCAST_ERROR = {torch.bfloat16: 6e-3, torch.float16: 1e-3}


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_autocast_is_finite_and_accurate_at_many_tokens(dtype):
    """bf16 / fp16 autocast on CPU at 16384 tokens (L1-normalised entries ~1e-4, which a
    half-precision core would flush or overflow): finite, in the autocast dtype, within
    the measured error of the float32 result."""
    torch.manual_seed(0)
    module = SimAAttention(64, 2).eval()
    x = torch.randn(1, 128 * 128, 64)
    with torch.no_grad():
        ref = module(x, (128, 128))
        with torch.autocast('cpu', dtype=dtype):
            out = module(x, (128, 128))
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err <= AUTOCAST_ERROR[dtype], err


def test_core_runs_in_float32_under_autocast(monkeypatch):
    dtypes = []
    real_column_l1 = sima_mod._column_l1  # the L1 normalisation of q and k

    def spy(x, *args, **kwargs):
        dtypes.append(x.dtype)
        return real_column_l1(x, *args, **kwargs)

    monkeypatch.setattr(sima_mod, '_column_l1', spy)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        SimAAttention(32, 2)(torch.randn(1, 64, 32), (8, 8))
    assert dtypes == [torch.float32, torch.float32]


def test_gradients_and_shapes():
    module = SimAAttention(32, 4)
    x = torch.randn(2, 35, 32, requires_grad=True)
    out = module(x, (5, 7))
    assert out.shape == x.shape
    out.square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_invalid_arguments():
    with pytest.raises(ValueError, match='divisible'):
        SimAAttention(30, 4)
    with pytest.raises(NotImplementedError, match='dropout'):
        SimAAttention(32, 4, attn_drop=0.1)
    with pytest.raises(ValueError, match='order'):
        SimAAttention(32, 4, order='fast')


def test_registered_and_usable_as_pvt_stage_attention():
    assert ATTENTIONS['SimAAttention'] is SimAAttention
    op = build_attention(dict(type='flatten_mm.SimAAttention', order='kv_first'), embed_dims=16,
                         num_heads=2, qkv_bias=False, sr_ratio=4, linear=False)
    assert op.order == 'kv_first' and op.qkv.bias is None
    from flatten_mm.models import FLattenPVTv2
    arch = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                mlp_ratios=(2, 2, 2, 2))
    model = FLattenPVTv2(arch=arch, attn_cfg=dict(type='SimAAttention')).eval()
    assert all(isinstance(s.blocks[0].attn, SimAAttention) for s in model.stages)
    outs = model(torch.randn(1, 3, 33, 47))
    assert len(outs) == 4 and all(torch.isfinite(o).all() for o in outs)


def test_fourier_encoding_matches_formula():
    pe = FourierPositionalEncoding(hidden_dim=4, dim=8)
    feats = pe.fourier_features((3, 5))
    assert feats.shape == (1, 8, 3, 5) and feats.dtype == torch.float32
    y = torch.arange(1, 4, dtype=torch.float64) / (3 + 1e-6) * 2 * math.pi
    x = torch.arange(1, 6, dtype=torch.float64) / (5 + 1e-6) * 2 * math.pi
    t = [10000**(2 * (i // 2) / 4) for i in range(4)]
    for i in range(4):
        fn = torch.sin if i % 2 == 0 else torch.cos
        torch.testing.assert_close(feats[0, i].double(), fn(y / t[i])[:, None].expand(3, 5),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(feats[0, 4 + i].double(), fn(x / t[i])[None, :].expand(3, 5),
                                   atol=1e-6, rtol=1e-5)
    assert pe((3, 5)).shape == (1, 15, 8)
