"""ShiftedWindowAttention against an explicit full-map formulation (no roll, no
partition): attention restricted to token pairs of the same (shifted) window, with the
relative position bias looked up from each pair's offset."""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models.layers import ShiftedWindowAttention
from flatten_mm.models.layers.window_attention import relative_position_index


def reference_window_attention(m: ShiftedWindowAttention, x: torch.Tensor, hw) -> torch.Tensor:
    """float64 reference. The map is zero-padded at the bottom/right to window
    multiples (padded tokens are keys, as in Swin-det); along an axis with more than one
    window a shift ``s = w // 2`` makes the windows the rectangles with borders at
    ``s, s + w, ...`` of the padded map; pairs in different windows are excluded."""
    W_ = {k: v.double() for k, v in m.state_dict().items()}
    B, N, C = x.shape
    H, W = hw
    w, h = m.window_size, m.num_heads
    d = C // h
    Hp, Wp = -(-H // w) * w, -(-W // w) * w
    xp = torch.zeros(B, Hp, Wp, C, dtype=torch.float64)
    xp[:, :H, :W] = x.double().reshape(B, H, W, C)
    xp = xp.reshape(B, Hp * Wp, C)
    qkv = xp @ W_['qkv.weight'].T + W_['qkv.bias']
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    ys, xs = torch.meshgrid(torch.arange(Hp), torch.arange(Wp), indexing='ij')
    ys, xs = ys.flatten(), xs.flatten()
    sy = w // 2 if m.shift and Hp > w else 0
    sx = w // 2 if m.shift and Wp > w else 0
    gy = (ys + w - sy) // w if sy else ys // w
    gx = (xs + w - sx) // w if sx else xs // w
    allowed = (gy[:, None] == gy[None, :]) & (gx[:, None] == gx[None, :])
    dy = ys[:, None] - ys[None, :] + w - 1
    dx = xs[:, None] - xs[None, :] + w - 1
    table = W_['relative_position_bias_table']  # ((2w-1)^2, h)
    out = torch.zeros(B, Hp * Wp, C, dtype=torch.float64)
    for head in range(h):
        sl = slice(head * d, (head + 1) * d)
        logits = (q[..., sl] * d**-0.5) @ k[..., sl].transpose(1, 2)
        bias = torch.where(allowed, table[(dy * (2 * w - 1) + dx).clamp(0, table.shape[0] - 1),
                                          head], torch.zeros(()).double())
        logits = (logits + bias).masked_fill(~allowed, float('-inf'))
        out[..., sl] = logits.softmax(-1) @ v[..., sl]
    out = out @ W_['proj.weight'].T + W_['proj.bias']
    return out.reshape(B, Hp, Wp, C)[:, :H, :W].reshape(B, N, C)


@pytest.mark.parametrize('hw,window,shift', [((8, 8), 4, False), ((8, 8), 4, True),
                                             ((14, 14), 7, True), ((10, 13), 4, True),
                                             ((5, 11), 4, True), ((3, 2), 4, True),
                                             ((9, 6), 3, False)])
def test_matches_explicit_reference(hw, window, shift):
    torch.manual_seed(0)
    m = ShiftedWindowAttention(16, 2, window_size=window, shift=shift).eval()
    x = torch.randn(2, hw[0] * hw[1], 16)
    with torch.no_grad():
        out = m(x, hw)
    ref = reference_window_attention(m, x, hw)
    # -100 vs -inf for excluded pairs: exp(-100) is far below float32 resolution
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_relative_position_index_formula():
    w = 3
    idx = relative_position_index(w)
    for i in range(w * w):
        for j in range(w * w):
            (yi, xi), (yj, xj) = divmod(i, w), divmod(j, w)
            assert idx[i, j] == (yi - yj + w - 1) * (2 * w - 1) + (xi - xj + w - 1)


def test_index_not_in_state_dict_and_table_resized_on_load():
    m7 = ShiftedWindowAttention(8, 2, window_size=7)
    assert 'relative_position_index' not in m7.state_dict()
    m12 = ShiftedWindowAttention(8, 2, window_size=12)
    m12.load_state_dict(m7.state_dict())
    assert m12.relative_position_bias_table.shape == (23 * 23, 2)
    grid = m7.relative_position_bias_table.detach().t().reshape(1, 2, 13, 13)
    expected = F.interpolate(grid, size=(23, 23), mode='bicubic', align_corners=False)
    torch.testing.assert_close(m12.relative_position_bias_table.detach(),
                               expected.reshape(2, -1).t())


def test_gradients_and_bad_args():
    m = ShiftedWindowAttention(8, 2, window_size=4, shift=True)
    x = torch.randn(1, 6 * 9, 8, requires_grad=True)
    m(x, (6, 9)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    with pytest.raises(ValueError, match='does not match'):
        m(torch.randn(1, 10, 8), (3, 3))
    with pytest.raises(ValueError, match='divisible'):
        ShiftedWindowAttention(10, 3)
    with pytest.raises(ValueError, match='window_size'):
        ShiftedWindowAttention(8, 2, window_size=0)
