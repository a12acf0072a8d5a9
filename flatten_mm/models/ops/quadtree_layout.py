"""The layouts of QuadTree attention's pyramid levels, shared by the PyTorch path
(``layers/quadtree_attention.py``) and the Triton kernels (``quadtree_triton``).

A level's map ``(B, C, H, W)`` is split into heads (head-major channels) as raster tokens
``(B, h, H*W, d)`` (``to_heads``) or grouped by parent cell of the coarser level,
``(B, h, (H/2)(W/2), 4, d)`` (``group_children``: the 4 children ordered ``(0,0), (0,1),
(1,0), (1,1)``). A selected coarse cell ``y * pw + x`` has the 4 children
``child_candidates`` lists at the next level.
"""
from typing import Tuple

import torch


def flat_rows(index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Row numbers into a ``(B*h*M, d)`` table for a per-(batch, head) ``index (B, h, ...)``."""
    B, h = index.shape[:2]
    offset = torch.arange(B * h, device=index.device, dtype=index.dtype).view(
        B, h, *([1] * (index.dim() - 2))) * num_rows
    return (index + offset).reshape(-1)


def to_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Map ``(B, C, H, W)`` -> ``(B, h, H*W, d)`` (head-major channels, raster tokens).

    Each ``d``-row is contiguous in memory (a view for channels-last maps, whose memory
    is the token layout; one copy for contiguous NCHW maps)."""
    B, C, H, W = x.shape
    if torch.compiler.is_compiling():
        # (a compiled graph fixes at trace time which reshapes are views, from the layouts
        # it predicts; a CPU convolution's output can come in another one at run time, so
        # the map gets a known layout)
        x = x.clone(memory_format=torch.channels_last)
    return x.permute(0, 2, 3, 1).reshape(B, H * W, num_heads, C // num_heads).transpose(1, 2)


def group_children(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Map ``(B, C, H, W)`` -> ``(B, h, (H/2)(W/2), 4, d)``: parents in raster order of the
    coarser grid, children ordered ``(t1, t2) = (0,0), (0,1), (1,0), (1,1)``."""
    B, C, H, W = x.shape
    x = x.permute(0, 2, 3, 1).reshape(B, H // 2, 2, W // 2, 2, num_heads, C // num_heads)
    return x.permute(0, 5, 1, 3, 2, 4, 6).reshape(B, num_heads, (H // 2) * (W // 2), 4,
                                                  C // num_heads)


def level_queries(q_map: torch.Tensor, num_heads: int, temp: float) -> torch.Tensor:
    """A finer level's queries as its kernels / gathers take them: float32, grouped by
    parent (``group_children``), times the temperature."""
    return group_children(q_map.float(), num_heads) * temp


def children_to_raster(x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    """``(B, h, L, 4, X)`` grouped by parent -> ``(B, h, H*W, X)`` raster of the ``hw`` grid."""
    B, h, _, _, X = x.shape
    H, W = hw
    x = x.reshape(B, h, H // 2, W // 2, 2, 2, X).transpose(3, 4)
    return x.reshape(B, h, H * W, X)


def raster_to_children(x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    """``(B, h, H*W, X)`` raster of the ``hw`` grid -> ``(B, h, L, 4, X)`` grouped by parent
    (the inverse of ``children_to_raster``)."""
    B, h, _, X = x.shape
    H, W = hw
    x = x.reshape(B, h, H // 2, 2, W // 2, 2, X).transpose(3, 4)
    return x.reshape(B, h, (H // 2) * (W // 2), 4, X)


def upsample_tokens(x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    """Nearest 2x upsampling of raster tokens ``(B, h, H*W, X)`` -> ``(B, h, 4HW, X)``."""
    B, h, _, X = x.shape
    H, W = hw
    x = x.reshape(B, h, H, 1, W, 1, X).expand(B, h, H, 2, W, 2, X)
    return x.reshape(B, h, 4 * H * W, X)


def child_candidates(index: torch.Tensor, parent_width: int) -> torch.Tensor:
    """Flat parent-level key indices ``(..., Kp)`` -> their 4 children at the next level,
    ``(..., 4 Kp)`` ordered parent-major, child ``(a, b)`` with the row offset outer."""
    width = 2 * parent_width
    # index = y * pw + x  ->  top-left child 2y * 2pw + 2x = 2 * (index + y * pw)
    y = torch.div(index, parent_width, rounding_mode='floor')
    base = (index + y * parent_width) * 2
    # offsets (0, 1, width, width + 1) made on the device: a tensor from Python data
    # (torch.tensor([...], device=cuda)) is a synchronous host-to-device copy, which
    # would stall the host until the GPU has drained its queue, at every level
    t = torch.arange(2, device=index.device, dtype=index.dtype)
    offsets = (t.unsqueeze(-1) * width + t).flatten()
    return (base.unsqueeze(-1) + offsets).flatten(-2)
