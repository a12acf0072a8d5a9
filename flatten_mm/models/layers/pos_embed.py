"""Learned positional tables that follow the input size.

The official FLatten / PVT code stores positional tables with the token count of the
pretraining resolution (e.g. 56x56 for stage 1 at 224). Dense prediction needs them at
the actual grid, so they are resized at run time; at the stored grid the table is used
as is (an exact identity, no interpolation round-off).

No caching of parameter-derived tensors. The resized tables (and Swin's relative
position bias, ``window_attention``) are recomputed from the parameter in every forward,
so they can never be stale. An earlier per-shape cache decided freshness from the
parameter's ``data_ptr`` and ``_version``, which writes through ``.data`` do not change
(``p.data.copy_(q)`` in EMA hooks, ``p.data = q``, some ``load_state_dict`` paths); no
hook sees the first of those either, so a cache keyed on anything but the values could
serve old weights (``tests/test_backbones/test_weight_swaps.py``). Recomputing costs
little (``docs/benchmarks/README.md``, "Positional tables"; CPU, 1 thread, batch 1,
eval): all table work of a forward -- what a perfect cache could save -- is 0 % (224²,
identities) to 0.44 % (1024²) of a FLatten-PVT-T / FLatten-PVTv2-b0 forward, 0.30-0.51 %
of FLatten-Swin-T (bias + mask) and at most 0.20 % of FLatten-CSwin-T.
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
    # while torch.export traces, the grids are symbolic: comparing them would pin the
    # graph to the export size; resizing to the same grid is exact (bilinear / bicubic
    # at scale 1 sample the source points with weight 1), so always resize then
    if not _exporting() and tuple(src_hw) == tuple(dst_hw):
        return table
    C = table.shape[-1]
    grid = table.reshape(1, src_hw[0], src_hw[1], C).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=tuple(dst_hw), mode=mode,
                         align_corners=False).to(table.dtype)
    return grid.flatten(2).transpose(1, 2)


def _exporting() -> bool:
    """Whether a graph is being captured for export (torch.export, the ONNX exporters,
    ``torch.jit.trace``): sizes are then symbolic or recorded, so shape branches and
    per-shape caches must be avoided."""
    compiler = getattr(torch, 'compiler', None)
    is_exporting = getattr(compiler, 'is_exporting', None)
    return bool(torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
                or (is_exporting is not None and is_exporting()))


def _is_compiling() -> bool:
    compiler = getattr(torch, 'compiler', None)
    return bool(compiler is not None and compiler.is_compiling())


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
