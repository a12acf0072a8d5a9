"""CrossShapedAttention (CSWin) against an explicit full-map formulation of cross-shaped
stripes with centred zero padding, and the global (last-stage / FLA) single branch."""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models.layers import CrossShapedAttention, LePEAttention, build_attention


def reference_cross_shaped(m: CrossShapedAttention, x: torch.Tensor, hw) -> torch.Tensor:
    """float64 reference with LePE branches only. Branch 0 attends inside vertical
    stripes (full height x s), branch 1 inside horizontal stripes (s x full width) of the
    map zero-padded (q, k, v after the projection) centred to multiples of s; LePE is a
    3x3 depth-wise conv on V inside each stripe."""
    W_ = {k: v.double() for k, v in m.state_dict().items()}
    B, N, C = x.shape
    H, W = hw
    s = m.split_size
    nb = len(m.branches)
    Cb, hb = C // nb, m.num_heads // nb
    d = Cb // hb
    qkv = (x.double() @ W_['qkv.weight'].T + W_['qkv.bias']).reshape(B, H, W, 3, C)
    outs = []
    for b in range(nb):
        t = qkv[..., b * Cb:(b + 1) * Cb]  # (B, H, W, 3, Cb)
        if s is None:
            ph = pw = 0
        else:
            ph, pw = (0, (-W) % s) if b == 0 else ((-H) % s, 0)
        top, left = ph // 2, pw // 2
        Hp, Wp = H + ph, W + pw
        tp = torch.zeros(B, Hp, Wp, 3, Cb, dtype=torch.float64)
        tp[:, top:top + H, left:left + W] = t
        ys, xs = torch.meshgrid(torch.arange(Hp), torch.arange(Wp), indexing='ij')
        if s is None:
            group = torch.zeros(Hp * Wp, dtype=torch.long)
        else:
            group = (xs // s if b == 0 else ys // s).flatten()
        allowed = group[:, None] == group[None, :]
        q, k, v = (tp[..., i, :].reshape(B, Hp * Wp, Cb) for i in range(3))
        out = torch.zeros(B, Hp * Wp, Cb, dtype=torch.float64)
        for head in range(hb):
            sl = slice(head * d, (head + 1) * d)
            logits = (q[..., sl] * d**-0.5) @ k[..., sl].transpose(1, 2)
            out[..., sl] = logits.masked_fill(~allowed, float('-inf')).softmax(-1) @ v[..., sl]
        # LePE inside each stripe (zero padding at the stripe borders)
        v_map = v.reshape(B, Hp, Wp, Cb).permute(0, 3, 1, 2)
        lepe = torch.zeros_like(v_map)
        if s is None:
            step = (Hp, Wp)
        else:
            step = (Hp, s) if b == 0 else (s, Wp)
        for y0 in range(0, Hp, step[0]):
            for x0 in range(0, Wp, step[1]):
                region = v_map[:, :, y0:y0 + step[0], x0:x0 + step[1]]
                pre = f'branches.{b}.get_v.'
                lepe[:, :, y0:y0 + step[0], x0:x0 + step[1]] = F.conv2d(
                    region, W_[pre + 'weight'], W_[pre + 'bias'], padding=1, groups=Cb)
        out = out + lepe.flatten(2).transpose(1, 2)
        out = out.reshape(B, Hp, Wp, Cb)[:, top:top + H, left:left + W]
        outs.append(out.reshape(B, N, Cb))
    out = torch.cat(outs, dim=-1)
    return out @ W_['proj.weight'].T + W_['proj.bias']


@pytest.mark.parametrize('hw,split', [((14, 14), 7), ((9, 13), 4), ((5, 3), 4), ((6, 6), 2),
                                      ((9, 13), None), ((1, 4), None)])
def test_matches_explicit_reference(hw, split):
    torch.manual_seed(0)
    m = CrossShapedAttention(16, 4, split_size=split).eval()
    assert len(m.branches) == (1 if split is None else 2)
    x = torch.randn(2, hw[0] * hw[1], 16)
    with torch.no_grad():
        out = m(x, hw)
    torch.testing.assert_close(out.double(), reference_cross_shaped(m, x, hw), atol=1e-5,
                               rtol=1e-5)


def test_fla_branch_region_grids_and_build_by_name():
    m = build_attention(dict(type='flatten_mm.CrossShapedAttention', split_size=None,
                             branch_cfg=dict(type='FocusedLinearQKV', lepe=True)),
                        embed_dims=16, num_heads=4, pretrain_hw_shape=(14, 10))
    assert m.branches[0].pe_hw_shape == (14, 10)
    assert m.branches[0].positional_encoding.shape == (1, 140, 16)
    stripes = CrossShapedAttention(16, 4, split_size=5, pretrain_hw_shape=(14, 10),
                                   branch_cfg=dict(type='FocusedLinearQKV', lepe=True))
    assert [b.pe_hw_shape for b in stripes.branches] == [(14, 5), (5, 10)]
    with torch.no_grad():
        assert stripes(torch.randn(1, 99, 16), (9, 11)).shape == (1, 99, 16)


def test_gradients_reach_every_parameter():
    m = CrossShapedAttention(8, 2, split_size=3)
    m(torch.randn(1, 35, 8), (5, 7)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bad_arguments():
    with pytest.raises(ValueError, match='even'):
        CrossShapedAttention(12, 3, split_size=7)
    with pytest.raises(ValueError, match='split_size'):
        CrossShapedAttention(8, 2, split_size=0)
    with pytest.raises(KeyError, match='branch'):
        CrossShapedAttention(8, 2, branch_cfg=dict(type='Nope'))
    with pytest.raises(ValueError, match='divisible'):
        LePEAttention(10, 4)
