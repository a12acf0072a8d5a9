"""Path ``cpu_train``: a finer level with autograd by the compiled CPU kernels.

Forward: the formula of ``quadtree_rows`` (scores with the children of the selected
cells, softmax -- A: within each cell's children times its coarser weight --, top-k, A:
selected weights zeroed at a non-final level, messages) by the C++ kernel. Saved for the
backward (``quadtree_cpu.level``): the level's queries, keys, values, the parents' cells
(A: their weights) and the selected cells; the backward kernel rebuilds the scores and
weights from them -- none of the ``gathers`` path's ``(N, 4K)`` weights or candidate lists.
Differentiable in the queries, keys, values and (A) the coarser weights.
"""
from . import quadtree_cpu as cpu_kernels
from .quadtree_layout import to_heads
from .quadtree_level import Level, LevelOutput


def finer_level(lv: Level) -> LevelOutput:
    """The level by ``quadtree_cpu.level`` (call only when its kernel is built)."""
    B, C, hi, wi = lv.query.shape
    h = lv.num_heads
    BH, M, d = B * h, hi * wi, C // h
    Kp = lv.prev_idx.shape[-1]
    topk = lv.topk or 0
    prev_score = lv.prev_score.reshape(BH, M // 4, Kp) if lv.attn_type == 'A' else None
    msg, idx, score = cpu_kernels.level(
        to_heads(lv.query.float(), h).reshape(BH, M, d), lv.key.reshape(BH, M, d),
        lv.value.reshape(BH, M, d), lv.prev_idx.reshape(BH, M // 4, Kp), prev_score, wi,
        lv.temp, topk)
    if lv.final:
        return LevelOutput(msg.view(B, h, M, d), None, None)
    return LevelOutput(msg.view(B, h, M, d), idx.view(B, h, M, topk),
                       score.view(B, h, M, topk) if lv.attn_type == 'A' else None)
