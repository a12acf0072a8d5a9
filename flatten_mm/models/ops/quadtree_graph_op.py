"""Path ``graph_op``: a QuadTree finer level as one graph operator, for runtimes with it.

Formula: that of ``quadtree_tiles`` (scores with the selected cells' 2x2 key tiles,
softmax -- A: per tile, times the coarser weight --, top-k passed on, messages), as one
node; inference only, saves nothing.

``flatten_mm_graph::quadtree_level`` is a PyTorch custom operator whose exported form is
one node of a runtime's own kernel: ``flatten_mm::QuadTreeLevel`` in ONNX Runtime, with the
custom operator library of ``flatten_mm.deploy.ort_ops`` (the export maps it there). The
runtime's kernel reads each parent's candidate keys and values in place, where the
standard-operator form (``quadtree_tiles``) writes the gathered ``(N, 4K, d)`` tiles out
first.

The layer takes this form only while a graph is captured inside
``capture.runtime_custom_ops()`` (``export_onnx(..., custom_ops=True)``); its eager
implementation is the tile form, so the operator is the same maths with or without a
runtime, and its fake implementation gives torch.export the output shapes.
"""
from typing import Optional, Tuple

import torch

from .quadtree_layout import to_heads
from .quadtree_level import Level, LevelOutput, run_raw_level
from .quadtree_tiles import finer_level_tiles


@torch.library.custom_op('flatten_mm_graph::quadtree_level', mutates_args=())
def quadtree_level(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prev_idx: torch.Tensor,
                   prev_score: torch.Tensor, init: torch.Tensor, width: int, scale: float,
                   topk: int, type_a: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One finer level (the runtime kernel's contract).

    Args:
        q, k, v: ``(BH, M, d)`` float32 in raster order of an ``(M / width, width)`` level
            with even sides (``q`` not scaled).
        prev_idx: ``(BH, M / 4, Kp)`` int64 cells of the coarser grid each parent selected.
        prev_score: variant A: ``(BH, M / 4, Kp)`` weights of those cells (B: ignored).
        init: ``(BH, M, d)`` map the messages are added to, or empty (zeros).
        width: the level's width; scale: the score scale; topk: candidates each query
            passes on (0 at the final level); type_a: variant A.

    Returns:
        ``msg (BH, M, d)``, ``next_idx (BH, M, topk)`` int64 raster rows of this level and
        ``next_score (BH, M, topk if type_a else 0)``.
    """
    BH, M, d = q.shape
    q_map = q.view(BH, M // width, width, d).permute(0, 3, 1, 2)  # h = 1 per "batch" row
    msg, idx, score = finer_level_tiles(
        q_map, k.unsqueeze(1), v.unsqueeze(1), prev_idx.unsqueeze(1),
        prev_score.unsqueeze(1) if type_a else None, 1, scale, 'A' if type_a else 'B',
        topk or None, init.view(BH, 1, M, d).clone() if init.numel() else None)
    idx = prev_idx.new_empty(BH, M, 0) if idx is None else idx.view(BH, M, topk)
    score = q.new_empty(BH, M, 0) if score is None else score.view(BH, M, topk)
    return msg.view(BH, M, d), idx, score


@quadtree_level.register_fake
def _(q, k, v, prev_idx, prev_score, init, width, scale, topk, type_a):
    BH, M, d = q.shape
    return (q.new_empty(BH, M, d), prev_idx.new_empty(BH, M, topk),
            q.new_empty(BH, M, topk if type_a else 0))


def finer_level_graph_op(q_map: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         prev_idx: torch.Tensor, prev_score: Optional[torch.Tensor], h: int,
                         temp: float, attn_type: str, topk: Optional[int],
                         init: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``quadtree_tiles.finer_level_tiles`` (same arguments and results) as one
    ``quadtree_level`` operator."""
    B, C, hi, wi = q_map.shape
    d, M, Kp = C // h, hi * wi, prev_idx.shape[-1]
    BH = B * h
    type_a = attn_type == 'A'
    empty = q_map.new_zeros(0)
    msg, idx, score = quadtree_level(
        to_heads(q_map, h).reshape(BH, M, d), k.reshape(BH, M, d), v.reshape(BH, M, d),
        prev_idx.reshape(BH, M // 4, Kp), prev_score.reshape(BH, M // 4, Kp) if type_a else empty,
        empty if init is None else init.reshape(BH, M, d), wi, float(temp), topk or 0, type_a)
    if topk is None:
        return msg.view(B, h, M, d), None, None
    return (msg.view(B, h, M, d), idx.view(B, h, M, topk),
            score.view(B, h, M, topk) if type_a else None)


def finer_level(lv: Level) -> LevelOutput:
    """The level as one ``quadtree_level`` node (B: its LePE map is the node's ``init``)."""
    return run_raw_level(finer_level_graph_op, lv)
