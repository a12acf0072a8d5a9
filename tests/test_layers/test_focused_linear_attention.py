"""FocusedLinearAttention against an explicit O(N^2) formulation, and its numerics."""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models.layers import FocusedLinearAttention, resize_pos_table


def reference_fla(m: FocusedLinearAttention, x: torch.Tensor, hw) -> torch.Tensor:
    """Explicit quadratic formulation (float64): attention matrix A_ij = phi(q_i).phi(k_j),
    out_i = sum_j A_ij v_j / (sum_j A_ij + n*1e-6) + DWC(V), then proj."""
    x = x.double()
    B, N, C = x.shape
    h, d, p = m.num_heads, m.head_dims, m.focusing_factor
    W = {k: v.double() for k, v in m.state_dict().items()}
    q = x @ W['q.weight'].T + W['q.bias']
    if m.linear:
        xm = x.transpose(1, 2).reshape(B, C, *hw)
        xr = F.adaptive_avg_pool2d(xm, 7)
        xr = F.conv2d(xr, W['sr.weight'], W['sr.bias']).flatten(2).transpose(1, 2)
        xr = F.gelu(F.layer_norm(xr, (C,), W['norm.weight'], W['norm.bias']))
        kv_hw = (7, 7)
    elif m.sr_ratio > 1:
        xm = x.transpose(1, 2).reshape(B, C, *hw)
        xr = F.conv2d(xm, W['sr.weight'], W['sr.bias'], stride=m.sr_ratio)
        kv_hw = xr.shape[-2:]
        xr = F.layer_norm(xr.flatten(2).transpose(1, 2), (C,), W['norm.weight'], W['norm.bias'])
    else:
        xr, kv_hw = x, hw
    kv = xr @ W['kv.weight'].T + W['kv.bias']
    k, v = kv[..., :C], kv[..., C:]
    pe = W['positional_encoding'].reshape(1, *m.pe_hw_shape, C).permute(0, 3, 1, 2)
    if tuple(kv_hw) != tuple(m.pe_hw_shape):
        pe = F.interpolate(pe, size=tuple(kv_hw), mode='bilinear', align_corners=False)
    k = k + pe.flatten(2).transpose(1, 2)
    s = F.softplus(W['scale'])

    def phi(t):
        t = (F.relu(t) + 1e-6) / s
        n = t.norm(dim=-1, keepdim=True)
        tp = t ** p
        return tp / tp.norm(dim=-1, keepdim=True) * n

    q, k = phi(q), phi(k)
    n_kv = k.shape[1]
    out = torch.zeros(B, N, C, dtype=torch.float64)
    for head in range(h):
        sl = slice(head * d, (head + 1) * d)
        A = q[..., sl] @ k[..., sl].transpose(1, 2)  # (B, N, n) -- the explicit N x n matrix
        out[..., sl] = (A @ v[..., sl]) / (A.sum(-1, keepdim=True) + n_kv * 1e-6)
    # DWC on V per head (shared weights), V resized along tokens when n != N
    vh = v.reshape(B, n_kv, h, d).permute(0, 2, 3, 1).reshape(B * h, d, n_kv)
    if n_kv != N:
        vh = F.interpolate(vh, size=N, mode='linear', align_corners=False)
    dwc = F.conv2d(vh.reshape(B * h, d, *hw), W['dwc.weight'], W['dwc.bias'],
                   padding=m.dwc.padding, groups=d)
    out = out + dwc.reshape(B, C, N).transpose(1, 2)
    return out @ W['proj.weight'].T + W['proj.bias']


def randomise(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


CASES = [
    # (embed_dims, heads, sr, linear, pretrain_hw, hw)
    (16, 2, 1, False, (6, 6), (6, 6)),  # pretraining grid: PE used as stored
    (16, 2, 1, False, (6, 6), (5, 9)),  # non-square, resized PE
    (24, 3, 2, False, (8, 8), (7, 10)),  # spatial reduction, odd map
    (16, 1, 8, True, (56, 56), (9, 11)),  # PVTv2-li pooled keys
]


@pytest.mark.parametrize('dims,heads,sr,linear,pre_hw,hw', CASES)
def test_fla_equals_quadratic_reference(dims, heads, sr, linear, pre_hw, hw):
    m = FocusedLinearAttention(dims, heads, sr_ratio=sr, linear=linear, pretrain_hw_shape=pre_hw)
    randomise(m)
    x = torch.randn(2, hw[0] * hw[1], dims)
    out = m(x, hw)
    ref = reference_fla(m, x, hw)
    assert out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_pe_resize_is_identity_at_pretraining_grid():
    table = torch.randn(1, 7 * 7, 8)
    assert resize_pos_table(table, (7, 7), (7, 7)) is table
    resized = resize_pos_table(table, (7, 7), (9, 5))
    assert resized.shape == (1, 45, 8)
    # resizing back and forth on a smooth (bilinear-exact) ramp keeps the values
    ramp = torch.linspace(0, 1, 7).repeat(7, 1).reshape(1, 49, 1)
    up = resize_pos_table(ramp, (7, 7), (14, 14))
    assert torch.all(up[0, :, 0].reshape(14, 14).diff(dim=1) >= -1e-6)


def test_gradients_reach_every_parameter():
    m = FocusedLinearAttention(16, 2, sr_ratio=2, pretrain_hw_shape=(8, 8))
    x = torch.randn(2, 6 * 10, 16, requires_grad=True)
    m(x, (6, 10)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_autocast_bf16_is_finite_and_close_at_detection_size():
    torch.manual_seed(0)
    m = FocusedLinearAttention(32, 1, pretrain_hw_shape=(56, 56)).eval()
    randomise(m)
    hw = (200, 336)  # stage-1 grid of an 800x1344 image
    x = torch.randn(1, hw[0] * hw[1], 32) * 3
    with torch.no_grad():
        ref = m(x, hw)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            low = m(x, hw)
    assert torch.isfinite(low).all()
    err = (low.float() - ref).abs().max() / ref.abs().max()
    assert err < 3e-2, err  # bf16 projections (8-bit mantissa); the kernel itself is fp32


def test_kernel_is_fp32_for_fp16_inputs():
    # values that overflow fp16 once cubed: the kernel must not produce inf/nan
    from flatten_mm.models.layers.focused_linear_attention import focused_linear_core
    q = (torch.randn(1, 64, 8) * 60).half()
    k = (torch.randn(1, 64, 8) * 60).half()
    v = torch.randn(1, 64, 8).half()
    out = focused_linear_core(q, k, v, torch.zeros(1, 1, 8), 2, 3)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_load_resizes_table_of_other_pretraining_grid():
    a = FocusedLinearAttention(8, 1, pretrain_hw_shape=(6, 6))
    b = FocusedLinearAttention(8, 1, pretrain_hw_shape=(9, 9))
    sd = a.state_dict()
    b.load_state_dict(sd)
    expected = resize_pos_table(sd['positional_encoding'], (6, 6), (9, 9), mode='bicubic')
    torch.testing.assert_close(b.positional_encoding.data, expected)


def test_bad_arguments():
    with pytest.raises(ValueError, match='divisible'):
        FocusedLinearAttention(10, 3)
    with pytest.raises(ValueError, match='49 tokens'):
        FocusedLinearAttention(8, 1, linear=True, sr_ratio=1, pretrain_hw_shape=(56, 56))
    with pytest.raises(NotImplementedError):
        FocusedLinearAttention(8, 1, attn_drop=0.1)
