"""QuadTree's two gather operations (the official ``score_computation`` and
``value_aggregation`` kernels, attention.md §3.6), with the candidate list shared by the 4
child queries of a parent:

* scores:   ``out[b,j,l,f,k] = <query[b,j,l,f], key[b,j,index[b,j,l,k]]>``;
* messages: ``out[b,j,l,f] = sum_k weight[b,j,l,f,k] value[b,j,index[b,j,l,k]]``.

With autograd the PyTorch form gathers in chunks of parents and saves only its inputs
(``_GatheredMatmul``: the backward gathers again; ``src`` gets its gradient by
``index_add_``); without autograd the scores gather in cache-sized chunks and the messages
are one weighted ``embedding_bag`` (no gathered value rows). On CUDA the Triton kernels
(``quadtree_triton``) take over where ``quadtree_paths.gathered_uses_triton`` says so.
``gathered_reference`` / ``final_level_reference`` are the op-by-op forms a double backward
differentiates.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch
from .autograd_paths import differentiate_reference, records_backward_graph, register_reference
from .capture import graph_capture
from .quadtree_layout import child_candidates, flat_rows
from .quadtree_paths import gathered_key, gathered_uses_triton, kernels

#: default bound on the elements of one chunk of gathered key/value rows
DEFAULT_CHUNK_ELEMENTS = 1 << 25


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



register_reference('qt_gathered_scores',
                   lambda a, src, index, pw: gathered_reference(a, src, index, pw, True))
register_reference('qt_gathered_messages',
                   lambda a, src, index, pw: gathered_reference(a, src, index, pw, False))
register_reference('qt_final_b', lambda q, k, v, index, scale, pw: final_level_reference(
    q, k, v, index, scale, pw, False))
register_reference('qt_final_a', lambda q, k, v, index, prev_score, pw: final_level_reference(
    q, k, v, index, prev_score, pw, True))


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
    if gathered_uses_triton(use_triton, query, key, index, True, parent_width):
        out = dispatch.guarded(
            'quadtree', gathered_key(query, key, index, True, parent_width), query.device,
            use_triton is True, lambda: kernels().gathered_scores_triton(
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
    if gathered_uses_triton(use_triton, weight, value, index, False, parent_width):
        out = dispatch.guarded(
            'quadtree', gathered_key(weight, value, index, False, parent_width),
            weight.device, use_triton is True,
            lambda: kernels().gathered_messages_triton(
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
