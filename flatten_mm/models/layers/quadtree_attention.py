"""QuadTree attention (variants A and B), pure PyTorch.

Paper: Tang et al., "QuadTree Attention for Vision Transformers", ICLR 2022,
https://arxiv.org/abs/2201.02767.
Upstream: https://github.com/Tangshitao/QuadTreeAttention @ 549a1ef (Apache-2.0); this is
an independent re-implementation of ``QuadtreeAttention`` with ``QTAttA`` / ``QTAttB`` and
of the two CUDA kernels (``score_computation``, ``value_aggregation``), following
``shared/spec/attention.md`` §3.

Per block, queries/keys/values form a pyramid of ``S = num_levels`` levels (2x2 average
pooling; variant B builds the value pyramid with learned ``value_branchs``). The coarsest
level is full softmax attention; every query of a finer level attends only to the 4
children of the ``topk`` keys its parent query selected one level up. Messages of all
levels are merged coarse-to-fine (A: sum, with the mass of the refined keys carried down;
B: learned level weights and a depth-wise-conv LePE per level).

Implementation notes:

* The attention core always runs in float32 (the official module casts with ``.float()``
  and its kernels are float32-only), also under fp16/bf16 autocast; the projections and
  value branches follow the ambient dtype/autocast, and the LePE convs run in float32.
* No ``N x N`` tensor is built: the coarsest level costs ``L^2`` for its ``L`` tokens,
  every finer level ``O(N * 4K)``. The 4 child queries of a parent share their ``4K``
  candidate keys, so keys and values are gathered once per parent, in chunks over the
  parents (``chunk_elements``), by a custom autograd function that re-gathers in the
  backward pass instead of saving the gathered rows. Peak memory is ``O(N * K)``.
* Maps whose height or width is not divisible by ``2**(num_levels - 1)`` are zero-padded
  at the bottom/right before the projections and the output is cropped back; the padded
  tokens take part as keys (as when a data pipeline pads the image). The official code
  instead requires inputs that are multiples of 32.
* The coarsest level must hold at least ``topk`` tokens whenever its top-k is used,
  otherwise ``ValueError`` names the minimum map size. The top-k is used with
  ``num_levels > 1``, and always by variant A, whose single-level stages (stage 4) follow
  the official quirk of dropping the ``topk`` selected keys from the message (they are
  "refined" at a next level that does not exist; verified against the official outputs).
  A single-level B stage does not use it (the official code computes and discards it,
  failing on maps with fewer than ``topk`` tokens); it is skipped here, so any size works.
* On CUDA the finer levels' gathered scores and messages (forward and backward) run as
  Triton kernels (``ops.quadtree_triton``: no gathered key/value rows in memory,
  the key/value gradients by atomic scatter-add), and the final level as one fused
  kernel (scores + softmax (A: x prev_score) + messages, no ``(N, 4K)`` tensors), when Triton
  imports; the kernels take the ``K`` selected parent cells and derive their ``4K``
  children (no candidate list for the final level, none kept for the backward);
  inference then takes the batched path with those kernels instead of the chunked
  gathers. When training, ``QuadTreeAttention`` hands the core its projections
  (``Projections``): the fused final level recomputes the finest query and key maps (A:
  and the value map) from the block input in its backward instead of keeping them.
  ``use_triton=False`` (operator argument, or
  ``use_triton=False`` of a backbone) or ``FLATTEN_MM_TRITON=0``
  (environment) selects the PyTorch path, which stays the reference and the CPU /
  float64 / export path.
* On CPU the finer levels run the compiled kernels of ``ops.quadtree_cpu`` when they are
  built (``FLATTEN_MM_CPU_KERNELS=0`` turns them off): inference in chunks of parent
  rows, and training through an autograd function whose backward rebuilds the weights
  from the level's queries, keys, values and selected cells (no ``(N, 4K)`` weights,
  candidate lists or gathered rows kept).
* While a graph is captured for another runtime (``torch.export`` / ONNX export,
  ``ops.capture``) the finer inference levels take the tile form of
  ``ops.quadtree_tiles``: one gather of whole 2x2 key / value tiles per selected cell and
  batched products, in one piece (no chunk loop to unroll, no ``embedding_bag``, which
  exports as a loop over bags); inside ``ops.capture.runtime_custom_ops()`` each level is
  one ``ops.quadtree_graph_op`` node instead, for a runtime with flatten_mm's operator.
"""
import dataclasses
import functools
import math
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..ops import dispatch
from ..ops import quadtree_cpu as cpu_kernels
from ..ops import specialisation as spec
from ..ops.autograd_paths import (autocast_operands, differentiate_reference, recorded_eagerly,
                                  records_backward_graph, register_reference)
from ..ops.capture import custom_ops_requested, graph_capture
from ..ops.quadtree_graph_op import finer_level_graph_op
from ..ops.layout import tokens_as_map
from ..ops.quadtree_layout import (child_candidates, children_to_raster, flat_rows,
                                   group_children, level_queries, to_heads, upsample_tokens)
from ..ops.quadtree_tiles import finer_level_tiles

#: a callback ``(level, min_relative_margin)`` receiving top-k margins (debugging/parity)
MarginRecorder = Callable[[int, float], None]

#: default bound on the elements of one chunk of gathered key/value rows
DEFAULT_CHUNK_ELEMENTS = 1 << 25
#: key / value dtypes the Triton kernels read as they are (an exact upcast in registers)
_HALF = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- kernels
class _GatheredMatmul(torch.autograd.Function):
    """``a @ G^T`` (scores) or ``a @ G`` (messages) with ``G = src[index]`` per parent.

    ``a``: ``(B, h, L, F, X)``; ``src``: ``(B, h, M, d)``; ``index``: ``(B, h, L, K)`` long.
    ``G[b, j, l] = src[b, j, index[b, j, l]]`` is ``(K, d)``. With ``transpose_src`` the
    result is ``(B, h, L, F, K)`` (``X = d``), else ``(B, h, L, F, d)`` (``X = K``).
    Gathers are done in chunks of parents in the forward and again in the backward
    pass (nothing gathered is saved); ``src`` receives its gradient by ``index_add_``.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                transpose_src: bool, chunk: int) -> torch.Tensor:
        B, h, L, nf, _ = a.shape
        M, d = src.shape[2], src.shape[3]
        K = index.shape[-1]
        table = src.reshape(B * h * M, d).contiguous()  # rows of d floats
        out = a.new_empty(B, h, L, nf, K if transpose_src else d)
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            rows = flat_rows(index[:, :, s:e], M)
            g = table.index_select(0, rows).view(B, h, e - s, K, d)
            out[:, :, s:e] = a[:, :, s:e] @ (g.transpose(-1, -2) if transpose_src else g)
        ctx.save_for_backward(a, src, index)
        ctx.transpose_src = transpose_src
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, src, index = ctx.saved_tensors
        t, chunk = ctx.transpose_src, ctx.chunk
        if records_backward_graph():  # (create_graph: the gathers by indexing)
            grads = differentiate_reference(
                lambda a, src: gathered_reference(a, src, index, 0, t), (a, src),
                ctx.needs_input_grad[:2], (grad, ))
            return (*grads, None, None, None)
        B, h, L = a.shape[:3]
        M, d = src.shape[2], src.shape[3]
        K = index.shape[-1]
        table = src.reshape(B * h * M, d).contiguous()  # rows of d floats
        need_a, need_src = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_a = torch.empty_like(a) if need_a else None
        grad_table = torch.zeros_like(table) if need_src else None
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            rows = flat_rows(index[:, :, s:e], M)
            g = table.index_select(0, rows).view(B, h, e - s, K, d)
            gc = grad[:, :, s:e]
            if need_a:
                grad_a[:, :, s:e] = gc @ (g if t else g.transpose(-1, -2))
            if need_src:
                ac = a[:, :, s:e]
                grad_g = gc.transpose(-1, -2) @ ac if t else ac.transpose(-1, -2) @ gc
                grad_table.index_add_(0, rows, grad_g.reshape(-1, d))
        grad_src = grad_table.view_as(src) if need_src else None
        return grad_a, grad_src, None, None, None


def gathered_reference(a: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                       parent_width: int, scores: bool) -> torch.Tensor:
    """``gathered_scores`` (``scores``) or ``gathered_messages`` op by op: the candidate
    rows gathered by indexing, as one ``(B, h, L, K, d)`` tensor (what a double backward
    differentiates; no memory bound)."""
    if parent_width:
        index = child_candidates(index, parent_width)
    B, h, L, K = index.shape
    M, d = src.shape[2:]
    rows = src.reshape(B * h * M, d)[flat_rows(index.long(), M)].view(B, h, L, K, d)
    rows = rows.to(a.dtype)
    return a @ rows.transpose(-1, -2) if scores else a @ rows


def final_level_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          index: torch.Tensor, extra: Optional[torch.Tensor],
                          parent_width: int, grouped: bool) -> torch.Tensor:
    """The fused final level op by op: scores, softmax (``grouped``, variant A: within each
    parent's 4 children, times ``extra``, the coarser level's scores), messages (variant
    B: times ``extra``, the level weight, if given)."""
    scores = gathered_reference(q, k, index, parent_width, True)
    if grouped:
        attn = torch.softmax(scores.unflatten(-1, (scores.shape[-1] // 4, 4)), dim=-1)
        attn = (attn * extra[:, :, :, None, :, None]).flatten(-2)
    else:
        attn = torch.softmax(scores, dim=-1)
    out = gathered_reference(attn, v, index, parent_width, False)
    return out if grouped or extra is None else out * extra


def _level_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     prev_idx: torch.Tensor, prev_score: Optional[torch.Tensor],
                     next_idx: torch.Tensor, width: int, temp: float):
    """``quadtree_cpu.level`` op by op for its selected ``next_idx`` (what a double
    backward differentiates): ``(msg, next_score)`` of one ``(BH, M, d)`` level in raster
    order, ``next_score`` ``None`` for variant B (``prev_score`` ``None``)."""
    BH, M, d = q.shape
    hw = (M // width, width)
    qg = group_children(q.transpose(1, 2).reshape(BH, d, *hw), 1) * temp  # (BH, 1, L, 4, d)
    cand = child_candidates(prev_idx.unsqueeze(1), width // 2)  # (BH, 1, L, 4Kp)
    scores = gathered_reference(qg, k.unsqueeze(1), cand, 0, True)
    if prev_score is not None:
        attn = torch.softmax(scores.unflatten(-1, (prev_idx.shape[-1], 4)), dim=-1)
        attn = (attn * prev_score.unsqueeze(1)[:, :, :, None, :, None]).flatten(-2)
    else:
        attn = torch.softmax(scores, dim=-1)
    weights, next_score = attn, None
    if next_idx.shape[-1] and prev_score is not None:
        # the selected candidates of each child query (their rows in next_idx)
        topk = next_idx.shape[-1]
        chosen = group_children(next_idx.transpose(1, 2).reshape(BH, topk, *hw), 1)
        hit = cand[:, :, :, None, :, None] == chosen.unsqueeze(-2)  # (.., 4, 4Kp, topk)
        next_score = children_to_raster((attn.unsqueeze(-1) * hit).sum(-2), hw).squeeze(1)
        weights = attn.masked_fill(hit.any(-1), 0.)
    msg = gathered_reference(weights, v.unsqueeze(1), cand, 0, False)
    return children_to_raster(msg, hw).squeeze(1), next_score


register_reference('qt_gathered_scores',
                   lambda a, src, index, pw: gathered_reference(a, src, index, pw, True))
register_reference('qt_gathered_messages',
                   lambda a, src, index, pw: gathered_reference(a, src, index, pw, False))
register_reference('qt_final_b', lambda q, k, v, index, scale, pw: final_level_reference(
    q, k, v, index, scale, pw, False))
register_reference('qt_final_a', lambda q, k, v, index, prev_score, pw: final_level_reference(
    q, k, v, index, prev_score, pw, True))
register_reference('quadtree_level', _level_reference)


def _kernels():
    """The Triton kernel module (imported only once ``ops.dispatch`` said it imports; a
    plain import, which ``torch.compile`` traces without a graph break)."""
    from ..ops import quadtree_triton  # late: imports triton, only after the dispatch said it imports
    return quadtree_triton


def _records_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _dt(t: Optional[torch.Tensor]) -> Optional[str]:
    return None if t is None else str(t.dtype).replace('torch.', '')


def _gathered_key(a: torch.Tensor, src: torch.Tensor, index: torch.Tensor, scores: bool,
                  parent_width: int, a_layout: Optional[tuple] = None) -> tuple:
    """The first-use key of a gathered-scores / -messages kernel call (``ops.dispatch``):
    the op, ``a``'s dtype, children per parent, candidates, head dim, index kind and the
    ``specialisation.layout`` of every input (``a_layout``: ``a``'s, given instead of
    ``a`` itself, which may then be any tensor of ``a``'s dtype and device)."""
    K = index.shape[-1] * (4 if parent_width else 1)
    return ('qt_scores' if scores else 'qt_messages', _dt(a), int(a.shape[3]), int(K),
            int(src.shape[-1]), parent_width > 0, a_layout or spec.layout(a),
            spec.layout(src), spec.layout(index), spec.size_class(parent_width))


def _use_qt_triton(use_triton: Optional[bool], a: torch.Tensor, src: torch.Tensor,
                   index: torch.Tensor, scores: bool, parent_width: int = 0) -> bool:
    """Whether ``gathered_scores`` / ``gathered_messages`` run the Triton kernel
    (``ops.dispatch``: the gates, the kernel's input check -- ``use_triton=True``:
    ``ValueError`` saying why not -- and in auto mode the first-use check)."""
    return dispatch.use_kernels(
        use_triton, 'quadtree', a,
        lambda: _kernels().check_inputs(a, src, index, scores, parent_width),
        lambda: _gathered_key(a, src, index, scores, parent_width), _records_grad(a, src))


def _final_key(attn_type: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               index: torch.Tensor, extra: Optional[torch.Tensor], parent_width: int) -> tuple:
    """The first-use key of a fused final-level kernel call (see ``_gathered_key``)."""
    K = index.shape[-1] * (4 if parent_width else 1)
    return (f'qt_final_{attn_type.lower()}', _dt(q), int(K), int(q.shape[-1]),
            parent_width > 0, spec.layout(q), spec.layout(k), spec.layout(v),
            spec.layout(index), spec.layout(extra), spec.size_class(parent_width))


def _use_final_kernel(use_triton: Optional[bool], attn_type: str, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                      extra: Optional[torch.Tensor], parent_width: int,
                      records_grad: bool) -> bool:
    """Whether a level runs the fused final-level kernel (as ``_use_qt_triton``)."""
    def why_not():
        qt = _kernels()
        problem = qt.final_b_problem if attn_type == 'B' else qt.final_a_problem
        return problem(q, k, v, index, extra, parent_width)

    return dispatch.use_kernels(
        use_triton, 'quadtree', q, why_not,
        lambda: _final_key(attn_type, q, k, v, index, extra, parent_width), records_grad)


def _level_uses_triton(use_triton: Optional[bool], k: torch.Tensor, num_candidates: int,
                       records_grad: bool) -> bool:
    """Whether a finer level (keys ``k`` ``(B, h, M, d)``, ``num_candidates`` per parent)
    may run the Triton kernels (the gates and the tile size; in auto mode inference then
    also asks ``_level_kernels_checked``)."""
    if not dispatch.wanted(use_triton, 'quadtree', k, records_grad):
        return False
    if use_triton:
        return True  # (gathered_scores raises if the kernels cannot take the level)
    return _kernels().tile_fits(num_candidates, k.shape[-1])


def _level_kernels_checked(run: '_CoreRun', i: int, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, index: torch.Tensor, iw: int,
                           final: bool) -> bool:
    """Auto mode, inference: whether the kernel configurations the level would run passed
    their first-use checks (run now if not yet): the fused final level, or the gathered
    scores and messages. If not, the level takes the chunked PyTorch path
    (``_level_in_chunks``) -- not the batched one, whose ``(B, h, L, 4, 4K)`` weights the
    kernels existed to avoid."""
    if final:
        extra = run.prev_score if run.attn_type == 'A' else (
            None if run.level_weights is None else run.level_weights[i])
        if _use_final_kernel(None, run.attn_type, q, k, v, index, extra, iw, False):
            return True
    if not _use_qt_triton(None, q, k, index, True, iw):
        return False
    # the messages' weights: a fresh float32 (B, h, L, 4, K) tensor, described, not made
    # (q stands in for it where only its dtype, device and children count are read)
    shape = (*q.shape[:4], index.shape[-1] * (4 if iw else 1))
    weights = spec.contiguous_layout(shape, torch.float32)
    return dispatch.use_kernels(
        None, 'quadtree', q,
        lambda: _kernels().check_inputs(q.new_empty(()).expand(shape), v, index, False, iw),
        lambda: _gathered_key(q, v, index, False, iw, a_layout=weights))


def _chunk_size(a: torch.Tensor, index: torch.Tensor, d: int, chunk_elements: int) -> int:
    B, h, L = a.shape[:3]
    per_parent = B * h * index.shape[-1] * max(d, a.shape[3])
    return max(1, min(L, chunk_elements // max(1, per_parent)))


def gathered_scores(query: torch.Tensor, key: torch.Tensor, index: torch.Tensor,
                    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                    use_triton: Optional[bool] = None, parent_width: int = 0) -> torch.Tensor:
    """Score kernel: ``out[b,j,l,f,k] = <query[b,j,l,f], key[b,j,index[b,j,l,k]]>``.

    The official ``score_computation`` with heads moved to dim 1 and the candidate list
    shared by the ``F`` (= 4) child queries of each parent.

    Args:
        query: ``(B, h, L, F, d)`` child queries grouped by parent.
        key: ``(B, h, M, d)`` keys of the level.
        index: ``(B, h, L, K)`` candidate key rows of each parent (int64 / int32), or with
            ``parent_width`` the ``(B, h, L, K / 4)`` cells of the coarser grid whose 4
            children each are the candidates (``child_candidates``' order).
        chunk_elements: bound on the gathered elements held at once (PyTorch path).
        use_triton: ``None`` (auto: the Triton kernel on CUDA), ``True`` (force) or
            ``False`` (the PyTorch path), see ``ops.dispatch``.
        parent_width: 0 (``index`` holds candidate rows), or the width of the coarser grid
            (the kernels derive the candidates; the PyTorch path expands them first).

    Returns:
        ``(B, h, L, F, K)``.
    """
    if _use_qt_triton(use_triton, query, key, index, True, parent_width):
        out = dispatch.guarded(
            'quadtree', _gathered_key(query, key, index, True, parent_width), query.device,
            use_triton is True, lambda: _kernels().gathered_scores_triton(
                query, key, index, parent_width), lambda: None)
        if out is not None:
            return out
    if parent_width:
        index = child_candidates(index, parent_width)
    if key.dtype != query.dtype:  # (half keys reach here only if the kernel refused them)
        key = key.to(query.dtype)
    chunk = _chunk_size(query, index, key.shape[-1], chunk_elements)
    if not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)):
        return _gathered_scores_inference(query, key, index, chunk)
    return _GatheredMatmul.apply(query, key, index, True, chunk)


#: above this many gathered key elements, the inference score path works in chunks of
#: about ``_CACHE_CHUNK_ELEMENTS`` (1 MiB of rows, L2-resident): at 1024x1024 inputs this
#: halves the time of the finest level on CPU; below it one gather is as fast
_CHUNK_ABOVE_ELEMENTS = 1 << 22
_CACHE_CHUNK_ELEMENTS = 1 << 18


def _gathered_scores_inference(query: torch.Tensor, key: torch.Tensor, index: torch.Tensor,
                               chunk: int) -> torch.Tensor:
    """``gathered_scores`` without autograd (no ``autograd.Function``; with a single chunk,
    no preallocated result either): gather the key rows of ``chunk`` parents, multiply.
    Large gathers are split into cache-sized chunks (see ``_CHUNK_ABOVE_ELEMENTS``)."""
    B, h, L, nf, d = query.shape
    M, K = key.shape[2], index.shape[-1]
    table = key.reshape(B * h * M, d).contiguous()
    per_parent = B * h * K * d
    if graph_capture():
        chunk = L
    elif query.device.type == 'cpu' and L * per_parent > _CHUNK_ABOVE_ELEMENTS:
        chunk = min(chunk, max(1, _CACHE_CHUNK_ELEMENTS // per_parent))

    def scores(s: int, e: int) -> torch.Tensor:
        g = table.index_select(0, flat_rows(index[:, :, s:e], M))
        # an explicit 3-d bmm: matmul on the 5-d views is ~1.5x slower on CPU
        q = query[:, :, s:e].reshape(B * h * (e - s), nf, d)
        out = torch.bmm(q, g.view(B * h * (e - s), K, d).transpose(1, 2))
        return out.view(B, h, e - s, nf, K)

    if chunk >= L:
        return scores(0, L)
    out = query.new_empty(B, h, L, nf, K)
    for s in range(0, L, chunk):
        out[:, :, s:s + chunk] = scores(s, min(L, s + chunk))
    return out


def gathered_messages(weight: torch.Tensor, value: torch.Tensor, index: torch.Tensor,
                      chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                      use_triton: Optional[bool] = None,
                      parent_width: int = 0) -> torch.Tensor:
    """Aggregation kernel: ``out[b,j,l,f] = sum_k weight[b,j,l,f,k] value[b,j,index[b,j,l,k]]``.

    The official ``value_aggregation`` for a candidate list shared by the ``F`` child
    queries of a parent (which is how both variants call it).

    Args:
        weight: ``(B, h, L, F, K)`` attention weights.
        value: ``(B, h, M, d)`` values of the level.
        index: ``(B, h, L, K)`` candidate rows (int64 / int32), or parent cells (see
            ``gathered_scores``).
        chunk_elements: bound on the gathered elements held at once (PyTorch path).
        use_triton: ``None`` (auto: the Triton kernel on CUDA), ``True`` or ``False``.
        parent_width: as in ``gathered_scores``.

    Returns:
        ``(B, h, L, F, d)``.
    """
    if _use_qt_triton(use_triton, weight, value, index, False, parent_width):
        out = dispatch.guarded(
            'quadtree', _gathered_key(weight, value, index, False, parent_width),
            weight.device, use_triton is True,
            lambda: _kernels().gathered_messages_triton(
                weight, value, index, parent_width), lambda: None)
        if out is not None:
            return out
    if parent_width:
        index = child_candidates(index, parent_width)
    if value.dtype != weight.dtype:  # (as in gathered_scores)
        value = value.to(weight.dtype)
    if not (torch.is_grad_enabled() and (weight.requires_grad or value.requires_grad)):
        return _weighted_rows_sum(weight, value, index)
    chunk = _chunk_size(weight, index, value.shape[-1], chunk_elements)
    return _GatheredMatmul.apply(weight, value, index, False, chunk)


def _weighted_rows_sum(weight: torch.Tensor, value: torch.Tensor,
                       index: torch.Tensor) -> torch.Tensor:
    """Inference path of ``gathered_messages``: a weighted ``embedding_bag`` per child query,
    so the gathered value rows are never materialised (only ``int64`` row lists, 4x
    smaller than the rows for ``d = 32``). Same result as the gather + matmul path."""
    B, h, L, nf, K = weight.shape
    M, d = value.shape[2], value.shape[3]
    table = value.reshape(B * h * M, d).contiguous()
    rows = flat_rows(index, M).view(B * h * L, 1, K).expand(B * h * L, nf, K)
    out = F.embedding_bag(rows.reshape(-1, K), table, mode='sum',
                          per_sample_weights=weight.reshape(-1, K).contiguous())
    return out.view(B, h, L, nf, d)


# --------------------------------------------------------------------------- layout helpers
class _AvgPool2x2(torch.autograd.Function):
    """``F.avg_pool2d(x, 2, 2)`` of an even-sided map whose backward needs only the shape:
    nothing is saved (the autograd node of ``avg_pool2d`` keeps its input alive, a whole
    query / key map per pyramid level). The gradient keeps the input's memory format."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        ctx.channels_last = not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last)
        return F.avg_pool2d(x, 2, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        B, C, H, W = ctx.shape
        fmt = torch.channels_last if ctx.channels_last else torch.contiguous_format
        dx = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device, memory_format=fmt)
        # every input of a 2x2 window gets a quarter of the window's gradient (a product
        # and a copy into the window view: torch.compile takes no strided ``out=``)
        dx.view(B, C, H // 2, 2, W // 2, 2).copy_((grad * 0.25)[:, :, :, None, :, None])
        return dx


def _avg_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """2x2 average pooling of an even-sided ``(B, C, H, W)`` map (a pyramid level); with
    autograd, by ``_AvgPool2x2`` (saves nothing)."""
    if x.shape[-2] % 2 == 0 and x.shape[-1] % 2 == 0 and recorded_eagerly(x):
        return _AvgPool2x2.apply(x)
    return F.avg_pool2d(x, 2, 2)


def _record_margin(recorder: Optional[MarginRecorder], level: int, probs: torch.Tensor,
                   k: int) -> None:
    """Report the smallest relative gap between the k-th and (k+1)-th largest weight."""
    if recorder is None or probs.shape[-1] <= k:
        return
    top = probs.detach().topk(k + 1, dim=-1).values
    margin = (top[..., k - 1] - top[..., k]) / top[..., k - 1].clamp_min(1e-30)
    recorder(level, float(margin.min()))


# --------------------------------------------------------------------------- core
class LePEConv:
    """A lazily evaluated LePE map of ``quadtree_attention_core``: the depth-wise 3x3 conv
    ``conv`` of the value map ``value``, in float32. Called with a level weight ``scale``,
    it folds the weight into the conv's weight and bias (``conv(value) * scale`` without a
    saved copy of ``conv(value)`` for the weight's gradient). With ``recompute``, a bf16 /
    fp16 ``value`` (autocast) is cast inside a checkpoint when autograd records the conv:
    the backward recasts it instead of keeping a float32 copy of the map."""

    def __init__(self, value: torch.Tensor, conv: nn.Conv2d, recompute: bool = True) -> None:
        self.value, self.conv, self.recompute = value, conv, recompute

    def _apply(self, value: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        w, b = self.conv.weight.float(), self.conv.bias
        b = b.float() if b is not None else None
        if scale is not None:
            w = w * scale
            b = b * scale if b is not None else None
        return F.conv2d(value.float(), w, b, padding=self.conv.padding, groups=self.conv.groups)

    def __call__(self, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        v = self.value
        if self.recompute and v.dtype != torch.float32 and recorded_eagerly(
                v, *self.conv.parameters(), *([scale] if scale is not None else [])):
            # (no random op: no RNG state to restore)
            return checkpoint(self._apply, v, scale, use_reentrant=False,
                              preserve_rng_state=False)
        return self._apply(v, scale)


class Projections(NamedTuple):
    """The finest level's maps as projections of one input ``x`` ``(B, N, C_in)``: the query
    map is ``tokens_as_map(F.linear(x, *query), hw)``, the key map likewise with ``key``
    and, if ``value`` is given, the value map with ``value`` (``(weight, bias)`` pairs,
    ``bias`` optional; ``x`` and the weights in the dtype the projections ran in).

    With autograd, the fused final level (Triton kernels) then keeps ``x`` and the weights
    for its backward, which recomputes the maps (one GEMM each), instead of keeping its
    float32 grouped queries and the key (and value) maps: ``x`` is kept anyway, by the
    projections themselves. Variant B's value map is kept by its value branch and LePE
    conv, so B passes ``value=None``."""
    x: torch.Tensor
    query: Tuple[torch.Tensor, Optional[torch.Tensor]]
    key: Tuple[torch.Tensor, Optional[torch.Tensor]]
    value: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None


def quadtree_attention_core(queries: Sequence[torch.Tensor],
                            keys: Sequence[torch.Tensor],
                            values: Sequence[torch.Tensor],
                            num_heads: int,
                            topks: Sequence[int],
                            attn_type: str = 'B',
                            level_weights: Optional[torch.Tensor] = None,
                            lepes: Optional[Sequence[torch.Tensor]] = None,
                            margin_recorder: Optional[MarginRecorder] = None,
                            chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                            use_triton: Optional[bool] = None,
                            projections: Optional[Projections] = None) -> torch.Tensor:
    """Multi-level QuadTree attention on given pyramids (float32 math).

    Level 0 is the coarsest; level ``i + 1`` has twice the height and width of level ``i``.

    Args:
        queries: per level, ``(B, C, h_i, w_i)`` maps.
        keys: per level, ``(B, C, h_i, w_i)``.
        values: per level, ``(B, C, h_i, w_i)``.
        num_heads: heads ``h`` (head-major channel split, ``d = C / h``).
        topks: ``topks[i]`` keys each query of level ``i`` passes on for refinement
            (needed for ``i < S - 1``; variant A also uses ``topks[0]`` when ``S == 1``).
        attn_type: ``'A'`` (score redistribution, masked messages, plain sum) or ``'B'``
            (all candidates attended at every level, weighted merge).
        level_weights: B only, ``(S,)`` weights of the level messages (the official
            ``softmax(py_att.weight)``); ``None`` means all ones.
        lepes: B only, optional per-level ``(B, C, h_i, w_i)`` maps added to the level
            messages before weighting (LePE), or zero-argument callables returning them
            (evaluated when the level is merged; ``LePEConv`` ones also take the level
            weight, folded into their conv, where the fused kernel applies the weight).
        margin_recorder: optional callback ``(level, margin)`` receiving, for every used
            top-k, the smallest ``(k-th - (k+1)-th) / k-th`` weight gap (parity checks).
        chunk_elements: bound on the gathered elements held at once.
        use_triton: Triton kernels for the finer levels' gathered scores and messages
            (and the fused final level): ``None`` auto (on CUDA), ``True`` force,
            ``False`` the PyTorch path (``FLATTEN_MM_TRITON=0`` turns them off everywhere).
        projections: optional, the finest level's query / key (/ value) maps as
            projections of one input (``Projections``; the caller's promise, not checked
            beyond shapes): a training forward's fused final level then recomputes them
            in its backward instead of keeping them (same values and gradients).

    Returns:
        ``(B, h, h_{S-1} * w_{S-1}, d)`` float32 messages in raster order of the finest level.

    The coarsest level is full softmax attention (``_coarsest_level``); each finer level
    runs one of four paths (``_finer_level`` decides): without autograd and without the
    Triton kernels, chunks of parent rows (``_level_in_chunks``: the C++ CPU kernel or
    PyTorch; peak memory about the output plus the pyramids); with autograd on CPU, the
    C++ kernels' autograd function (``_level_cpu_train``); the fused Triton level
    (``_level_fused``: the final level, and B's other levels when training); otherwise the
    batched gathers with their custom backward (``_level_batched``). ``_merge_levels`` then
    adds the levels coarse to fine (in place without autograd).
    """
    S = len(queries)
    _check_pyramids(S, keys, values, topks, attn_type)
    run = _CoreRun(num_heads, 1.0 / (queries[0].shape[1] // num_heads)**0.5, attn_type,
                   topks, level_weights, lepes, margin_recorder, chunk_elements, use_triton,
                   projections, _is_inference(queries, keys, values, lepes, level_weights),
                   grid=tuple(queries[0].shape[-2:]))
    q0, k0, v0 = (to_heads(t.float(), num_heads) for t in (queries[0], keys[0], values[0]))
    if S == 1 and attn_type == 'B':
        # plain softmax attention (no top-k): fused kernel, no L0 x L0 weights in memory
        msg = F.scaled_dot_product_attention(q0, k0, v0, scale=run.temp)
        if lepes is not None:
            msg = msg + run.lepe(0)
        return msg if level_weights is None else msg * level_weights[0]
    messages = [_coarsest_level(run, q0, k0, v0, more_levels=S > 1)]
    for i in range(1, S):
        messages.append(_finer_level(run, i, queries[i], keys[i], values[i], i == S - 1))
    return _merge_levels(run, messages, tuple(queries[0].shape[-2:]))


def _check_pyramids(S: int, keys, values, topks, attn_type: str) -> None:
    if attn_type not in ('A', 'B'):
        raise ValueError(f"attn_type must be 'A' or 'B', got {attn_type!r}")
    if not len(keys) == len(values) == S:
        raise ValueError('queries, keys and values need the same number of levels')
    if len(topks) < max(1, S - 1):
        raise ValueError(f'{S} levels need {max(1, S - 1)} top-k values, got {tuple(topks)}')


def _is_inference(queries, keys, values, lepes, level_weights) -> bool:
    """No input of the core requires a gradient (or grad mode is off)."""
    return not (torch.is_grad_enabled() and any(
        t.requires_grad for t in list(queries) + list(keys) + list(values)
        + list(lepes or []) + ([level_weights] if level_weights is not None else [])
        if isinstance(t, torch.Tensor)))


@dataclasses.dataclass
class _CoreRun:
    """What one call of ``quadtree_attention_core`` carries from level to level: its
    arguments, the coarser level's top-k (``prev_idx`` / ``prev_score``, raster order) and
    grid, and which levels' messages already hold their LePE / level weight."""
    h: int
    temp: float
    attn_type: str
    topks: Sequence[int]
    level_weights: Optional[torch.Tensor]
    lepes: Optional[Sequence]
    margin_recorder: Optional[MarginRecorder]
    chunk_elements: int
    use_triton: Optional[bool]
    projections: Optional[Projections]
    inference: bool
    grid: Tuple[int, int]
    prev_idx: Optional[torch.Tensor] = None
    prev_score: Optional[torch.Tensor] = None
    lepe_added: set = dataclasses.field(default_factory=set)
    weighted: set = dataclasses.field(default_factory=set)

    def lepe(self, i: int, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Level ``i``'s LePE map in heads, times ``scale`` if given (callables are lazy)."""
        m = self.lepes[i]
        if isinstance(m, LePEConv):
            return to_heads(m(scale), self.h)
        m = (m() if callable(m) else m).float()
        return to_heads(m if scale is None else m * scale, self.h)


def _coarsest_level(run: _CoreRun, q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                    more_levels: bool) -> torch.Tensor:
    """Level 0: full softmax attention, and the top-k the next level refines (raster
    order ``(B, h, L0, d)``)."""
    attn = torch.softmax(run.temp * (q0 @ k0.transpose(-1, -2)), dim=-1)  # (B, h, L0, L0)
    weights = attn
    if more_levels or run.attn_type == 'A':
        K0 = run.topks[0]
        if attn.shape[-1] < K0:
            raise ValueError(f'the coarsest level has {run.grid[0]}x{run.grid[1]} = '
                             f'{attn.shape[-1]} tokens, fewer than topk={K0}')
        _record_margin(run.margin_recorder, 0, attn, K0)
        # (B uses only the indices: a selection on the detached weights records no
        # autograd node, which would keep the (L0, K0) int64 indices for its backward)
        run.prev_score, run.prev_idx = (attn.detach() if run.attn_type == 'B' else attn).topk(
            K0, dim=-1, sorted=False)
        if run.attn_type == 'A':
            weights = attn.scatter(-1, run.prev_idx, 0.)
    return weights @ v0


def _finer_level(run: _CoreRun, i: int, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, final: bool) -> torch.Tensor:
    """Level ``i``'s messages in raster order: picks the path (see the core's docstring),
    updates the top-k and grid the next level reads."""
    hi, wi = query.shape[-2:]
    if (hi, wi) != (2 * run.grid[0], 2 * run.grid[1]):
        raise ValueError(f'level {i} is {hi}x{wi}, expected twice level {i - 1} '
                         f'({run.grid[0]}x{run.grid[1]})')
    k, v = to_heads(key, run.h), to_heads(value, run.h)  # (B, h, hi*wi, d)
    kernels = _level_uses_triton(run.use_triton, k, 4 * run.prev_idx.shape[-1],
                                 not run.inference)
    q = None
    if kernels and run.inference and run.use_triton is None:
        # (a configuration that failed its check sends the level to the chunked path)
        q = level_queries(query, run.h, run.temp)
        kv = (k, v) if k.dtype in _HALF and v.dtype in _HALF else (k.float(), v.float())
        kernels = _level_kernels_checked(run, i, q, *kv, run.prev_idx.int(), run.grid[1],
                                         final)
    if not (kernels and k.dtype in _HALF and v.dtype in _HALF):
        k, v = k.float(), v.float()
    # (else bf16 / fp16 keys and values go to the kernels as they are: they read them
    # into float32 registers, the same exact upcast as .float(), without writing a
    # float32 copy of both maps first; a PyTorch fallback casts them)
    if run.inference and not kernels:  # chunks of parent rows: no (N, 4K) tensor in memory
        msg = _level_in_chunks(run, i, query, k, v, final)
    elif not kernels and _uses_cpu_kernels(run, k):
        msg = _level_cpu_train(run, i, query, k, v, final)
    else:
        if q is None:
            q = level_queries(query, run.h, run.temp)  # (B, h, L, 4, d), pre-scaled
        if kernels and run.prev_idx.dtype != torch.int32:
            # int32 indices for the kernels (the ops save them for the backward: half the
            # bytes of int64; the levels below inherit the dtype)
            run.prev_idx = run.prev_idx.int()
        # the kernels take the parent cells (B, h, L, Kp) and derive their 4Kp children
        # (a quarter of the index bytes read and kept for the backward, and no candidate
        # list built when nothing else needs it); the PyTorch path takes the children
        pw = run.grid[1]
        index, iw = (run.prev_idx, pw) if kernels else (child_candidates(run.prev_idx, pw), 0)
        # (False when the level check said no: the same decision as above)
        level_triton = run.use_triton if kernels else False
        msg = None
        if (final or run.attn_type == 'B' and not run.inference) and kernels:
            msg = _level_fused(run, i, q, k, v, index, iw, final, level_triton, (hi, wi))
        if msg is None:  # no fused kernel here, or it raised in auto mode (warned once)
            msg = _level_batched(run, i, q, k, v, index, iw, final, level_triton, (hi, wi))
    run.grid = (hi, wi)
    return msg


def _level_in_chunks(run: _CoreRun, i: int, query: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, final: bool) -> torch.Tensor:
    """Inference without the Triton kernels: parent rows in chunks, by the C++ CPU kernel
    when it is built (and no margins are recorded), else ``_finer_level_inference``."""
    # B: the level's LePE map is the buffer the messages are summed into
    init = None
    if run.attn_type == 'B' and run.lepes is not None:
        init = run.lepe(i).contiguous()
        run.lepe_added.add(i)
    level = _finer_level_inference
    if graph_capture() and run.margin_recorder is None:
        # a graph for a runtime: the tile form, dense batched ops in one piece (a traced
        # chunk loop would be unrolled, and embedding_bag exports as a loop over bags)
        # (one runtime operator per level where the exporter asked for it)
        tiles = finer_level_graph_op if custom_ops_requested() else finer_level_tiles
        msg, run.prev_idx, run.prev_score = tiles(
            query.float(), k, v, run.prev_idx, run.prev_score, run.h, run.temp,
            run.attn_type, None if final else run.topks[i], init)
        return msg
    if _uses_cpu_kernels(run, k):
        level = functools.partial(_finer_level_cpu_kernel, cpu_kernels.quadtree_level_kernel())
    msg, run.prev_idx, run.prev_score = level(
        query.float(), k, v, run.prev_idx, run.prev_score, run.h, run.temp, run.attn_type,
        None if final else run.topks[i], run.margin_recorder, i, init)
    return msg


def _uses_cpu_kernels(run: _CoreRun, k: torch.Tensor) -> bool:
    """Whether a level without the Triton kernels runs the compiled CPU kernels (inference
    in ``_level_in_chunks``, training in ``_level_cpu_train``): on CPU, without margin
    recording, when they are built and enabled."""
    return (k.device.type == 'cpu' and run.margin_recorder is None
            and cpu_kernels.quadtree_level_kernel() is not None)


def _level_cpu_train(run: _CoreRun, i: int, query: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, final: bool) -> torch.Tensor:
    """A level with autograd on CPU by the compiled kernels (``quadtree_cpu.level``: it keeps
    the level's queries, keys, values and selected cells for the backward, which rebuilds
    the weights; none of the batched path's ``(N, 4K)`` weights and candidate lists)."""
    B, C, hi, wi = query.shape
    BH, M = B * run.h, hi * wi
    Kp = run.prev_idx.shape[-1]
    topk = 0 if final else run.topks[i]
    prev_score = run.prev_score.reshape(BH, M // 4, Kp) if run.attn_type == 'A' else None
    d = C // run.h
    msg, idx, score = cpu_kernels.level(
        to_heads(query.float(), run.h).reshape(BH, M, d), k.reshape(BH, M, d),
        v.reshape(BH, M, d), run.prev_idx.reshape(BH, M // 4, Kp), prev_score, wi,
        run.temp, topk)
    if not final:
        run.prev_idx = idx.view(B, run.h, M, topk)
        run.prev_score = score.view(B, run.h, M, topk) if run.attn_type == 'A' else None
    return msg.view(B, run.h, M, d)


def _candidates(index: torch.Tensor, iw: int) -> torch.Tensor:
    """``(B, h, L, 4Kp)`` candidate keys of the level, for the top-k's gather (``index``
    holds them already unless it holds parent cells, ``iw > 0``)."""
    return child_candidates(index, iw) if iw else index


def _level_fused(run: _CoreRun, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 index: torch.Tensor, iw: int, final: bool, level_triton: Optional[bool],
                 hw: Tuple[int, int]) -> Optional[torch.Tensor]:
    """The fused Triton level (scores + softmax (A: x prev_score) + messages, no
    ``(B, h, L, 4, 4Kp)`` tensors; its backward recomputes the weights), or ``None`` when
    the dispatch keeps this configuration on PyTorch or the kernel raised in auto mode.
    B: the level weight is applied in the kernel (its gradient from the backward's per-row
    ``g . out``, no saved unweighted messages) and folded into the LePE conv; A: the
    kernel scales by the coarser level's scores."""
    scale = (run.level_weights[i] if run.attn_type == 'B' and run.level_weights is not None
             else None)
    extra = scale if run.attn_type == 'B' else run.prev_score
    if not _use_final_kernel(level_triton, run.attn_type, q, k, v, index, extra, iw,
                             not run.inference):
        return None
    qt_triton = _kernels()
    idx_i = None
    if not final:
        # B: the top-k indices carry no gradient, so the weights they are selected from
        # are computed without autograd (nothing saved) and dropped
        with torch.no_grad():
            attn = torch.softmax(
                gathered_scores(q, k, index, run.chunk_elements, level_triton, iw), dim=-1)
        _record_margin(run.margin_recorder, i, attn, run.topks[i])
        sel = attn.topk(run.topks[i], dim=-1, sorted=False).indices  # (B, h, L, 4, Ki)
        idx_i = _candidates(index, iw).unsqueeze(3).expand_as(attn).gather(-1, sel)
        del attn, sel

    def fused_level():
        if final and run.projections is not None and not run.inference:
            # (its backward recomputes the finest maps from the block input)
            return qt_triton.final_level_projected_triton(
                q, k, v, index, extra, iw, run.projections, hw, run.h, run.temp,
                run.attn_type)
        if run.attn_type == 'B':
            return qt_triton.final_level_b_triton(q, k, v, index, extra, iw)
        return qt_triton.final_level_a_triton(q, k, v, index, extra, iw)

    raw = dispatch.guarded('quadtree', _final_key(run.attn_type, q, k, v, index, extra, iw),
                           q.device, level_triton is True, fused_level, lambda: None)
    if raw is None:
        return None
    msg = children_to_raster(raw, hw)
    if run.attn_type == 'B' and scale is not None:
        run.weighted.add(i)
        if run.lepes is not None:
            lepe = run.lepe(i, scale)
            msg = msg.add_(lepe) if run.inference else msg + lepe
            run.lepe_added.add(i)
    if not final:
        run.prev_idx, run.prev_score = children_to_raster(idx_i, hw), None
    return msg


def _level_batched(run: _CoreRun, i: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, index: torch.Tensor, iw: int, final: bool,
                   level_triton: Optional[bool], hw: Tuple[int, int]) -> torch.Tensor:
    """The level as batched gathers (``gathered_scores`` / ``gathered_messages``, custom
    backward; their Triton kernels where the level check allowed them)."""
    scores = gathered_scores(q, k, index, run.chunk_elements, level_triton, iw)
    if run.attn_type == 'B':
        attn = torch.softmax(scores, dim=-1)
    else:
        Kp = run.prev_idx.shape[-1]
        attn = torch.softmax(scores.unflatten(-1, (Kp, 4)), dim=-1)
        attn = (attn * run.prev_score[:, :, :, None, :, None]).flatten(-2)
    weights = attn
    if not final:
        Ki = run.topks[i]
        _record_margin(run.margin_recorder, i, attn, Ki)
        # (B: the indices only, selected on the detached weights, as at level 0)
        score_i, sel = (attn.detach() if run.attn_type == 'B' else attn).topk(
            Ki, dim=-1, sorted=False)  # (B, h, L, 4, Ki)
        idx_i = _candidates(index, iw).unsqueeze(3).expand_as(attn).gather(-1, sel)
        run.prev_idx = children_to_raster(idx_i, hw)
        # (the finer levels of B do not use the scores of their parents)
        run.prev_score = children_to_raster(score_i, hw) if run.attn_type == 'A' else None
        if run.attn_type == 'A':
            weights = attn.scatter(-1, sel, 0.)
    msg = gathered_messages(weights, v, index, run.chunk_elements, level_triton, iw)
    return children_to_raster(msg, hw)


def _merge_levels(run: _CoreRun, messages: List[torch.Tensor],
                  grid: Tuple[int, int]) -> torch.Tensor:
    """Coarse to fine: each level broadcast into the next (B: after its LePE and level
    weight, where the level path did not add them); in place without autograd."""
    out = None
    for i, msg in enumerate(messages):
        if run.attn_type == 'B':
            if run.lepes is not None and i not in run.lepe_added:
                msg = msg.add_(run.lepe(i)) if run.inference else msg + run.lepe(i)
            if run.level_weights is not None and i not in run.weighted:
                w = run.level_weights[i]
                msg = msg.mul_(w) if run.inference else msg * w
        if out is None:
            out = msg
        elif run.inference:  # broadcast the coarse level into the fine one, in place
            B_, h_, _, X = msg.shape
            msg.view(B_, h_, grid[0], 2, grid[1], 2, X).add_(
                out.view(B_, h_, grid[0], 1, grid[1], 1, X))
            out = msg
            grid = (2 * grid[0], 2 * grid[1])
        else:
            out = upsample_tokens(out, grid) + msg
            grid = (2 * grid[0], 2 * grid[1])
        messages[i] = None  # free merged levels
    return out


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


def _finer_level_inference(q_map: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           prev_idx: torch.Tensor, prev_score: Optional[torch.Tensor], h: int,
                           temp: float, attn_type: str, topk: Optional[int],
                           margin_recorder: Optional[MarginRecorder], level: int,
                           init: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                      Optional[torch.Tensor]]:
    """One finer level without autograd, processed in chunks of parent rows (scores,
    softmax, top-k and messages of a chunk, written straight into raster-order outputs).

    Same result as the batched path of ``quadtree_attention_core``; the peak memory of a
    level is its message map plus one chunk instead of several ``(N, 4K)`` tensors.
    Scores come from gathered key rows (``4K x d`` floats per parent) or, on levels with
    few keys (``4 M <= 4K d``: fewer floats per parent), from one dense GEMM of the child
    queries with all ``M`` keys followed by a gather of the candidate columns (a regular
    matrix product instead of many tiny ones; same numbers up to rounding).

    ``init`` (contiguous ``(B, h, hi*wi, d)``, e.g. the LePE map) is used as the message
    buffer and the messages are added to it.

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
            _record_margin(margin_recorder, level, attn, topk)
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


def _finer_level_cpu_kernel(kernel: Callable, q_map: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, prev_idx: torch.Tensor,
                            prev_score: Optional[torch.Tensor], h: int, temp: float,
                            attn_type: str, topk: Optional[int],
                            margin_recorder: Optional[MarginRecorder], level: int,
                            init: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                       Optional[torch.Tensor]]:
    """``_finer_level_inference`` by the fused CPU kernel (``ops.quadtree_cpu``): same arguments
    and results (up to float rounding and the order of the selected keys; no margins)."""
    B, C, hi, wi = q_map.shape
    d = C // h
    M = hi * wi
    Kp = prev_idx.shape[-1]
    q = to_heads(q_map, h).reshape(B * h, M, d).contiguous()
    msg = (q_map.new_zeros(B, h, M, d) if init is None else init).view(B * h, M, d)
    type_a = attn_type == 'A'
    scores = prev_score.reshape(B * h, M // 4, Kp).contiguous() if type_a else None
    next_idx, next_score = kernel(q, k.reshape(B * h, M, d).contiguous(),
                                  v.reshape(B * h, M, d).contiguous(),
                                  prev_idx.reshape(B * h, M // 4, Kp).contiguous(), scores,
                                  msg, wi, temp, topk or 0, type_a)
    if topk is None:
        return msg.view(B, h, M, d), None, None
    return (msg.view(B, h, M, d), next_idx.view(B, h, M, topk),
            next_score.view(B, h, M, topk) if type_a else None)


# --------------------------------------------------------------------------- module
class _LevelAttentionB(nn.Module):
    """Container of variant B's level logits ``weight`` ``(S,)`` (entry 0 = coarsest) and the
    per-level LePE depth-wise convs ``get_vs`` (entry 0 = coarsest); official ``py_att``."""

    def __init__(self, embed_dims: int, num_levels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_levels))
        self.get_vs = nn.ModuleList([
            nn.Conv2d(embed_dims, embed_dims, 3, 1, 1, groups=embed_dims)
            for _ in range(num_levels)
        ])


class QuadTreeAttention(nn.Module):
    """QuadTree attention replacing spatial-reduction attention in a PVTv2 block.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h``.
        qkv_bias: bias of the 1x1-conv ``q_proj``, ``k_proj``, ``v_proj``.
        attn_drop: accepted for interface uniformity; must be 0 (the official module
            has no attention dropout; ``build_attention`` does not pass a backbone's
            ``attn_drop_rate``).
        proj_drop: dropout after ``proj``.
        attn_type: ``'B'`` (learned value pyramid, level weights, LePE; the released
            models) or ``'A'`` (avg-pooled values, score redistribution).
        num_levels: pyramid levels ``S`` (the official ``sr_ratio``; 4, 3, 2, 1 for
            stages 1-4 of the released models).
        topk: keys each query passes on to the next finer level: one value, or one per
            level starting at the coarsest (entries from ``num_levels - 1`` on are unused,
            like the official finest-level top-k). 8 in the classification models,
            32 in the dense ones.
        value_act: activation inside the B value branches: ``'gelu'`` (classification
            code) or ``'relu'`` (detection/segmentation code); same parameters.
        chunk_elements: bound on the gathered key/value elements held at once
            (memory/speed trade-off, no effect on results).
        use_triton: Triton kernels for the finer levels' gathered scores and messages
            (forward and backward): ``None`` auto (on CUDA, when Triton imports), ``True``
            force (an error if they cannot run), ``False`` the PyTorch path.
            ``FLATTEN_MM_TRITON=0`` turns them off everywhere.
        recompute_values: B, when autograd records the attention: intermediate maps of
            the value pyramid are recomputed in the backward instead of kept
            (``torch.utils.checkpoint``): the value branches' inner maps (GroupNorm, act,
            2x2 conv, GroupNorm, act per level; their inputs and outputs, the value
            pyramid, are kept by the attention anyway) and, under bf16 / fp16 autocast, the
            float32 copy of each value map that the LePE conv reads. The same outputs and
            gradients, less memory for more backward launches. With a backbone's
            ``with_cp`` the block is recomputed already; ``False`` then saves a third pass.
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 attn_type: str = 'B',
                 num_levels: int = 1,
                 topk: Union[int, Sequence[int]] = 32,
                 value_act: str = 'relu',
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                 use_triton: Optional[bool] = None,
                 recompute_values: bool = True) -> None:
        super().__init__()
        self.use_triton = dispatch.check_use_triton(use_triton)
        self.recompute_values = bool(recompute_values)
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        if attn_drop != 0:
            raise NotImplementedError(
                f'QuadTreeAttention has no attention-weight dropout (got attn_drop={attn_drop} '
                "in its attn_cfg); a backbone's attn_drop_rate only reaches operators with one")
        if attn_type not in ('A', 'B'):
            raise ValueError(f"attn_type must be 'A' or 'B', got {attn_type!r}")
        if num_levels < 1:
            raise ValueError(f'num_levels must be >= 1, got {num_levels}')
        if value_act not in ('relu', 'gelu'):
            raise ValueError(f"value_act must be 'relu' or 'gelu', got {value_act!r}")
        topks = (topk, ) * num_levels if isinstance(topk, int) else tuple(int(t) for t in topk)
        if len(topks) < max(1, num_levels - 1) or any(t < 1 for t in topks):
            raise ValueError(f'topk must be a positive int or at least {max(1, num_levels - 1)} '
                             f'positive values (one per level from the coarsest), got {topk}')
        for i in range(num_levels - 2):
            if topks[i + 1] > 4 * topks[i]:
                raise ValueError(f'topk {topks[i + 1]} at level {i + 1} exceeds its '
                                 f'{4 * topks[i]} candidates (4 x topk of level {i})')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.attn_type = attn_type
        self.num_levels = num_levels
        self.topks = topks
        self.value_act = value_act
        self.chunk_elements = chunk_elements
        #: optional ``(level, margin)`` callback, see ``quadtree_attention_core``
        self.margin_recorder: Optional[MarginRecorder] = None

        self.q_proj = nn.Conv2d(embed_dims, embed_dims, 1, bias=qkv_bias)
        self.k_proj = nn.Conv2d(embed_dims, embed_dims, 1, bias=qkv_bias)
        self.v_proj = nn.Conv2d(embed_dims, embed_dims, 1, bias=qkv_bias)
        if attn_type == 'B':
            act = nn.ReLU if value_act == 'relu' else nn.GELU
            self.value_branchs = nn.ModuleList([
                nn.Sequential(
                    nn.GroupNorm(1, embed_dims), act(),
                    nn.Conv2d(embed_dims, embed_dims, 2, 2), nn.GroupNorm(1, embed_dims), act(),
                    nn.Conv2d(embed_dims, embed_dims, 1)) for _ in range(num_levels - 1)
            ])
            self.py_att = _LevelAttentionB(embed_dims, num_levels)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    @classmethod
    def has_attention_dropout(cls, cfg: dict) -> bool:
        """No attention dropout (``build_attention`` does not pass ``attn_drop_rate``)."""
        return False

    @property
    def uses_topk(self) -> bool:
        """Whether the coarsest level's top-k selection affects the output."""
        return self.num_levels > 1 or self.attn_type == 'A'

    @property
    def size_divisor(self) -> int:
        """Maps are padded to multiples of this (``2**(num_levels - 1)``)."""
        return 2**(self.num_levels - 1)

    def min_map_size(self) -> int:
        """Smallest square map side whose coarsest level holds ``topk`` tokens (1 if the
        top-k is unused)."""
        if not self.uses_topk:
            return 1
        return self.size_divisor * math.ceil(math.sqrt(self.topks[0]))

    def check_map_size(self, hw_shape: Tuple[int, int]) -> None:
        """Raise ``ValueError`` if a ``hw_shape`` map is too small for the top-k."""
        if not self.uses_topk:
            return
        f = self.size_divisor
        hc, wc = -(-hw_shape[0] // f), -(-hw_shape[1] // f)
        if hc * wc < self.topks[0]:
            side = self.min_map_size()
            raise ValueError(
                f'QuadTreeAttention: a {hw_shape[0]}x{hw_shape[1]} map gives a coarsest level '
                f'of {hc}x{wc} = {hc * wc} tokens with {self.num_levels} levels, fewer than '
                f'topk={self.topks[0]}; need ceil(H/{f}) * ceil(W/{f}) >= {self.topks[0]} '
                f'(e.g. a {side}x{side} map)')

    def _value_branch(self, t: int, v: torch.Tensor) -> torch.Tensor:
        """B's value map of the next coarser level (``value_branchs[t]``; recomputed in the
        backward when ``recompute_values`` and autograd records it)."""
        branch = self.value_branchs[t]
        if (self.recompute_values and recorded_eagerly(v, *branch.parameters())
                and not torch.compiler.is_compiling()):
            # (no random op in a branch: no RNG state to restore; under torch.compile the
            # compiler decides what it keeps)
            return checkpoint(branch, v, use_reentrant=False, preserve_rng_state=False)
        return branch(v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               hw_shape: Tuple[int, int],
               projections: Optional[Projections] = None) -> torch.Tensor:
        """QuadTree attention on projected tokens (no ``q/k/v_proj``, no ``proj``).

        Builds the pyramids (2x2 average pooling; variant B: the learned value branches
        and the LePE convs) and runs ``quadtree_attention_core`` in float32.

        Args:
            q, k, v: ``(B, N, C)`` tokens of an ``hw_shape`` map whose sides are
                multiples of ``size_divisor`` (the padded map).
            hw_shape: ``(H, W)``.
            projections: optional, ``q``, ``k`` (and ``v``) as projections of one input
                (``Projections`` of the tokens: ``q = F.linear(x, *query)``, ...), passed to
                the core (a training forward with the kernels then keeps ``x`` instead of
                the finest query and key maps).

        Returns:
            ``(B, N, C)`` float32 messages (head-major channels).
        """
        B, N, C = q.shape
        H, W = hw_shape
        # tokens are channels-last maps: pooling and convs run on views, no copies
        q, k, v = (tokens_as_map(t, hw_shape) for t in (q, k, v))
        queries, keys, values = [q], [k], [v]  # finest first
        for t in range(self.num_levels - 1):
            q, k = _avg_pool_2x2(q), _avg_pool_2x2(k)
            v = self._value_branch(t, v) if self.attn_type == 'B' else _avg_pool_2x2(v)
            queries.append(q)
            keys.append(k)
            values.append(v)
        queries, keys, values = queries[::-1], keys[::-1], values[::-1]  # coarsest first

        with torch.autocast(device_type=q.device.type, enabled=False):
            level_weights = lepes = None
            if self.attn_type == 'B':
                level_weights = torch.softmax(self.py_att.weight.float(), dim=0)
                # evaluated when their level is merged (keeps one LePE map alive at a time)
                lepes = [LePEConv(val, conv, self.recompute_values)
                         for val, conv in zip(values, self.py_att.get_vs)]
            out = quadtree_attention_core(queries, keys, values, self.num_heads, self.topks,
                                          self.attn_type, level_weights, lepes,
                                          self.margin_recorder, self.chunk_elements,
                                          self.use_triton, projections)
        return out.transpose(1, 2).reshape(B, N, C)  # head-major channels

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        B, N, C = x.shape
        H, W = hw_shape
        self.check_map_size(hw_shape)
        f = self.size_divisor
        pad_h, pad_w = (-H) % f, (-W) % f
        if pad_h or pad_w:
            x = F.pad(x.reshape(B, H, W, C), (0, 0, 0, pad_w, 0, pad_h)).reshape(
                B, (H + pad_h) * (W + pad_w), C)
        Hp, Wp = H + pad_h, W + pad_w
        # the 1x1-conv projections as matmuls on the tokens (same maths, no NCHW copies);
        # under autocast x and the weights are cast here, as the matmuls would cast them:
        # one copy of x for the three (and for the backward), not one each
        x, *flat = autocast_operands(x, *[t for conv in (self.q_proj, self.k_proj, self.v_proj)
                                          for t in (conv.weight.reshape(C, C), conv.bias)])
        params = list(zip(flat[::2], flat[1::2]))  # (weight, bias) of q, k, v
        q, k, v = (F.linear(x, w, b) for w, b in params)
        # (the finest query and key, and A's value, are then recomputed from x in the
        # backward of the fused final level; B's value map is kept by its value branch)
        projections = Projections(x, params[0], params[1],
                                  params[2] if self.attn_type == 'A' else None)
        out = self.attend(q, k, v, (Hp, Wp), projections=projections)
        if pad_h or pad_w:
            out = out.reshape(B, Hp, Wp, C)[:, :H, :W]
        out = out.reshape(B, N, C).to(x.dtype)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'attn_type={self.attn_type!r}, num_levels={self.num_levels}, '
                f'topk={self.topks[:max(1, self.num_levels - 1)]}, value_act={self.value_act!r}')


# ----------------------------------------------------------------------------------------
# first-use check of the QuadTree kernels (ops.dispatch): a kernel configuration is used in
# auto mode only after its forward and backward matched this module's PyTorch path once


def _first_use_check(key: tuple, device: torch.device) -> None:
    """Run the kernel of ``key`` (``_gathered_key`` / ``_final_key``) forward and backward
    on a tiny level of the key's layouts (``specialisation.like``: parents spanning two
    program blocks and a ragged tail) against the PyTorch path; raise
    ``dispatch.KernelMismatch`` (or the kernel's error) if they differ."""
    qt = _kernels()
    gen = dispatch.check_generator()
    op = key[0]
    if op in ('qt_scores', 'qt_messages'):
        _, _, nf, K, d, parents, *layouts, pw_cls = key  # a, src, index
        L_min = 2 * qt.tile_parents(K, d) + 1
    else:
        _, _, K, d, parents, *layouts, pw_cls = key  # q, k, v, index, extra
        nf, L_min = 4, 2 * qt.tile_parents(K, d, fused=True) + 1
    la, lsrc, lidx = layouts[0], layouts[1], layouts[-2 if op.startswith('qt_final') else 2]
    B, h = spec.sized_like(la[2][0], 1), spec.sized_like(la[2][1], 2)
    ph, pw = _parent_grid(la[2][2], pw_cls if parents else la[2][2], L_min)
    L, M = ph * pw, 4 * ph * pw  # the level is a (2 ph) x (2 pw) map
    Kidx = K // 4 if parents else K
    index = spec.like(lidx, (B, h, L, Kidx), device, gen,
                      integers=L if parents else M)[0]
    iw = pw if parents else 0
    # (the float inputs: a and src, or q, k and v)
    tol = max(dispatch.TOLERANCES[lay[0]] for lay in layouts[:3 if op.startswith('qt_f') else 2])
    if op in ('qt_scores', 'qt_messages'):
        scores = op == 'qt_scores'
        views, storages = spec.check_leaves(
            (la, lsrc), [(B, h, L, nf, d if scores else K), (B, h, M, d)], device, gen,
            positive=(not scores, False))
        gathered = gathered_scores if scores else gathered_messages
        kernel = qt.gathered_scores_triton if scores else qt.gathered_messages_triton

        def run(use_triton):
            a, src = spec.views_of(views, storages)
            if use_triton:
                return kernel(a, src, index, iw)
            return gathered(a, src, index, use_triton=False, parent_width=iw)
    else:
        grouped = op == 'qt_final_a'
        lq, lk, lv, _, lextra = layouts
        shapes = [(B, h, L, 4, d), (B, h, M, d), (B, h, M, d),
                  (B, h, L, K // 4) if grouped else  # (B: the level weight, any shape of 1)
                  tuple(1 for _ in (lextra.sizes if lextra else ()))]
        views, storages = spec.check_leaves((lq, lk, lv, lextra), shapes, device, gen,
                                        positive=(False, False, False, True))

        def run(use_triton):
            q, k, v, extra = spec.views_of(views, storages)
            if use_triton:
                fn = qt.final_level_a_triton if grouped else qt.final_level_b_triton
                return fn(q, k, v, index, extra, iw)
            scores = gathered_scores(q, k, index, use_triton=False, parent_width=iw)
            if grouped:
                attn = torch.softmax(scores.unflatten(-1, (K // 4, 4)), dim=-1)
                attn = (attn * extra[:, :, :, None, :, None]).flatten(-2)
            else:
                attn = torch.softmax(scores, dim=-1)
            out = gathered_messages(attn, v, index, use_triton=False, parent_width=iw)
            return out if grouped or extra is None else out * extra
    dispatch.compare_paths(op, run, storages, gen, tol)


def _parent_grid(parents_cls, width_cls, at_least: int) -> Tuple[int, int]:
    """A parent grid ``(ph, pw)`` of at least ``at_least`` cells whose width and cell
    count have the given ``specialisation.size_class`` es (a level's ``L = ph * pw``)."""
    pw = spec.sized_like(width_cls, 2 if width_cls != parents_cls else at_least)
    if parents_cls == width_cls and spec.size_class(pw) == parents_cls:
        return 1, pw
    for ph in range(max(1, -(-at_least // pw)), max(1, -(-at_least // pw)) + 64):
        if spec.size_class(ph * pw) == parents_cls:
            return ph, pw
    raise ValueError(f'no parent grid with {parents_cls} cells and width {width_cls}')



dispatch.register_first_use_check('quadtree', _first_use_check)

