"""Window utilities: padding, partition/reverse, per-axis shift rule, shifted-window masks
(against an explicit region reference) and their per-shape cache."""
import pytest
import torch

from flatten_mm.models.layers import window as win


@pytest.mark.parametrize('hw,window,centred', [((7, 7), (7, 7), False), ((10, 13), (4, 4), False),
                                               ((10, 13), (4, 4), True), ((9, 14), (9, 3), True),
                                               ((1, 5), (7, 2), False)])
def test_pad_partition_reverse_crop_roundtrip(hw, window, centred):
    x = torch.randn(2, *hw, 3)
    padded, pads = win.pad_to_multiple(x, window, centred=centred)
    Hp, Wp = padded.shape[1:3]
    assert Hp % window[0] == 0 and Wp % window[1] == 0
    assert Hp - hw[0] < window[0] and Wp - hw[1] < window[1]
    top, bottom, left, right = pads
    if centred:
        assert (top, left) == ((Hp - hw[0]) // 2, (Wp - hw[1]) // 2)
    else:
        assert top == left == 0
    # the original values sit at the offset given by the pads, the rest is zero
    assert torch.equal(padded[:, top:top + hw[0], left:left + hw[1]], x)
    assert padded.abs().sum() == x.abs().sum()
    windows = win.window_partition(padded, window)
    nW = (Hp // window[0]) * (Wp // window[1])
    assert windows.shape == (2 * nW, window[0] * window[1], 3)
    # window k of image b holds the tokens of its rectangle, row-major
    b, k = 1, nW - 1
    wy, wx = divmod(k, Wp // window[1])
    rect = padded[b, wy * window[0]:(wy + 1) * window[0], wx * window[1]:(wx + 1) * window[1]]
    assert torch.equal(windows[b * nW + k], rect.reshape(-1, 3))
    back = win.window_reverse(windows, window, (Hp, Wp))
    assert torch.equal(back, padded)
    assert torch.equal(win.crop_padding(back, pads), x)


def test_partition_rejects_unpadded_map():
    with pytest.raises(ValueError, match='multiple of the window'):
        win.window_partition(torch.zeros(1, 10, 14, 2), (7, 7))


@pytest.mark.parametrize('padded,window,shift,expected', [
    ((14, 14), (7, 7), (3, 3), (3, 3)),
    ((7, 7), (7, 7), (3, 3), (0, 0)),  # single window: the official no-shift rule
    ((7, 21), (7, 7), (3, 3), (0, 3)),  # per axis
    ((14, 14), (7, 7), (0, 0), (0, 0)),
])
def test_effective_shift(padded, window, shift, expected):
    assert win.effective_shift(padded, window, shift) == expected


def reference_mask(Hp, Wp, w, sy, sx):
    """Explicit meaning of the shifted-window mask, without roll or slices: after a
    cyclic shift by (sy, sx) the windows are the rectangles with borders at
    s, s + w, s + 2w, ... of the unrolled map (the first and the last one partial)."""
    ys, xs = torch.meshgrid(torch.arange(Hp), torch.arange(Wp), indexing='ij')
    gy = (ys + w - sy) // w if sy else ys // w
    gx = (xs + w - sx) // w if sx else xs // w
    # rolled position of every original token, to express the mask in window order
    ry, rx = (ys - sy) % Hp, (xs - sx) % Wp
    order = torch.empty(Hp * Wp, dtype=torch.long)
    # window-partition index of the rolled position
    n = w * w
    widx = (ry // w) * (Wp // w) + (rx // w)
    tidx = (ry % w) * w + (rx % w)
    order[(widx * n + tidx).flatten()] = torch.arange(Hp * Wp)
    g = (gy * 1000 + gx).flatten()[order].reshape(-1, n)
    allowed = g[:, :, None] == g[:, None, :]
    return torch.where(allowed, 0.0, win.MASK_VALUE)


@pytest.mark.parametrize('Hp,Wp,w,sy,sx', [(14, 14, 7, 3, 3), (8, 12, 4, 2, 2), (7, 14, 7, 0, 3),
                                           (12, 8, 4, 2, 0), (15, 10, 5, 2, 2)])
def test_shifted_window_mask_matches_explicit_regions(Hp, Wp, w, sy, sx):
    mask = win.shifted_window_mask((Hp, Wp), (w, w), (sy, sx))
    assert torch.equal(mask, reference_mask(Hp, Wp, w, sy, sx))


def test_mask_is_none_without_shift():
    assert win.shifted_window_mask((14, 14), (7, 7), (0, 0)) is None


def test_official_224_mask():
    """The 14x14 stage-3 mask (window 7, shift 3) of the official model: 4 windows, the
    first unmasked, the last split into four regions."""
    mask = win.shifted_window_mask((14, 14), (7, 7), (3, 3))
    assert mask.shape == (4, 49, 49)
    assert (mask[0] == 0).all()
    assert (mask[3] != 0).float().mean() > 0.5


def test_mask_cache_per_shape():
    win.clear_mask_cache()
    shapes = [((8, 12), (4, 4), (2, 2)), ((12, 8), (4, 4), (2, 2)), ((8, 12), (4, 4), (0, 2))]
    first = [win.shifted_window_mask(*s) for s in shapes]
    info = win.mask_cache_info()
    assert info.misses == 3 and info.hits == 0
    again = [win.shifted_window_mask(*s) for s in reversed(shapes)][::-1]
    assert win.mask_cache_info().hits == 3
    for s, a, b in zip(shapes, first, again):
        assert a is b  # served from the cache
        assert torch.equal(a, reference_mask(*s[0], s[1][0], *s[2]))  # and correct for its shape
    assert first[0].shape != first[1].shape or not torch.equal(first[0], first[1])
