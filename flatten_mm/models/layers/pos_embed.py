"""Learned positional tables that follow the input size.

The official FLatten / PVT code stores positional tables with the token count of the
pretraining resolution (e.g. 56x56 for stage 1 at 224). Dense prediction needs them at
the actual grid, so they are resized at run time; at the stored grid the table is used
as is (an exact identity, no interpolation round-off).
"""
import math
from typing import Optional, Tuple

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


def _is_compiling() -> bool:
    compiler = getattr(torch, 'compiler', None)
    return bool(compiler is not None and compiler.is_compiling())


class PosTableCache:
    """Per-shape cache of resized positional tables, for inference.

    ``resize_pos_table`` at a foreign grid interpolates the whole table in every block and
    every forward; at dense-prediction sizes that is a large share of the positional
    work. The cache keeps the last resized table per ``(grid, mode, device, dtype)`` and
    reuses it while the stored table is unchanged (same storage and version counter, so
    an optimizer step, ``load_state_dict`` or ``.to()`` invalidates it). It is bypassed
    whenever the result must be differentiable (grad mode with a trainable table) and
    under ``torch.compile`` (the resize is then traced like any other op). Not part of
    the state dict.

    Args:
        max_entries: shapes kept before the cache is emptied.
    """

    def __init__(self, max_entries: int = 8) -> None:
        self.max_entries = max_entries
        self._entries: dict = {}

    def __call__(self, table: torch.Tensor, src_hw: Tuple[int, int],
                 dst_hw: Tuple[int, int], mode: str = 'bilinear') -> torch.Tensor:
        """``resize_pos_table(table, src_hw, dst_hw, mode)``, cached when allowed."""
        if tuple(src_hw) == tuple(dst_hw):
            return table
        if (table.requires_grad and torch.is_grad_enabled()) or _is_compiling():
            return resize_pos_table(table, src_hw, dst_hw, mode)
        key = (tuple(dst_hw), mode, table.device, table.dtype)
        stamp = (table.data_ptr(), table._version, tuple(src_hw))
        hit = self._entries.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        out = resize_pos_table(table.detach(), src_hw, dst_hw, mode)
        self._entries[key] = (stamp, out)
        return out

    def clear(self) -> None:
        """Drop every cached table."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __deepcopy__(self, memo) -> 'PosTableCache':
        return PosTableCache(self.max_entries)

    def __getstate__(self) -> dict:
        return {'max_entries': self.max_entries, '_entries': {}}


def resize_loaded_pos_table(state_dict: dict, key: str, own: torch.Tensor,
                            dst_hw: Tuple[int, int], mode: str = 'bicubic'
                            ) -> Optional[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]:
    """Resize, in ``state_dict``, a square ``(1, S*S, C)`` table stored under ``key`` for
    another grid to the ``dst_hw`` grid of ``own`` (the module's parameter).

    Returns:
        ``(key, old shape, new shape)`` when the entry was resized, else ``None`` (absent,
        already the right size, another channel count or not a square grid).
    """
    table = state_dict.get(key)
    if table is None or table.dim() != 3 or table.shape[1] == own.shape[1] \
            or table.shape[-1] != own.shape[-1]:
        return None
    side = math.isqrt(table.shape[1])
    if side * side != table.shape[1]:
        return None
    new = resize_pos_table(table, (side, side), dst_hw, mode=mode)
    state_dict[key] = new
    return key, tuple(table.shape), tuple(new.shape)
