"""Paths ``gathers`` and ``triton_gathers``: a finer level as two batched gathers.

With ``q`` the 4 child queries of each parent (scaled by ``1/sqrt(d)``) and ``idx`` the
``4 Kp`` children of the parent's selected cells:
``scores = gathered_scores(q, k, idx)``; ``attn = softmax(scores)`` (B) or, per selected
cell, ``softmax`` over its 4 children times the cell's coarser weight (A);
``topk(attn)`` passed on (A: those weights zeroed at a non-final level);
``msg = gathered_messages(attn, v, idx)``.

Saved for the backward: ``gathers`` (PyTorch, ``quadtree_gather``) keeps ``q``, ``k``,
``idx`` for the scores and ``attn``, ``v``, ``idx`` for the messages, re-gathering the rows
in chunks of parents (nothing gathered is kept), plus the softmax output. ``triton_gathers``
runs the same two operations as Triton kernels, which take the parents' cells (int32)
instead of the candidate list and scatter the key / value gradients atomically.
"""
from typing import Tuple

import torch

from .quadtree_gather import gathered_messages, gathered_scores
from .quadtree_layout import child_candidates, children_to_raster, level_queries
from .quadtree_level import Level, LevelOutput


def level_operands(lv: Level, kernels: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(q, prev_idx, index, iw)``: the grouped scaled queries, the parents' cells (int32
    for the kernels: the ops save them, half the bytes of int64; the levels below inherit
    the dtype), and what the gathers take -- the cells and the parent grid's width
    ``iw`` (the kernels derive the ``4 Kp`` children), or the candidate list and 0."""
    q = lv.queries if lv.queries is not None else level_queries(
        lv.query, lv.num_heads, lv.temp)  # (B, h, L, 4, d)
    prev_idx = lv.prev_idx
    if kernels and prev_idx.dtype != torch.int32:
        prev_idx = prev_idx.int()
    pw = lv.hw[1] // 2
    if kernels:
        return q, prev_idx, prev_idx, pw
    return q, prev_idx, child_candidates(prev_idx, pw), 0


def candidates(index: torch.Tensor, iw: int) -> torch.Tensor:
    """``(B, h, L, 4Kp)`` candidate keys of the level, for the top-k's gather (``index``
    holds them already unless it holds parent cells, ``iw > 0``)."""
    return child_candidates(index, iw) if iw else index


def finer_level(lv: Level) -> LevelOutput:
    """The level by the gathers (``lv.use_triton``: ``False`` for the PyTorch ones, else
    what the gathered kernels are asked with)."""
    kernels = lv.use_triton is not False
    q, prev_idx, index, iw = level_operands(lv, kernels)
    scores = gathered_scores(q, lv.key, index, lv.chunk_elements, lv.use_triton, iw)
    if lv.attn_type == 'B':
        attn = torch.softmax(scores, dim=-1)
    else:
        Kp = prev_idx.shape[-1]
        attn = torch.softmax(scores.unflatten(-1, (Kp, 4)), dim=-1)
        attn = (attn * lv.prev_score[:, :, :, None, :, None]).flatten(-2)
    weights = attn
    next_idx = next_score = None
    if not lv.final:
        if lv.record_margin is not None:
            lv.record_margin(attn, lv.topk)
        # (B: the indices only, selected on the detached weights, as at the coarsest level)
        score_i, sel = (attn.detach() if lv.attn_type == 'B' else attn).topk(
            lv.topk, dim=-1, sorted=False)  # (B, h, L, 4, Ki)
        idx_i = candidates(index, iw).unsqueeze(3).expand_as(attn).gather(-1, sel)
        next_idx = children_to_raster(idx_i, lv.hw)
        # (the finer levels of B do not use the scores of their parents)
        if lv.attn_type == 'A':
            next_score = children_to_raster(score_i, lv.hw)
            weights = attn.scatter(-1, sel, 0.)
    msg = gathered_messages(weights, lv.value, index, lv.chunk_elements, lv.use_triton, iw)
    return LevelOutput(children_to_raster(msg, lv.hw), next_idx, next_score)
