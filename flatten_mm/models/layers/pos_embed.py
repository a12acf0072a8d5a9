"""Learned positional tables that follow the input size.

The official FLatten / PVT code stores positional tables with the token count of the
pretraining resolution (e.g. 56x56 for stage 1 at 224). Dense prediction needs them at
the actual grid, so they are resized at run time; at the stored grid the table is used
as is (an exact identity, no interpolation round-off).
"""
import math
from typing import Tuple

import torch
import torch.nn.functional as F


def grid_of(num_tokens: int) -> Tuple[int, int]:
    """Square grid ``(S, S)`` of a stored table with ``S * S`` tokens."""
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
        raise ValueError(f'positional table with {num_tokens} tokens is not a square grid')
    return side, side


def resize_pos_table(table: torch.Tensor, src_hw: Tuple[int, int],
                     dst_hw: Tuple[int, int], mode: str = 'bilinear') -> torch.Tensor:
    """Resize a ``(1, Hs*Ws, C)`` token table to ``(1, Hd*Wd, C)``.

    Args:
        table: the stored table, tokens row-major on the ``src_hw`` grid.
        src_hw: ``(Hs, Ws)`` grid of ``table``.
        dst_hw: ``(Hd, Wd)`` grid wanted.
        mode: ``'bilinear'`` or ``'bicubic'`` (``align_corners=False``).

    Returns:
        The table itself when the grids agree, otherwise the resized table.
    """
    if tuple(src_hw) == tuple(dst_hw):
        return table
    C = table.shape[-1]
    grid = table.reshape(1, src_hw[0], src_hw[1], C).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=tuple(dst_hw), mode=mode,
                         align_corners=False).to(table.dtype)
    return grid.flatten(2).transpose(1, 2)
