"""Path ``triton_fused``: a finer level as one Triton kernel.

For the 4 child queries ``q`` of each parent and the ``4 Kp`` children of its selected
cells the kernel computes ``scores = q k_cand^T``, ``attn = softmax(scores)`` (B; times
the level weight ``w``) or the per-cell softmax times the cell's coarser weight (A), and
``msg = attn v_cand``, without writing any ``(B, h, L, 4, 4Kp)`` tensor. Saved for the
backward: its inputs (the queries, keys, values, the parents' cells, A: the coarser
weights, B: ``w``) and per-row softmax statistics; the backward recomputes the weights.
With ``Projections`` (the finest level when training) it keeps the block input and the
projection weights instead of the query and key (A: and value) maps, and recomputes them.
B applies ``w`` in the kernel and folds it into the LePE conv. A non-final level (B,
training) selects its top-k from scores computed without autograd.
"""
from typing import Optional

import torch

from . import dispatch
from .quadtree_batched import candidates, level_operands
from .quadtree_gather import gathered_scores
from .quadtree_layout import children_to_raster
from .quadtree_level import Level, LevelOutput
from .quadtree_paths import final_key, final_uses_kernel, kernels


def finer_level(lv: Level) -> Optional[LevelOutput]:
    """The fused level, or ``None`` when the dispatch keeps this configuration on PyTorch
    or the kernel raised in auto mode (the caller then takes ``triton_gathers``)."""
    q, prev_idx, index, iw = level_operands(lv, True)
    k, v, hw = lv.key, lv.value, lv.hw
    scale = lv.level_weight if lv.attn_type == 'B' else None
    extra = scale if lv.attn_type == 'B' else lv.prev_score
    if not final_uses_kernel(lv.use_triton, lv.attn_type, q, k, v, index, extra, iw,
                             not lv.inference):
        return None
    qt_triton = kernels()
    idx_i = None
    if not lv.final:
        # B: the top-k indices carry no gradient, so the weights they are selected from
        # are computed without autograd (nothing saved) and dropped
        with torch.no_grad():
            attn = torch.softmax(
                gathered_scores(q, k, index, lv.chunk_elements, lv.use_triton, iw), dim=-1)
        if lv.record_margin is not None:
            lv.record_margin(attn, lv.topk)
        sel = attn.topk(lv.topk, dim=-1, sorted=False).indices  # (B, h, L, 4, Ki)
        idx_i = candidates(index, iw).unsqueeze(3).expand_as(attn).gather(-1, sel)
        del attn, sel

    def fused_level():
        if lv.final and lv.projections is not None and not lv.inference:
            # (its backward recomputes the finest maps from the block input)
            return qt_triton.final_level_projected_triton(
                q, k, v, index, extra, iw, lv.projections, hw, lv.num_heads, lv.temp,
                lv.attn_type)
        if lv.attn_type == 'B':
            return qt_triton.final_level_b_triton(q, k, v, index, extra, iw)
        return qt_triton.final_level_a_triton(q, k, v, index, extra, iw)

    raw = dispatch.guarded('quadtree', final_key(lv.attn_type, q, k, v, index, extra, iw),
                           q.device, lv.use_triton is True, fused_level, lambda: None)
    if raw is None:
        return None
    msg = children_to_raster(raw, hw)
    weighted = lepe_added = False
    if lv.attn_type == 'B' and scale is not None:
        weighted = True
        if lv.lepe is not None:
            lepe = lv.lepe(scale)
            msg = msg.add_(lepe) if lv.inference else msg + lepe
            lepe_added = True
    next_idx = None if lv.final else children_to_raster(idx_i, hw)
    return LevelOutput(msg, next_idx, None, lepe_added=lepe_added, weighted=weighted)
