"""Window utilities of windowed / stripe attention (Swin windows, CSWin stripes).

Maps are handled here as channels-last tensors ``(B, H, W, C)``; a window is a
rectangle ``(wh, ww)``. Every helper works for any ``(H, W)``: maps are zero-padded to
window multiples first (``pad_to_multiple``), windows are cut and merged back
(``window_partition`` / ``window_reverse``) and the padding is removed again
(``crop_padding``).

Shifted windows (Swin) use a cyclic shift of the padded map plus an additive mask that
keeps tokens which were not neighbours before the shift apart (``shifted_window_mask``,
computed for the actual padded size, cached per shape and device). Along an axis that
holds a single window the shift is dropped (``effective_shift``): there is nothing to
connect, and a masked shift would only cut the window into pieces. At the pretraining
sizes of the official models this is exactly the official rule (no shift when the
resolution is at most the window).
"""
import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .pos_embed import _exporting

#: additive mask value between tokens of different shifted-window regions (Swin's choice;
#: finite, so a row can never be all ``-inf``)
MASK_VALUE = -100.0

Pads = Tuple[int, int, int, int]  # top, bottom, left, right


def to_2tuple(window) -> Tuple[int, int]:
    """``7 -> (7, 7)``; a pair is returned as a tuple."""
    if isinstance(window, int):
        return window, window
    wh, ww = window
    return int(wh), int(ww)


def pad_to_multiple(x: torch.Tensor, window: Tuple[int, int],
                    centred: bool = False) -> Tuple[torch.Tensor, Pads]:
    """Zero-pad a channels-last map so that both sides are multiples of the window.

    Args:
        x: ``(B, H, W, C)`` map.
        window: ``(wh, ww)``.
        centred: split the padding evenly (top/left get ``pad // 2``, bottom/right the
            rest; CSWin-seg) instead of padding only at the bottom/right (Swin-det).

    Returns:
        The padded ``(B, Hp, Wp, C)`` map and the pads ``(top, bottom, left, right)``.
    """
    H, W = x.shape[1], x.shape[2]
    wh, ww = window
    pad_h, pad_w = (-H) % wh, (-W) % ww
    if centred:
        pads = (pad_h // 2, pad_h - pad_h // 2, pad_w // 2, pad_w - pad_w // 2)
    else:
        pads = (0, pad_h, 0, pad_w)
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, pads[2], pads[3], pads[0], pads[1]))
    return x, pads


def crop_padding(x: torch.Tensor, pads: Pads) -> torch.Tensor:
    """Undo ``pad_to_multiple`` on a ``(B, Hp, Wp, C)`` map."""
    top, bottom, left, right = pads
    if top or bottom or left or right:
        x = x[:, top:x.shape[1] - bottom, left:x.shape[2] - right, :]
    return x


def window_partition(x: torch.Tensor, window: Tuple[int, int]) -> torch.Tensor:
    """Cut a ``(B, Hp, Wp, C)`` map into windows.

    Returns:
        ``(B * nW, wh * ww, C)``: windows in row-major order of the window grid (batch
        outermost), tokens row-major inside each window.
    """
    B, Hp, Wp, C = x.shape
    wh, ww = window
    if Hp % wh or Wp % ww:
        raise ValueError(f'map {Hp}x{Wp} is not a multiple of the window {wh}x{ww}; '
                         'pad it with pad_to_multiple first')
    x = x.view(B, Hp // wh, wh, Wp // ww, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, wh * ww, C)


def window_reverse(windows: torch.Tensor, window: Tuple[int, int],
                   hw_shape: Tuple[int, int]) -> torch.Tensor:
    """Inverse of ``window_partition``: ``(B * nW, wh * ww, C)`` -> ``(B, Hp, Wp, C)``."""
    Hp, Wp = hw_shape
    wh, ww = window
    C = windows.shape[-1]
    x = windows.view(-1, Hp // wh, Wp // ww, wh, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, Hp, Wp, C)


def effective_shift(padded_hw: Tuple[int, int], window: Tuple[int, int],
                    shift: Tuple[int, int]) -> Tuple[int, int]:
    """Per-axis cyclic shift actually applied: zero along an axis with a single window."""
    return tuple(0 if extent <= w else s
                 for extent, w, s in zip(padded_hw, window, shift))  # type: ignore[return-value]


def _region_labels(extent: int, window: int, shift: int) -> torch.Tensor:
    """Swin's region id of every position of a shifted (rolled) axis."""
    labels = torch.zeros(extent, dtype=torch.long)
    if shift > 0:
        labels[extent - window:extent - shift] = 1
        labels[extent - shift:] = 2
    return labels


@functools.lru_cache(maxsize=64)
def _shifted_window_mask(Hp: int, Wp: int, wh: int, ww: int, sy: int, sx: int,
                         device: torch.device) -> torch.Tensor:
    ly = _region_labels(Hp, wh, sy)
    lx = _region_labels(Wp, ww, sx)
    labels = (ly[:, None] * 3 + lx[None, :]).to(torch.float32)  # (Hp, Wp) region ids
    win = window_partition(labels[None, :, :, None], (wh, ww)).squeeze(-1)  # (nW, n)
    mask = (win[:, :, None] != win[:, None, :]).to(torch.float32) * MASK_VALUE
    return mask.to(device)


def shifted_window_mask(padded_hw: Tuple[int, int], window: Tuple[int, int],
                        shift: Tuple[int, int],
                        device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """Additive attention mask of cyclically shifted windows.

    After rolling the padded map by ``-shift``, the windows at the bottom/right edges
    contain tokens from opposite borders of the map; those pairs get ``MASK_VALUE``.
    The result is cached per ``(padded size, window, shift, device)`` (except while
    ``torch.export`` or the ONNX exporter traces); do not modify it in place.

    Args:
        padded_hw: ``(Hp, Wp)``, multiples of the window.
        window: ``(wh, ww)``.
        shift: ``(sy, sx)`` as returned by ``effective_shift``.
        device: device of the mask (default CPU).

    Returns:
        ``(nW, wh * ww, wh * ww)`` float32 mask with values ``0`` / ``MASK_VALUE`` in
        ``window_partition`` order, or ``None`` when nothing is shifted.
    """
    sy, sx = shift
    if sy == 0 and sx == 0:
        return None
    device = torch.device('cpu') if device is None else torch.device(device)
    # not cached while torch.export / the ONNX exporter traces: the mask would be a fake
    # tensor of the trace, and later eager calls (or exports) of the same size got it
    make = _shifted_window_mask.__wrapped__ if _exporting() else _shifted_window_mask
    return make(int(padded_hw[0]), int(padded_hw[1]), int(window[0]), int(window[1]),
                int(sy), int(sx), device)



def clear_mask_cache() -> None:
    """Drop every cached shifted-window mask (e.g. to free device memory)."""
    _shifted_window_mask.cache_clear()


def mask_cache_info():
    """``functools`` cache statistics of the shifted-window masks."""
    return _shifted_window_mask.cache_info()
