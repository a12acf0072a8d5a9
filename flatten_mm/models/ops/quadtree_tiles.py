"""Path ``tiles``: a QuadTree finer level as gathers of whole 2x2 tiles, the exported form.

Formula (inference only, saves nothing): for the 4 child queries ``q`` of each parent
(scaled by ``1/sqrt(d)``) and the 2x2 key / value tiles of its ``Kp`` selected cells,
``scores = q K_tiles^T``, ``attn = softmax(scores)`` (B) or per-tile softmax times the
cell's coarser weight (A), ``topk`` passed on (A: zeroed at a non-final level),
``msg = attn V_tiles`` -- as below.

The 4 child queries of a parent cell attend to the same ``4 Kp`` candidate keys: the
children of the ``Kp`` coarser cells their parent selected. Grouped by parent
(``raster_to_children``), the 4 children of a cell are one contiguous ``4 d`` row of
the key (value) table, so a level needs one row gather per selected cell:

* index: ``(B, h, P, Kp)`` selected cells, ``P = M / 4`` parents of the ``M`` level
  tokens, offset per batch and head (``flat_rows``) -- ``M Kp / 4`` entries per head, a
  quarter of a per-token candidate list and a sixteenth of per-(query, candidate) bags;
* keys:     ``tiles_k[index] -> (B h P, 4 Kp, d)``; scores ``q (B h P, 4, d) @ keys^T``;
* weights:  softmax over the ``4 Kp`` candidates (B), or within each cell's 4 children
  times the coarser level's score of the cell (A);
* top-k:    the ``topk`` best candidates of each query, as raster indices of this level
  (``selected_to_raster``: from the selected slots, so no candidate list is built);
* messages: ``weights (B h P, 4, 4 Kp) @ tiles_v[index] (B h P, 4 Kp, d)``.

Every op is a dense batched one (Gather on axis 0, MatMul, Softmax, TopK), which ONNX
Runtime runs at the speed of PyTorch; the chunked inference path's ``embedding_bag``
becomes a loop over bags in ONNX (``Loop`` + ``SequenceInsert``, 50-60x slower). Same
values as ``quadtree_rows.finer_level_rows`` up to float rounding and the order
of the selected keys. Memory: the gathered ``(B h P, 4 Kp, d)`` rows of a whole level at
once (no chunks: a traced graph would unroll the loop).
"""
from typing import Optional, Tuple

import torch

from .quadtree_layout import children_to_raster, flat_rows, group_children, raster_to_children
from .quadtree_level import Level, LevelOutput, run_raw_level


def selected_to_raster(cells: torch.Tensor, slots: torch.Tensor,
                       parent_width: int) -> torch.Tensor:
    """Raster indices at the finer level of the selected candidates.

    ``cells`` ``(N, Kp)``: each parent's selected cells, flat indices of the coarser grid
    of width ``parent_width``; ``slots`` ``(N, ...)``: candidates of that parent's queries
    in ``[0, 4 Kp)``, slot ``s`` being child ``s % 4`` (row-major in the 2x2 tile) of cell
    ``cells[n, s // 4]``. Returns indices shaped like ``slots``.

    Cell ``c`` has its top-left child at ``2 (c + (c // pw) pw)``, computed once per
    selected cell; a slot's cell and its child's offset (``(j // 2) 2 pw + j % 2``) come
    from two ``4 Kp``-entry tables, so the per-candidate work is three lookups and an add
    (integer division and modulo are slow element-wise ops in ONNX Runtime)."""
    N, Kp = cells.shape
    top_left = (cells + torch.div(cells, parent_width, rounding_mode='floor') * parent_width) * 2
    slot = torch.arange(4 * Kp, device=cells.device)
    slot_cell = torch.div(slot, 4, rounding_mode='floor')
    child = slot % 4
    slot_offset = torch.div(child, 2, rounding_mode='floor') * (2 * parent_width) + child % 2
    flat = slots.reshape(-1)
    # (index_select: a Gather in ONNX; tensor indexing would export as GatherND)
    out = top_left.gather(-1, slot_cell.index_select(0, flat).view(N, -1))
    return (out.view(-1) + slot_offset.index_select(0, flat)).view(slots.shape)


def finer_level_tiles(q_map: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      prev_idx: torch.Tensor, prev_score: Optional[torch.Tensor], h: int,
                      temp: float, attn_type: str, topk: Optional[int],
                      init: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One finer level without autograd (see the module docstring).

    Args:
        q_map: the level's queries ``(B, C, hi, wi)``.
        k, v: its keys and values in heads ``(B, h, hi*wi, d)``, raster order.
        prev_idx: ``(B, h, hi*wi/4, Kp)`` the cells each parent query selected, raster
            indices of the coarser grid.
        prev_score: A only, ``(B, h, hi*wi/4, Kp)`` their scores.
        h, temp: heads and the temperature applied to the queries.
        attn_type: ``'A'`` or ``'B'``.
        topk: keys each query passes on, ``None`` at the final level.
        init: optional ``(B, h, hi*wi, d)`` map the messages are added to (B's LePE).

    Returns:
        messages ``(B, h, hi*wi, d)`` in raster order, and the next level's ``prev_idx``
        / ``prev_score`` ``(B, h, hi*wi, topk)`` (``None`` at the final level; the scores
        only for variant A).
    """
    B, C, hi, wi = q_map.shape
    d = C // h
    hw = (hi, wi)
    P = (hi // 2) * (wi // 2)
    Kp = prev_idx.shape[-1]
    q = (group_children(q_map, h) * temp).reshape(B * h * P, 4, d)
    tiles_k = raster_to_children(k, hw).reshape(B * h * P, 4 * d)
    tiles_v = raster_to_children(v, hw).reshape(B * h * P, 4 * d)
    rows = flat_rows(prev_idx, P)  # (B h P Kp) rows of the tile tables
    keys = tiles_k.index_select(0, rows).view(B * h * P, 4 * Kp, d)
    scores = torch.bmm(q, keys.transpose(1, 2))  # (B h P, 4, 4 Kp)
    if attn_type == 'B':
        attn = scores.softmax(dim=-1)
    else:
        attn = scores.view(B * h * P, 4, Kp, 4).softmax(dim=-1)
        attn = (attn * prev_score.reshape(B * h * P, 1, Kp, 1)).view(B * h * P, 4, 4 * Kp)
    weights = attn
    next_idx = next_score = None
    if topk is not None:
        score_c, slots = attn.topk(topk, dim=-1, sorted=False)  # (B h P, 4, topk)
        idx_c = selected_to_raster(prev_idx.reshape(B * h * P, Kp), slots, wi // 2)
        next_idx = children_to_raster(idx_c.view(B, h, P, 4, topk), hw)
        if attn_type == 'A':
            next_score = children_to_raster(score_c.view(B, h, P, 4, topk), hw)
            weights = attn.scatter(-1, slots, 0.)
    values = tiles_v.index_select(0, rows).view(B * h * P, 4 * Kp, d)
    msg = children_to_raster(torch.bmm(weights, values).view(B, h, P, 4, d), hw)
    return (msg if init is None else msg + init), next_idx, next_score


def finer_level(lv: Level) -> LevelOutput:
    """The level in the tile form (B: plus its LePE map)."""
    return run_raw_level(finer_level_tiles, lv)
