"""Path ``rows``: a finer level without autograd in plain PyTorch, in chunks of parent rows.

For the parents of a chunk (the 4 child queries ``q`` of each, scaled by ``1/sqrt(d)``)
and their ``4 Kp`` candidate keys (the children of the ``Kp`` cells the parent selected):
``scores = q k_cand^T``; ``attn = softmax(scores)`` over the candidates (B) or within each
cell's 4 children times the cell's coarser weight (A); ``topk`` of ``attn`` passed on; A
zeroes the selected weights of a non-final level; ``msg = attn v_cand`` (a weighted
``embedding_bag``, no gathered value rows), written into raster-order outputs. Saves
nothing (inference only); peak memory is the level's messages plus one chunk.
"""
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .capture import graph_capture
from .quadtree_layout import child_candidates, flat_rows, group_children
from .quadtree_level import Level, LevelOutput, lepe_buffer

#: a finer level whose gathered ``(parents, 4K, d)`` key rows plus ``(parents, 4, 4K)``
#: scores fit in this many elements (16 MiB) runs as one chunk (fastest: each chunk costs
#: ~15 small ops); larger levels run in chunks of ``_LEVEL_CHUNK_ELEMENTS`` (~2 MiB, whole
#: parent rows, at least one), which bounds the peak memory
_LEVEL_ONE_CHUNK_ELEMENTS = 1 << 22
_LEVEL_CHUNK_ELEMENTS = 1 << 19
#: the same bound for levels scored by one dense GEMM (4 MiB: e.g. the 28x28 level of a
#: 56x56 map in one piece, 0.8 ms faster than two chunks on 2 CPU threads)
_DENSE_ONE_CHUNK_ELEMENTS = 1 << 20
#: on accelerators kernel launches, not caches, set the cost of a chunk (~20 launches):
#: levels run in chunks of up to 16 Mi elements (64 MiB): a few chunks per level at most
_DEVICE_LEVEL_CHUNK_ELEMENTS = 1 << 24


def _to_raster_rows(x: torch.Tensor, rows: int, parent_width: int) -> torch.Tensor:
    """``(B, h, rows * pw, 4, X)`` grouped by parent -> ``(B, h, rows, 2, pw, 2, X)``, the
    layout of ``rows`` parent rows inside a raster ``(B, h, 2H', 2W', X)`` view."""
    B, h = x.shape[:2]
    X = x.shape[-1]
    return x.reshape(B, h, rows, parent_width, 2, 2, X).transpose(3, 4)


def finer_level_rows(q_map: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     prev_idx: torch.Tensor, prev_score: Optional[torch.Tensor], h: int,
                     temp: float, attn_type: str, topk: Optional[int],
                     init: Optional[torch.Tensor] = None,
                     record_margin: Optional[Callable[[torch.Tensor, int], None]] = None
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One finer level without autograd, processed in chunks of parent rows (scores,
    softmax, top-k and messages of a chunk, written straight into raster-order outputs).

    Same result as the ``gathers`` path (``quadtree_batched``); the peak memory of a
    level is its message map plus one chunk instead of several ``(N, 4K)`` tensors.
    Scores come from gathered key rows (``4K x d`` floats per parent) or, on levels with
    few keys (``4 M <= 4K d``: fewer floats per parent), from one dense GEMM of the child
    queries with all ``M`` keys followed by a gather of the candidate columns (a regular
    matrix product instead of many tiny ones; same numbers up to rounding).

    Args: as ``quadtree_tiles.finer_level_tiles``; ``init`` (contiguous, e.g. the LePE
    map) is the buffer the messages are added to; ``record_margin(weights, topk)`` is
    called for each chunk's top-k.

    Returns:
        messages ``(B, h, hi*wi, d)`` in raster order, and the next level's ``prev_idx``
        / ``prev_score`` ``(B, h, hi*wi, topk)`` (``None`` for the final level; the
        scores only for variant A, which uses them).
    """
    B, C, hi, wi = q_map.shape
    d = C // h
    pw = wi // 2  # parents per row
    M = hi * wi
    Kp = prev_idx.shape[-1]
    K = 4 * Kp
    dense = 4 * M <= K * d
    if dense:
        k_mat = k.reshape(B * h, M, d)
    else:
        k_table = k.reshape(B * h * M, d).contiguous()
    v_table = v.reshape(B * h * M, d).contiguous()
    msg = q_map.new_empty(B, h, M, d) if init is None else init
    msg_rows = msg.view(B, h, hi // 2, 2, pw, 2, d)
    next_idx = next_score = None
    if topk is not None:
        next_idx = prev_idx.new_empty(B, h, M, topk)
        idx_rows = next_idx.view(B, h, hi // 2, 2, pw, 2, topk)
        if attn_type == 'A':
            next_score = q_map.new_empty(B, h, M, topk)
            score_rows = next_score.view(B, h, hi // 2, 2, pw, 2, topk)
    per_row = B * h * pw * (4 * M if dense else K * d) + B * h * pw * 4 * K
    # the dense (4P, M) score block is one GEMM whatever its size: a whole level runs as
    # one chunk only up to _DENSE_ONE_CHUNK_ELEMENTS (it would otherwise dominate the peak
    # memory of the whole operator), else in chunks of the small budget
    if q_map.device.type == 'cpu':
        one_chunk = _DENSE_ONE_CHUNK_ELEMENTS if dense else _LEVEL_ONE_CHUNK_ELEMENTS
        chunk_elements = _LEVEL_CHUNK_ELEMENTS
    else:
        one_chunk = chunk_elements = _DEVICE_LEVEL_CHUNK_ELEMENTS
    rows_per_chunk = hi // 2 if graph_capture() or per_row * (hi // 2) <= one_chunk else \
        max(1, chunk_elements // per_row)
    for r0 in range(0, hi // 2, rows_per_chunk):
        r1 = min(hi // 2, r0 + rows_per_chunk)
        s, e = r0 * pw, r1 * pw
        q = group_children(q_map[:, :, 2 * r0:2 * r1], h).mul_(temp)  # (B, h, P, 4, d)
        cand = child_candidates(prev_idx[:, :, s:e], pw)  # (B, h, P, 4Kp)
        rows = flat_rows(cand, M)
        if dense:  # (B h, 4P, M) = one GEMM per batch/head, then the candidate columns
            full = torch.bmm(q.reshape(B * h, (e - s) * 4, d), k_mat.transpose(1, 2))
            # the 4 children share their parent's candidates: a stride-0 index, no copy
            scores = full.view(B, h, e - s, 4, M).gather(
                -1, cand.unsqueeze(3).expand(B, h, e - s, 4, K))
            del full
        else:
            g = k_table.index_select(0, rows).view(B * h * (e - s), K, d)
            scores = torch.bmm(q.reshape(B * h * (e - s), 4, d), g.transpose(1, 2))
            del g
        scores = scores.view(B, h, e - s, 4, K)
        if attn_type == 'B':
            attn = scores.softmax(dim=-1)
        else:
            attn = scores.view(B, h, e - s, 4, Kp, 4).softmax(dim=-1)
            attn = attn.mul_(prev_score[:, :, s:e, None, :, None]).view(B, h, e - s, 4, K)
        del scores
        weights = attn
        if topk is not None:
            if record_margin is not None:
                record_margin(attn, topk)
            score_c, sel = attn.topk(topk, dim=-1, sorted=False)  # (B, h, P, 4, topk)
            idx_c = cand.unsqueeze(3).expand_as(attn).gather(-1, sel)
            idx_rows[:, :, r0:r1] = _to_raster_rows(idx_c, r1 - r0, pw)
            if next_score is not None:
                score_rows[:, :, r0:r1] = _to_raster_rows(score_c, r1 - r0, pw)
            if attn_type == 'A':
                weights = attn.scatter_(-1, sel, 0.)
        bags = rows.view(B * h * (e - s), 1, K).expand(B * h * (e - s), 4, K).reshape(-1, K)
        out = F.embedding_bag(bags, v_table, mode='sum',
                              per_sample_weights=weights.reshape(-1, K))
        out = _to_raster_rows(out.view(B, h, e - s, 4, d), r1 - r0, pw)
        if init is None:
            msg_rows[:, :, r0:r1] = out
        else:
            msg_rows[:, :, r0:r1] += out
    return msg, next_idx, next_score


def finer_level(lv: Level) -> LevelOutput:
    """The level in chunks of parent rows (B: summed into its LePE map)."""
    init = lepe_buffer(lv)
    msg, next_idx, next_score = finer_level_rows(
        lv.query.float(), lv.key, lv.value, lv.prev_idx, lv.prev_score, lv.num_heads,
        lv.temp, lv.attn_type, lv.topk, init, lv.record_margin)
    return LevelOutput(msg, next_idx, next_score, lepe_added=init is not None)
