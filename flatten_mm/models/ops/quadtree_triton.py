"""Triton kernels of QuadTree attention's finer levels: gathered scores and gathered
messages, forward and backward, without materialising the gathered key / value rows.

The same maths as ``quadtree_gather.gathered_scores`` / ``gathered_messages`` (the
PyTorch path, ``_GatheredMatmul``, which stays the fallback and the reference), i.e. the
official CUDA kernels ``score_computation`` / ``value_aggregation`` with the candidate list
shared by the ``F`` (= 4) child queries of a parent::

    scores[b, j, l, f, k] = <q[b, j, l, f, :], key[b, j, cand[b, j, l, k], :]>
    out[b, j, l, f, :]    = sum_k w[b, j, l, f, k] * value[b, j, cand[b, j, l, k], :]

with the backward passes

    scores:   dq[l, f] = sum_k g[l, f, k] key[cand[l, k]]       (gather + weighted sum)
              dkey[cand[l, k]] += sum_f g[l, f, k] q[l, f]       (fp32 atomic scatter-add)
    messages: dw[l, f, k] = <g[l, f], value[cand[l, k]]>         (gather + dot)
              dvalue[cand[l, k]] += sum_f w[l, f, k] g[l, f]     (fp32 atomic scatter-add)

All four directions are one kernel, ``_qt_gathered_kernel``, over a "K-side" tensor ``P``
``(B, h, L, F, K)`` (scores / weights / their gradient), a "D-side" tensor ``Q``
``(B, h, L, F, d)`` (queries / messages / their gradient), the key or value table ``src``
``(B, h, M, d)`` and the candidates ``cand`` ``(B, h, L, K)``; constexpr flags select what
it computes: ``P = Q . G^T``, ``Q = P G`` (``G = src[cand]``, the gathered rows, held only
in registers) and / or ``dsrc += P^T Q`` by ``tl.atomic_add`` into a float32 buffer.
One program handles one (batch, head) pair and a block of ``BLOCK_P`` parents: it loads
their candidate lists and gathered rows once and treats the ``F`` children in a static loop.
Every op also takes, instead of ``cand``, the ``K / 4`` cells of the coarser level that a
parent's candidates are the children of (``parent_width``: that grid's width; what
``quadtree_attention_core`` passes): the kernels derive the candidate rows in registers
(``_candidate_rows``), so the ``(B, h, L, K)`` list is neither written nor kept.
Everything is accumulated in float32 for float32 / bfloat16 / float16 inputs; no ``tl.dot``
(no TF32): the products are exact float32 multiply-adds, only the summation order differs
from the PyTorch path. The scatter-add makes the gradient of ``src`` non-deterministic in
its last bits on the GPU (atomics), as ``index_add_`` is on CUDA.

Custom ops (``torch.library.triton_op``, one ``torch.compile`` node each):
``flatten_mm::qt_gathered_scores`` / ``qt_gathered_scores_backward`` and
``flatten_mm::qt_gathered_messages`` / ``qt_gathered_messages_backward``, joined by
``register_autograd``; the final level fused (scores + softmax + messages, no ``(L, F, K)``
tensor written): ``flatten_mm::qt_final_level_b`` (softmax over all ``K`` candidates) and
``flatten_mm::qt_final_level_a`` (softmax within each group of 4 children, scaled by the
coarser level's ``prev_score``; gradients also for ``prev_score``), each with its
``_backward`` op.

A training forward's final level whose query and key are projections of the block input
(``quadtree_level.Projections``; variant A: the value too) runs as
``final_level_projected_triton``, an ``autograd.Function`` around the fused op: its
backward recomputes those maps (one GEMM each) instead of keeping the float32 grouped
queries and the key map of the finest level, the largest tensors a block's attention
would keep besides its input.

On CUDA tensors the kernels are compiled by Triton; on CPU tensors they run only under
Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported), which is
how the tests run them.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .autograd_paths import differentiate_reference, records_backward_graph
from .layout import tokens_as_map
from .quadtree_layout import level_queries, to_heads
from .specialisation import kernel_grad
from .triton_common import (INTERPRETED, cast_rne, device_problem, on_tensor_device,
                            shared_memory_problem)

#: register budget: ``BLOCK_K * BLOCK_D`` gathered elements per parent (e.g. 4K = 128
#: candidates of d = 64, or 256 of d = 32); larger problems take the PyTorch path
_MAX_TILE = 1 << 13
#: elements of the per-program ``(BLOCK_P, BLOCK_K, BLOCK_D)`` tile on the GPU
_GPU_TILE = 1 << 13
#: channels of the ``dk`` / ``dv`` chunks the fused final level's backward scatters
_FINAL_CHUNK_D = 8


# ----------------------------------------------------------------------------------------
# kernel


@triton.jit
def _candidate_rows(cand_ptr, b, hh, par64, kk, pk_mask, scb, sch, scl, sck, pw,
                    PARENTS: tl.constexpr):
    """The candidate key rows ``(BLOCK_P, BLOCK_K)`` (int64) of the program's parents, read
    from candidate lists, or (``PARENTS``) derived from parent lists: candidate ``4 j + c``
    is child ``c`` (row offset ``c // 2``, column offset ``c % 2``) of the cell ``p =
    index[l, j]`` of the coarser grid of width ``pw``, i.e. row ``2 (p + (p // pw) pw) +
    (c // 2) 2 pw + c % 2`` of the finer one (``_child_candidates``' order): a quarter of
    the index bytes read, and no candidate list written or kept for the backward."""
    base = cand_ptr + b * scb + hh * sch + par64[:, None] * scl
    if PARENTS:
        p = tl.load(base + (kk // 4)[None, :] * sck, mask=pk_mask, other=0).to(tl.int64)
        c = kk % 4
        return 2 * (p + (p // pw) * pw) + ((c // 2) * (2 * pw) + c % 2)[None, :]
    return tl.load(base + kk[None, :] * sck, mask=pk_mask, other=0).to(tl.int64)


@triton.jit
def _qt_gathered_kernel(p_ptr, q_ptr, src_ptr, cand_ptr, out_ptr, dsrc_ptr,
                        H, L, K, D, pw,
                        spb, sph, spl, spf, spk,
                        sqb, sqh, sql, sqf, sqd,
                        ssb, ssh, ssm, ssd,
                        scb, sch, scl, sck,
                        sob, soh, sol, sof, sox,
                        sdb, sdh, sdm,
                        F: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_D: tl.constexpr, OUT_P: tl.constexpr, OUT_Q: tl.constexpr,
                        SCATTER: tl.constexpr, PARENTS: tl.constexpr):
    """One (batch, head) pair (``program_id(1)``) and ``BLOCK_P`` parents
    (``program_id(0)``).

    ``OUT_P``: ``out[l, f, k] = <Q[l, f], src[cand[l, k]]>`` (``out`` shaped like ``P``).
    ``OUT_Q``: ``out[l, f] = sum_k P[l, f, k] src[cand[l, k]]`` (shaped like ``Q``).
    ``SCATTER``: ``dsrc[cand[l, k]] += sum_f P[l, f, k] Q[l, f]`` (float32, atomic;
    ``dsrc`` contiguous in its last dim).
    ``PARENTS``: ``cand`` holds ``K / 4`` parent cells of the coarser grid of width ``pw``
    per parent, whose children are the candidates (``_candidate_rows``).
    """
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hh = (bh % H).to(tl.int64)
    par = pid * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,)
    kk = tl.arange(0, BLOCK_K)  # (BK,)
    dd = tl.arange(0, BLOCK_D)  # (BD,)
    pmask = par < L
    pk_mask = pmask[:, None] & (kk < K)[None, :]  # (BP, BK)
    pd_mask = pmask[:, None] & (dd < D)[None, :]  # (BP, BD)
    pkd_mask = pk_mask[:, :, None] & (dd < D)[None, None, :]  # (BP, BK, BD)
    par64 = par.to(tl.int64)

    # the candidate rows of the parents: loaded once, shared by the F children
    cand = _candidate_rows(cand_ptr, b, hh, par64, kk, pk_mask, scb, sch, scl, sck, pw,
                           PARENTS)
    src_off = cand[:, :, None] * ssm + dd[None, None, :] * ssd  # (BP, BK, BD)
    if OUT_P or OUT_Q:
        g = tl.load(src_ptr + b * ssb + hh * ssh + src_off, mask=pkd_mask,
                    other=0.).to(tl.float32)
    if SCATTER:
        acc = tl.zeros((BLOCK_P, BLOCK_K, BLOCK_D), tl.float32)

    p_base = p_ptr + b * spb + hh * sph + par64[:, None] * spl + kk[None, :] * spk
    q_base = q_ptr + b * sqb + hh * sqh + par64[:, None] * sql + dd[None, :] * sqd
    o_base = out_ptr + b * sob + hh * soh + par64[:, None] * sol
    for f in tl.static_range(F):
        if OUT_P:  # (BP, BD) . (BP, BK, BD) -> (BP, BK)
            qf = tl.load(q_base + f * sqf, mask=pd_mask, other=0.).to(tl.float32)
            res = tl.sum(g * qf[:, None, :], axis=2)
            tl.store(o_base + f * sof + kk[None, :] * sox,
                     cast_rne(res, out_ptr.dtype.element_ty), mask=pk_mask)
        if OUT_Q:  # (BP, BK) x (BP, BK, BD) -> (BP, BD)
            pf = tl.load(p_base + f * spf, mask=pk_mask, other=0.).to(tl.float32)
            res = tl.sum(g * pf[:, :, None], axis=1)
            tl.store(o_base + f * sof + dd[None, :] * sox,
                     cast_rne(res, out_ptr.dtype.element_ty), mask=pd_mask)
        if SCATTER:
            pf = tl.load(p_base + f * spf, mask=pk_mask, other=0.).to(tl.float32)
            qf = tl.load(q_base + f * sqf, mask=pd_mask, other=0.).to(tl.float32)
            acc += pf[:, :, None] * qf[:, None, :]
    if SCATTER:
        d_off = cand[:, :, None] * sdm + dd[None, None, :]
        tl.atomic_add(dsrc_ptr + b * sdb + hh * sdh + d_off, acc, mask=pkd_mask)


@triton.jit
def _final_tiles(k_ptr, v_ptr, cand_ptr, H, L, K, D, pw,
                 skb, skh, skm, skd, svb, svh, svm, svd, scb, sch, scl, sck,
                 BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                 PARENTS: tl.constexpr):
    """The program's (batch, head) pair and parents, their masks, and the candidate
    key / value rows of those parents gathered into float32 registers (shared by the
    fused final level's forward and backward)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hh = (bh % H).to(tl.int64)
    par = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    kk = tl.arange(0, BLOCK_K)
    dd = tl.arange(0, BLOCK_D)
    pmask = par < L
    kmask = kk < K
    pk_mask = pmask[:, None] & kmask[None, :]
    pd_mask = pmask[:, None] & (dd < D)[None, :]
    pkd_mask = pk_mask[:, :, None] & (dd < D)[None, None, :]
    par64 = par.to(tl.int64)
    cand = _candidate_rows(cand_ptr, b, hh, par64, kk, pk_mask, scb, sch, scl, sck, pw,
                           PARENTS)
    kg = tl.load(k_ptr + b * skb + hh * skh + cand[:, :, None] * skm + dd[None, None, :] * skd,
                 mask=pkd_mask, other=0.).to(tl.float32)
    vg = tl.load(v_ptr + b * svb + hh * svh + cand[:, :, None] * svm + dd[None, None, :] * svd,
                 mask=pkd_mask, other=0.).to(tl.float32)
    return (bh, b, hh, par64, dd, pmask, kmask, pk_mask, pd_mask, pkd_mask, cand, kg,
            vg)


@triton.jit
def _prev_scores(ps_ptr, b, hh, par64, pmask, K, spb, sph, spl, spk,
                 BLOCK_K: tl.constexpr):
    """Variant A: the coarser level's score of each candidate parent, ``(BLOCK_P,
    BLOCK_K // 4)`` float32 (zero for masked parents and padded groups)."""
    gg = tl.arange(0, BLOCK_K // 4)
    return tl.load(ps_ptr + b * spb + hh * sph + par64[:, None] * spl + gg[None, :] * spk,
                   mask=pmask[:, None] & (gg < K // 4)[None, :], other=0.).to(tl.float32)


@triton.jit
def _group_softmax(sc, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    """Variant A: softmax within each group of 4 consecutive candidates (the 4 children of
    one candidate parent), ``(BLOCK_P, BLOCK_K // 4, 4)``. Padded groups hold finite
    scores (zero rows), so no ``-inf`` is needed: their weights are zeroed by the zero
    prev_score."""
    s = tl.reshape(sc, (BLOCK_P, BLOCK_K // 4, 4))
    e = tl.exp(s - tl.max(s, axis=2)[:, :, None])
    return e / tl.sum(e, axis=2)[:, :, None]


@triton.jit
def _qt_final_fwd(q_ptr, k_ptr, v_ptr, cand_ptr, ps_ptr, scale_ptr, out_ptr, stats_ptr,
                  H, L, K, D, pw,
                  sqb, sqh, sql, sqf, sqd,
                  skb, skh, skm, skd,
                  svb, svh, svm, svd,
                  scb, sch, scl, sck,
                  spb, sph, spl, spk,
                  sob, soh, sol, sof, sod,
                  F: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_D: tl.constexpr, GROUPED: tl.constexpr, SCALED: tl.constexpr,
                  PARENTS: tl.constexpr):
    """The final level fused for ``BLOCK_P`` parents of one (batch, head) pair; the
    ``K`` candidates of a parent fit one tile, so the softmax is exact in registers (no
    scores or weights written).

    Variant B (``GROUPED`` false): ``out[l, f] = softmax_k(<q[l, f], key[cand[l, k]]>) @
    value[cand[l]]``; stores the softmax statistics ``stats[bh, l, f] = (max, sum of exp)``
    (float32) for the backward pass (two numbers, not the log-sum-exp: ``exp(s - max) /
    sum`` keeps the rounding error of the weights independent of the score magnitude).

    Variant A (``GROUPED``): the softmax runs within each group of 4 consecutive candidates
    (``cand[l, 4 j: 4 j + 4]``: the children of candidate parent ``j``, as
    ``_child_candidates`` orders them) and the weights of group ``j`` are scaled by
    ``prev_score[l, j]``; nothing is stored besides ``out`` (the backward recomputes the
    4-wide softmax).

    ``SCALED`` (B): ``out`` is multiplied by the float32 scalar at ``scale_ptr`` (B's level
    weight: no unscaled copy of the messages has to be kept for its gradient)."""
    (bh, b, hh, par64, dd, pmask, kmask, pk_mask, pd_mask, pkd_mask, cand, kg,
     vg) = _final_tiles(k_ptr, v_ptr, cand_ptr, H, L, K, D, pw, skb, skh, skm, skd, svb,
                        svh, svm, svd, scb, sch, scl, sck, BLOCK_P, BLOCK_K, BLOCK_D,
                        PARENTS)
    if SCALED:
        scale = tl.load(scale_ptr).to(tl.float32)
    q_base = q_ptr + b * sqb + hh * sqh + par64[:, None] * sql + dd[None, :] * sqd
    o_base = out_ptr + b * sob + hh * soh + par64[:, None] * sol + dd[None, :] * sod
    stats_base = stats_ptr + bh.to(tl.int64) * L * F * 2 + par64 * F * 2
    if GROUPED:
        ps = _prev_scores(ps_ptr, b, hh, par64, pmask, K, spb, sph, spl, spk, BLOCK_K)
    for f in tl.static_range(F):
        qf = tl.load(q_base + f * sqf, mask=pd_mask, other=0.).to(tl.float32)
        sc = tl.sum(kg * qf[:, None, :], axis=2)  # (BP, BK)
        if GROUPED:
            w = tl.reshape(_group_softmax(sc, BLOCK_P, BLOCK_K) * ps[:, :, None],
                           (BLOCK_P, BLOCK_K))
            o = tl.sum(vg * w[:, :, None], axis=1)
        else:
            sc = tl.where(kmask[None, :], sc, float('-inf'))
            m = tl.max(sc, axis=1)
            e = tl.exp(sc - m[:, None])
            den = tl.sum(e, axis=1)
            o = tl.sum(vg * e[:, :, None], axis=1) / den[:, None]
            if SCALED:
                o = o * scale
            tl.store(stats_base + 2 * f, m, mask=pmask)
            tl.store(stats_base + 2 * f + 1, den, mask=pmask)
        tl.store(o_base + f * sof, cast_rne(o, out_ptr.dtype.element_ty), mask=pd_mask)


@triton.jit
def _qt_final_bwd(q_ptr, k_ptr, v_ptr, cand_ptr, stats_ptr, ps_ptr, scale_ptr, g_ptr, dq_ptr,
                  dk_ptr, dv_ptr, dps_ptr, dscale_ptr, H, L, K, D, M, pw,
                  sqb, sqh, sql, sqf, sqd,
                  skb, skh, skm, skd,
                  svb, svh, svm, svd,
                  scb, sch, scl, sck,
                  spb, sph, spl, spk,
                  sgb, sgh, sgl, sgf, sgd,
                  F: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, GROUPED: tl.constexpr,
                  SCALED: tl.constexpr, PARENTS: tl.constexpr):
    """Backward of ``_qt_final_fwd``: ``dq`` (contiguous, input dtype) and float32 atomic
    scatter-adds into ``dk`` / ``dv`` (contiguous ``(B, h, M, d)``)::

        B: p = exp(s - max) / sum (from stats); dp = g . v; ds = p (dp - sum_k p dp)
        A: p = softmax over the group (recomputed); w = p ps; dp = g . v;
           t_j = sum_{k in j} p dp;  ds = ps p (dp - t_j);  dps[l, j] = sum_f t_j
        dq = ds @ k_cand;  dk[cand] += ds^T q;  dv[cand] += w^T g   (B: w = p)

    Two phases, so that at most two ``(BLOCK_P, BLOCK_K, BLOCK_D)`` float32 tiles are live
    at once (with ``dk`` / ``dv`` accumulated over the children next to the gathered rows
    there were four, which spilled at head dim 64): the child loop keeps each child's
    ``ds`` and ``w`` (``(BLOCK_P, BLOCK_K, F)``, small), then ``dk`` / ``dv`` are formed and
    scattered ``CHUNK_D`` channels at a time from them and the reloaded ``q`` / ``g``.

    A also writes ``dps`` (contiguous ``(B, h, L, K / 4)``, the prev_score dtype): each
    parent's groups belong to one program, so no atomics there.

    ``SCALED`` (B, ``out = scale * o``): ``ds`` and ``w`` carry the scale, and each child
    row's ``g . o = sum_k p dp`` is written to ``dscale`` (contiguous ``(B, h, L, F)``
    float32; their sum is the scale's gradient)."""
    tl.static_assert((F & (F - 1)) == 0, 'F (children per parent) must be a power of 2')
    (bh, b, hh, par64, dd, pmask, kmask, pk_mask, pd_mask, pkd_mask, cand, kg,
     vg) = _final_tiles(k_ptr, v_ptr, cand_ptr, H, L, K, D, pw, skb, skh, skm, skd, svb,
                        svh, svm, svd, scb, sch, scl, sck, BLOCK_P, BLOCK_K, BLOCK_D,
                        PARENTS)
    ff = tl.arange(0, F)
    ds_all = tl.zeros((BLOCK_P, BLOCK_K, F), tl.float32)  # ds of child f at [:, :, f]
    w_all = tl.zeros((BLOCK_P, BLOCK_K, F), tl.float32)
    q_base = q_ptr + b * sqb + hh * sqh + par64[:, None] * sql + dd[None, :] * sqd
    g_base = g_ptr + b * sgb + hh * sgh + par64[:, None] * sgl + dd[None, :] * sgd
    dq_base = dq_ptr + bh.to(tl.int64) * L * F * D + par64[:, None] * F * D + dd[None, :]
    stats_base = stats_ptr + bh.to(tl.int64) * L * F * 2 + par64 * F * 2
    if GROUPED:
        ps = _prev_scores(ps_ptr, b, hh, par64, pmask, K, spb, sph, spl, spk, BLOCK_K)
        dps = tl.zeros((BLOCK_P, BLOCK_K // 4), tl.float32)
    if SCALED:
        scale = tl.load(scale_ptr).to(tl.float32)
    for f in tl.static_range(F):
        qf = tl.load(q_base + f * sqf, mask=pd_mask, other=0.).to(tl.float32)
        gf = tl.load(g_base + f * sgf, mask=pd_mask, other=0.).to(tl.float32)
        sc = tl.sum(kg * qf[:, None, :], axis=2)
        dp = tl.sum(vg * gf[:, None, :], axis=2)
        if GROUPED:
            p3 = _group_softmax(sc, BLOCK_P, BLOCK_K)
            dp3 = tl.reshape(dp, (BLOCK_P, BLOCK_K // 4, 4))
            t = tl.sum(p3 * dp3, axis=2)  # (BP, BK / 4)
            dps += t
            ds = tl.reshape(p3 * (dp3 - t[:, :, None]) * ps[:, :, None], (BLOCK_P, BLOCK_K))
            p = tl.reshape(p3 * ps[:, :, None], (BLOCK_P, BLOCK_K))
        else:
            m = tl.load(stats_base + 2 * f, mask=pmask, other=0.)
            den = tl.load(stats_base + 2 * f + 1, mask=pmask, other=1.)
            p = tl.where(pk_mask, tl.exp(sc - m[:, None]) / den[:, None], 0.)  # (BP, BK)
            # (g . out from the float32 weights, not from the stored, rounded output)
            go = tl.sum(p * dp, axis=1)
            ds = p * (dp - go[:, None])
            if SCALED:
                tl.store(dscale_ptr + bh.to(tl.int64) * L * F + par64 * F + f, go, mask=pmask)
                ds = ds * scale
                p = p * scale
        dqf = tl.sum(kg * ds[:, :, None], axis=1)
        tl.store(dq_base + f * D, cast_rne(dqf, dq_ptr.dtype.element_ty), mask=pd_mask)
        is_f = (ff == f)[None, None, :]
        ds_all = tl.where(is_f, ds[:, :, None], ds_all)
        w_all = tl.where(is_f, p[:, :, None], w_all)
    # dk[cand] += sum_f ds_f q_f, dv[cand] += sum_f w_f g_f, CHUNK_D channels at a time
    base = bh.to(tl.int64) * M * D  # (dk, dv: contiguous (B, h, M, d))
    pf_off = par64[:, None, None] * sql + ff[None, :, None] * sqf
    gf_off = par64[:, None, None] * sgl + ff[None, :, None] * sgf
    for c in tl.static_range(0, BLOCK_D, CHUNK_D):
        dc = c + tl.arange(0, CHUNK_D)
        dmask = dc < D
        pfd_mask = pmask[:, None, None] & dmask[None, None, :]
        qc = tl.load(q_ptr + b * sqb + hh * sqh + pf_off + dc[None, None, :] * sqd,
                     mask=pfd_mask, other=0.).to(tl.float32)  # (BP, F, CD)
        gc = tl.load(g_ptr + b * sgb + hh * sgh + gf_off + dc[None, None, :] * sgd,
                     mask=pfd_mask, other=0.).to(tl.float32)
        dkc = tl.sum(ds_all[:, :, :, None] * qc[:, None, :, :], axis=2)  # (BP, BK, CD)
        dvc = tl.sum(w_all[:, :, :, None] * gc[:, None, :, :], axis=2)
        rows = cand[:, :, None] * D + dc[None, None, :]
        kd_mask = pk_mask[:, :, None] & dmask[None, None, :]
        tl.atomic_add(dk_ptr + base + rows, dkc, mask=kd_mask)
        tl.atomic_add(dv_ptr + base + rows, dvc, mask=kd_mask)
    if GROUPED:
        G = K // 4
        gg = tl.arange(0, BLOCK_K // 4)
        tl.store(dps_ptr + bh.to(tl.int64) * L * G + par64[:, None] * G + gg[None, :],
                 cast_rne(dps, dps_ptr.dtype.element_ty),
                 mask=pmask[:, None] & (gg < G)[None, :])


# ----------------------------------------------------------------------------------------
# launch helpers


def _blocks(K: int, d: int) -> Tuple[int, int, int]:
    """``BLOCK_P`` parents per program, padded ``BLOCK_K`` candidates and ``BLOCK_D``
    channels. Interpreted: 2 parents, so the tests cover blocks of several parents with a
    masked tail (odd ``L``)."""
    bk = max(2, triton.next_power_of_2(K))
    bd = max(2, triton.next_power_of_2(d))
    bp = 2 if INTERPRETED else max(1, min(16, _GPU_TILE // (bk * bd)))
    return bp, bk, bd


def _gathered_warps(bp: int, bk: int, bd: int, scatter: bool) -> int:
    """Warps of a ``_qt_gathered_kernel`` launch: 4 for tiles up to 4096 elements, else 8;
    32 for the scatter (backward) launches with one parent of ``BLOCK_D >= 64`` per program,
    which would otherwise spill (their registers and spills per target:
    ``docs/benchmarks/kernel_limits.md``)."""
    if scatter and bp == 1 and bd >= 64:
        return 32
    return 4 if bp * bk * bd <= 4096 else 8


def tile_parents(num_candidates: int, head_dim: int, fused: bool = False) -> int:
    """Parents per program (``BLOCK_P``) of the gathered kernels (``fused``: of the fused
    final level) for ``num_candidates`` of ``head_dim``."""
    blocks = _final_blocks if fused else _blocks
    return blocks(num_candidates, head_dim)[0]


def tile_fits(num_candidates: int, head_dim: int) -> bool:
    """Whether ``num_candidates`` gathered rows of ``head_dim`` fit the register budget."""
    _, bk, bd = _blocks(num_candidates, head_dim)
    return bk * bd <= _MAX_TILE


@on_tensor_device
def _launch(P: torch.Tensor, Q: torch.Tensor, src: torch.Tensor, cand: torch.Tensor,
            out: Optional[torch.Tensor], dsrc: Optional[torch.Tensor], out_p: bool,
            out_q: bool, parent_width: int = 0) -> None:
    """One launch of ``_qt_gathered_kernel`` (see its docstring for the flags;
    ``parent_width > 0``: ``cand`` holds parent cells of a grid that wide)."""
    B, h, L, nf, K = P.shape
    d = Q.shape[-1]
    bp, bk, bd = _blocks(K, d)
    o = out if out is not None else P  # (unused pointer when there is no output)
    ds = dsrc if dsrc is not None else src
    ds_strides = dsrc.stride()[:3] if dsrc is not None else (0, 0, 0)
    torch.library.wrap_triton(_qt_gathered_kernel)[(triton.cdiv(L, bp), B * h)](
        P, Q, src, cand, o, ds, h, L, K, d, parent_width, *P.stride(), *Q.stride(),
        *src.stride(), *cand.stride(), *o.stride(), *ds_strides,
        F=nf, BLOCK_P=bp, BLOCK_K=bk, BLOCK_D=bd, OUT_P=out_p, OUT_Q=out_q,
        SCATTER=dsrc is not None, PARENTS=parent_width > 0,
        num_warps=_gathered_warps(bp, bk, bd, dsrc is not None))


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the four launches of the two ops: (name, OUT_P, OUT_Q, SCATTER)
_MODES = (('scores', True, False, False), ('scores_backward', False, True, True),
          ('messages', False, True, False), ('messages_backward', True, False, True))


def _signature(fn, const: dict, io: str, fp32_ptrs: Tuple[str, ...]) -> Tuple[dict, dict]:
    sig, cst = {}, {}
    for arg in fn.arg_names:
        if arg in const:
            sig[arg], cst[arg] = 'constexpr', const[arg]
        elif arg == 'cand_ptr':  # (the core's candidate lists are int32)
            sig[arg] = '*i32'
        elif arg.endswith('_ptr'):
            sig[arg] = '*fp32' if arg in fp32_ptrs else io
        else:
            sig[arg] = 'i32'
    return sig, cst


def aot_specs(num_candidates: int, head_dim: int, dtype: torch.dtype) -> list:
    """What the launches of the ops compile (scores / messages, forward / backward, and the
    fused final level's two kernels for variant B, with its level weight as the released
    models have it, and for variant A; all with the parent lists the core passes):
    ``(name, kernel, signature, constexprs, options)`` each, for ahead-of-time compilation without a GPU
    (``triton.compile(ASTSource(kernel, signature, constexprs), target, options)``). Needs
    the kernels compiled, not interpreted."""
    if INTERPRETED:
        raise RuntimeError('aot_specs needs the compiled kernels (TRITON_INTERPRET unset)')
    io = {torch.float32: '*fp32', torch.bfloat16: '*bf16', torch.float16: '*fp16'}[dtype]
    bp, bk, bd = _blocks(num_candidates, head_dim)
    specs = []
    for name, out_p, out_q, scatter in _MODES:
        const = dict(F=4, BLOCK_P=bp, BLOCK_K=bk, BLOCK_D=bd, OUT_P=out_p, OUT_Q=out_q,
                     SCATTER=scatter, PARENTS=True)
        sig, cst = _signature(_qt_gathered_kernel, const, io,
                              ('dsrc_ptr', ) if scatter else ())
        options = dict(num_warps=_gathered_warps(bp, bk, bd, scatter))
        specs.append((name, _qt_gathered_kernel, sig, cst, options))
    bp, bk, bd, warps = _final_blocks(num_candidates, head_dim)
    for variant in 'ba':
        const = dict(F=4, BLOCK_P=bp, BLOCK_K=bk, BLOCK_D=bd, GROUPED=variant == 'a',
                     SCALED=variant == 'b', PARENTS=True)
        for name, fn, fp32, extra in (
                (f'final_level_{variant}', _qt_final_fwd, ('stats_ptr', 'scale_ptr'), {}),
                (f'final_level_{variant}_backward', _qt_final_bwd,
                 ('stats_ptr', 'dk_ptr', 'dv_ptr', 'scale_ptr', 'dscale_ptr'),
                 dict(CHUNK_D=_final_chunk_d(bd)))):
            sig, cst = _signature(fn, dict(const, **extra), io, fp32)
            specs.append((name, fn, sig, cst, dict(num_warps=warps)))
    return specs


def limit_key(name: str, const: dict, options: dict, dtype: torch.dtype) -> str:
    """The row of the ahead-of-time limit table (``ops/kernel_limits.json``) of one kernel
    specialisation: what sets its shared memory and registers."""
    return (f"{name}|{str(dtype).replace('torch.', '')}|P{const['BLOCK_P']}"
            f"|K{const['BLOCK_K']}|D{const['BLOCK_D']}|w{options['num_warps']}")


def limit_keys(num_candidates: int, head_dim: int, dtype: torch.dtype,
               prefix: str = '') -> list:
    """``limit_key`` of the kernels whose name starts with ``prefix`` (``'scores'``,
    ``'messages'``, ``'final_level_b'``, ``'final_level_a'``; all by default)."""
    return [limit_key(name, const, options, dtype) for name, _, _, const, options
            in aot_specs(num_candidates, head_dim, dtype) if name.startswith(prefix)]


def _num_candidates(index: torch.Tensor, parent_width: int) -> int:
    """Candidates per parent: ``index``'s last dim, 4x that for parent lists."""
    return index.shape[-1] * (4 if parent_width else 1)


def check_inputs(a: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                 scores: bool, parent_width: int = 0) -> Optional[str]:
    """Why the kernels cannot take these inputs (``None`` if they can).

    Args:
        a: ``(B, h, L, F, d)`` queries (``scores``) or ``(B, h, L, F, K)`` weights.
        src: ``(B, h, M, d)`` keys or values.
        index: ``(B, h, L, K)`` candidate rows, or with ``parent_width``, ``(B, h, L, K /
            4)`` parent cells of the coarser grid, whose 4 children each are the candidates.
        scores: whether this is the score kernel (else the message kernel).
        parent_width: 0 (``index`` holds candidate rows), or the width of the coarser grid
            whose cells ``index`` holds (the level's map is twice as wide).
    """
    if a.dim() != 5 or src.dim() != 4 or index.dim() != 4:
        return (f'expected a 5-d, src 4-d and index 4-d, got {tuple(a.shape)}, '
                f'{tuple(src.shape)}, {tuple(index.shape)}')
    B, h, L, nf, X = a.shape
    M, d = src.shape[2:]
    if not isinstance(parent_width, int) or isinstance(parent_width, bool) or parent_width < 0:
        return f'parent_width must be an int >= 0, got {parent_width!r}'
    if parent_width and M % (4 * parent_width):
        return (f'{M} key rows are not a map of width {2 * parent_width} and even height '
                f'(twice the parent grid of width {parent_width})')
    K = _num_candidates(index, parent_width)
    if src.shape[:2] != (B, h) or index.shape[:3] != (B, h, L):
        return (f'shapes do not match: a {tuple(a.shape)}, src {tuple(src.shape)}, '
                f'index {tuple(index.shape)}')
    if X != (d if scores else K):
        return f'last dim of a is {X}, expected {d if scores else K}'
    if min(B, h, L, nf, M, d, K) == 0:
        return 'empty tensor'
    if B * h > 65535:  # CUDA grid limit of the 2nd dimension
        return f'batch x heads = {B * h} above 65535'
    if nf > 16:
        return f'{nf} children per parent (the kernel unrolls them; at most 16)'
    if not tile_fits(K, d):
        return f'{K} candidates x head dim {d} above the register budget ({_MAX_TILE})'
    if index.dtype not in (torch.int64, torch.int32):
        return f'index dtype {index.dtype} (int64 / int32)'
    for t in (a, src):
        if t.dtype not in _FLOAT_DTYPES:
            return f'dtype {t.dtype} (the kernels take float32 / bfloat16 / float16)'
    return device_problem((a, src, index), __name__) or shared_memory_problem(
        'quadtree', lambda: limit_keys(K, d, src.dtype, 'scores' if scores else 'messages'),
        src.device)


# ----------------------------------------------------------------------------------------
# custom ops: scores


@torch.library.triton_op('flatten_mm::qt_gathered_scores', mutates_args=())
def _scores_op(query: torch.Tensor, key: torch.Tensor, index: torch.Tensor,
               parent_width: int = 0) -> torch.Tensor:
    B, h, L, nf, _ = query.shape
    out = query.new_empty((B, h, L, nf, _num_candidates(index, parent_width)))
    _launch(out, query, key, index, out, None, out_p=True, out_q=False,
            parent_width=parent_width)
    return out


@_scores_op.register_fake
def _(query, key, index, parent_width=0):
    B, h, L, nf, _ = query.shape
    return query.new_empty((B, h, L, nf, _num_candidates(index, parent_width)))


def _grad_buffers(a: torch.Tensor, src: torch.Tensor, need_a: bool,
                  need_src: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Outputs of a backward op: ``a``'s gradient (contiguous) and ``src``'s, or an empty
    tensor where a gradient is not needed."""
    da = torch.empty_like(a, memory_format=torch.contiguous_format) if need_a else \
        a.new_empty((0, ))
    dsrc = torch.empty_like(src, memory_format=torch.contiguous_format) if need_src else \
        src.new_empty((0, ))
    return da, dsrc


def _gathered_backward(grad, a, src, index, parent_width, need_a, need_src, messages: bool):
    """Shared body of both backward ops: the gradients of ``a`` (the weights of
    ``messages``, else the queries of the scores) and of ``src`` (values / keys, by the
    fp32 scatter-add)."""
    da = _grad_buffers(a, src, need_a, False)[0]
    dsrc32 = torch.zeros(src.shape, dtype=torch.float32, device=src.device) if need_src \
        else None
    if need_a or need_src:
        if messages:  # (P = weight, Q = grad) -> dweight, dvalue
            _launch(a, grad, src, index, da if need_a else None, dsrc32, out_p=need_a,
                    out_q=False, parent_width=parent_width)
        else:  # scores: (P = grad, Q = query) -> dquery, dkey
            _launch(grad, a, src, index, da if need_a else None, dsrc32, out_p=False,
                    out_q=need_a, parent_width=parent_width)
    dsrc = dsrc32.to(src.dtype) if need_src else src.new_empty((0, ))
    return da, dsrc


def _save_inputs(ctx, inputs, output):
    """Setup of a gathered op ``(a, src, index, parent_width)``."""
    ctx.save_for_backward(*inputs[:3])
    ctx.parent_width = inputs[3]


def _autograd_backward(backward_op, reference: str):
    """The ``register_autograd`` backward of a gathered op ``(a, src, index,
    parent_width)`` (under ``create_graph``: the registered ``reference`` formula)."""
    def backward(ctx, grad):
        a, src, index = ctx.saved_tensors
        if records_backward_graph():
            return tuple(differentiate_reference(
                reference, (a, src, index, ctx.parent_width), ctx.needs_input_grad, (grad, )))
        need_a, need_src = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        da, dsrc = backward_op(kernel_grad(grad), a, src, index, ctx.parent_width, need_a,
                               need_src)
        return (da if need_a else None), (dsrc if need_src else None), None, None
    return backward


@torch.library.triton_op('flatten_mm::qt_gathered_scores_backward', mutates_args=())
def _scores_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        index: torch.Tensor, parent_width: int, need_query: bool,
                        need_key: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dquery, dkey)``; an empty tensor stands for a gradient that is not needed."""
    return _gathered_backward(grad, query, key, index, parent_width, need_query, need_key,
                              messages=False)


@_scores_backward_op.register_fake
def _(grad, query, key, index, parent_width, need_query, need_key):
    return _grad_buffers(query, key, need_query, need_key)


_scores_op.register_autograd(
    _autograd_backward(lambda *a: torch.ops.flatten_mm.qt_gathered_scores_backward(*a),
                       'qt_gathered_scores'),
    setup_context=_save_inputs)


# ----------------------------------------------------------------------------------------
# custom ops: messages


@torch.library.triton_op('flatten_mm::qt_gathered_messages', mutates_args=())
def _messages_op(weight: torch.Tensor, value: torch.Tensor, index: torch.Tensor,
                 parent_width: int = 0) -> torch.Tensor:
    B, h, L, nf, _ = weight.shape
    out = weight.new_empty((B, h, L, nf, value.shape[-1]))
    _launch(weight, out, value, index, out, None, out_p=False, out_q=True,
            parent_width=parent_width)
    return out


@_messages_op.register_fake
def _(weight, value, index, parent_width=0):
    B, h, L, nf, _ = weight.shape
    return weight.new_empty((B, h, L, nf, value.shape[-1]))


@torch.library.triton_op('flatten_mm::qt_gathered_messages_backward', mutates_args=())
def _messages_backward_op(grad: torch.Tensor, weight: torch.Tensor, value: torch.Tensor,
                          index: torch.Tensor, parent_width: int, need_weight: bool,
                          need_value: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dweight, dvalue)``; an empty tensor stands for a gradient that is not needed."""
    return _gathered_backward(grad, weight, value, index, parent_width, need_weight,
                              need_value, messages=True)


@_messages_backward_op.register_fake
def _(grad, weight, value, index, parent_width, need_weight, need_value):
    return _grad_buffers(weight, value, need_weight, need_value)


_messages_op.register_autograd(
    _autograd_backward(lambda *a: torch.ops.flatten_mm.qt_gathered_messages_backward(*a),
                       'qt_gathered_messages'),
    setup_context=_save_inputs)


# ----------------------------------------------------------------------------------------
# custom ops: the final level fused (variant B, and variant A with its prev_score)


def _final_blocks(K: int, d: int) -> Tuple[int, int, int, int]:
    """``BLOCK_P``, ``BLOCK_K``, ``BLOCK_D`` and warps of the fused final-level kernels (two
    gathered ``(BLOCK_P, BLOCK_K, BLOCK_D)`` tiles live at once, forward and backward; the
    backward scatters ``dk`` / ``dv`` in chunks of ``_FINAL_CHUNK_D`` channels, one 32-byte
    sector per candidate row, to keep fewer tiles live; registers and spills per target:
    ``docs/benchmarks/kernel_limits.md``)."""
    _, bk, bd = _blocks(K, d)
    bp = 2 if INTERPRETED else max(1, min(16, _GPU_TILE // (2 * bk * bd)))
    return bp, bk, bd, 4 if bp * bk * bd <= 2048 else 8


def _final_chunk_d(block_d: int) -> int:
    """Channels per ``dk`` / ``dv`` chunk of ``_qt_final_bwd``."""
    return min(block_d, _FINAL_CHUNK_D)


@on_tensor_device
def _final_forward(query, key, value, index, prev_score, scale=None, parent_width=0):
    """``(out, stats)`` of ``_qt_final_fwd``: variant B when ``prev_score`` is ``None``
    (``stats`` ``(B, h, L, F, 2)`` float32; ``out`` times the float32 scalar ``scale`` if
    given), else variant A (``stats`` empty); ``parent_width > 0``: ``index`` holds
    parent cells."""
    B, h, L, nf, d = query.shape
    K = _num_candidates(index, parent_width)
    bp, bk, bd, warps = _final_blocks(K, d)
    grouped = prev_score is not None
    out = query.new_empty((B, h, L, nf, d))
    stats = query.new_empty((0, ) if grouped else (B, h, L, nf, 2), dtype=torch.float32)
    ps = prev_score if grouped else query  # (unused pointers for B / without scale)
    sc = scale if scale is not None else query
    torch.library.wrap_triton(_qt_final_fwd)[(triton.cdiv(L, bp), B * h)](
        query, key, value, index, ps, sc, out, stats, h, L, K, d, parent_width,
        *query.stride(), *key.stride(), *value.stride(), *index.stride(),
        *(ps.stride()[:4] if grouped else (0, ) * 4), *out.stride(), F=nf, BLOCK_P=bp,
        BLOCK_K=bk, BLOCK_D=bd, GROUPED=grouped, SCALED=scale is not None,
        PARENTS=parent_width > 0, num_warps=warps)
    return out, stats


@on_tensor_device
def _final_backward_launch(grad, query, key, value, index, stats, prev_score, scale=None,
                           parent_width=0):
    """``(dq, dk, dv, dprev_score, dscale)`` by ``_qt_final_bwd`` (``dprev_score`` empty
    for B, ``dscale`` empty without ``scale``)."""
    B, h, L, nf, d = query.shape
    M, K = key.shape[2], _num_candidates(index, parent_width)
    bp, bk, bd, warps = _final_blocks(K, d)
    grouped = prev_score is not None
    dq = torch.empty((B, h, L, nf, d), dtype=query.dtype, device=query.device)
    dk = torch.zeros((B, h, M, d), dtype=torch.float32, device=key.device)
    dv = torch.zeros((B, h, M, d), dtype=torch.float32, device=value.device)
    ps = prev_score if grouped else query  # (unused pointers for B)
    dps = torch.empty(ps.shape, dtype=ps.dtype, device=ps.device) if grouped else \
        query.new_empty((0, ))
    scaled = scale is not None
    sc = scale if scaled else query
    # (per child row g . o, summed below: a deterministic reduction, no atomics)
    rows = torch.empty((B, h, L, nf) if scaled else (0, ), dtype=torch.float32,
                       device=query.device)
    torch.library.wrap_triton(_qt_final_bwd)[(triton.cdiv(L, bp), B * h)](
        query, key, value, index, stats, ps, sc, grad, dq, dk, dv, dps, rows, h, L, K, d, M,
        parent_width, *query.stride(), *key.stride(), *value.stride(), *index.stride(),
        *(ps.stride()[:4] if grouped else (0, ) * 4), *grad.stride(),
        F=nf, BLOCK_P=bp, BLOCK_K=bk, BLOCK_D=bd, CHUNK_D=_final_chunk_d(bd), GROUPED=grouped,
        SCALED=scaled, PARENTS=parent_width > 0, num_warps=warps)
    dscale = rows.sum().reshape(scale.shape).to(scale.dtype) if scaled else rows
    return dq, dk.to(key.dtype), dv.to(value.dtype), dps, dscale


def _qkv_grads_fake(query, key, value):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (query, key, value))


@torch.library.triton_op('flatten_mm::qt_final_level_b', mutates_args=())
def _final_b_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                index: torch.Tensor, scale: Optional[torch.Tensor] = None,
                parent_width: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    return _final_forward(query, key, value, index, None, scale, parent_width)


@_final_b_op.register_fake
def _(query, key, value, index, scale=None, parent_width=0):
    return (query.new_empty(query.shape),
            query.new_empty((*query.shape[:4], 2), dtype=torch.float32))


@torch.library.triton_op('flatten_mm::qt_final_level_b_backward', mutates_args=())
def _final_b_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, index: torch.Tensor, stats: torch.Tensor,
                         scale: Optional[torch.Tensor] = None, parent_width: int = 0
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dquery, dkey, dvalue, dscale)`` (``dscale`` empty without ``scale``)."""
    dq, dk, dv, _, dscale = _final_backward_launch(grad, query, key, value, index, stats,
                                                   None, scale, parent_width)
    return dq, dk, dv, dscale


@_final_b_backward_op.register_fake
def _(grad, query, key, value, index, stats, scale=None, parent_width=0):
    return _qkv_grads_fake(query, key, value) + (
        scale.new_empty(scale.shape) if scale is not None else
        query.new_empty((0, ), dtype=torch.float32), )


def _final_b_setup(ctx, inputs, output):
    query, key, value, index, scale, parent_width = inputs
    _, stats = output
    ctx.save_for_backward(query, key, value, index, stats, scale)
    ctx.parent_width = parent_width
    ctx.mark_non_differentiable(stats)


def _final_b_backward(ctx, grad_out, grad_stats):
    query, key, value, index, stats, scale = ctx.saved_tensors
    if records_backward_graph():  # (create_graph: the registered formula)
        return tuple(differentiate_reference(
            'qt_final_b', (query, key, value, index, scale, ctx.parent_width),
            ctx.needs_input_grad, (grad_out, )))
    dq, dk, dv, dscale = torch.ops.flatten_mm.qt_final_level_b_backward(
        kernel_grad(grad_out), query, key, value, index, stats, scale, ctx.parent_width)
    return dq, dk, dv, None, dscale if scale is not None else None, None


_final_b_op.register_autograd(_final_b_backward, setup_context=_final_b_setup)


@torch.library.triton_op('flatten_mm::qt_final_level_a', mutates_args=())
def _final_a_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                index: torch.Tensor, prev_score: torch.Tensor,
                parent_width: int = 0) -> torch.Tensor:
    return _final_forward(query, key, value, index, prev_score, None, parent_width)[0]


@_final_a_op.register_fake
def _(query, key, value, index, prev_score, parent_width=0):
    return query.new_empty(query.shape)


@torch.library.triton_op('flatten_mm::qt_final_level_a_backward', mutates_args=())
def _final_a_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, index: torch.Tensor, prev_score: torch.Tensor,
                         parent_width: int = 0
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dquery, dkey, dvalue, dprev_score)`` (all contiguous)."""
    stats = query.new_empty((0, ), dtype=torch.float32)  # (A recomputes its softmax)
    return _final_backward_launch(grad, query, key, value, index, stats, prev_score, None,
                                  parent_width)[:4]


@_final_a_backward_op.register_fake
def _(grad, query, key, value, index, prev_score, parent_width=0):
    return _qkv_grads_fake(query, key, value) + (
        torch.empty_like(prev_score, memory_format=torch.contiguous_format), )


def _final_a_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.parent_width = inputs[5]


def _final_a_backward(ctx, grad_out):
    query, key, value, index, prev_score = ctx.saved_tensors
    if records_backward_graph():  # (create_graph: the registered formula)
        return tuple(differentiate_reference(
            'qt_final_a', (query, key, value, index, prev_score, ctx.parent_width),
            ctx.needs_input_grad, (grad_out, )))
    dq, dk, dv, dps = torch.ops.flatten_mm.qt_final_level_a_backward(
        kernel_grad(grad_out), query, key, value, index, prev_score, ctx.parent_width)
    return dq, dk, dv, None, dps, None


_final_a_op.register_autograd(_final_a_backward, setup_context=_final_a_setup)


# ----------------------------------------------------------------------------------------
# entry points


def _run_op(why: Optional[str], op, *args):
    """Run the custom ``op`` outside autocast (the kernels take the inputs' dtype and
    accumulate in float32), or raise ``ValueError`` with ``why`` the inputs are refused."""
    if why is not None:
        raise ValueError(f'QuadTree Triton kernels: {why}')
    with torch.autocast(device_type=args[0].device.type, enabled=False):
        return op(*args)


def gathered_scores_triton(query: torch.Tensor, key: torch.Tensor, index: torch.Tensor,
                           parent_width: int = 0) -> torch.Tensor:
    """``gathered_scores`` by the Triton kernel (differentiable in ``query`` and ``key``).

    Args:
        query: ``(B, h, L, F, d)`` child queries grouped by parent (any strides).
        key: ``(B, h, M, d)`` keys of the level.
        index: ``(B, h, L, K)`` candidate rows, or with ``parent_width`` the ``(B, h, L, K /
            4)`` parent cells whose children they are (see ``check_inputs``).
        parent_width: 0, or the width of the coarser grid ``index`` holds cells of.

    Returns:
        ``(B, h, L, F, K)`` in the dtype of ``query`` (accumulated in float32).

    Raises:
        ValueError: inputs the kernels do not take (see ``check_inputs``).
    """
    return _run_op(check_inputs(query, key, index, True, parent_width),
                   torch.ops.flatten_mm.qt_gathered_scores, query, key, index, parent_width)


def gathered_messages_triton(weight: torch.Tensor, value: torch.Tensor, index: torch.Tensor,
                             parent_width: int = 0) -> torch.Tensor:
    """``gathered_messages`` by the Triton kernel (differentiable in ``weight``, ``value``).

    Args:
        weight: ``(B, h, L, F, K)`` attention weights (any strides).
        value: ``(B, h, M, d)`` values of the level.
        index: ``(B, h, L, K)`` candidate rows, or with ``parent_width`` the ``(B, h, L, K /
            4)`` parent cells whose children they are (see ``check_inputs``).
        parent_width: 0, or the width of the coarser grid ``index`` holds cells of.

    Returns:
        ``(B, h, L, F, d)`` in the dtype of ``weight`` (accumulated in float32).

    Raises:
        ValueError: inputs the kernels do not take (see ``check_inputs``).
    """
    return _run_op(check_inputs(weight, value, index, False, parent_width),
                   torch.ops.flatten_mm.qt_gathered_messages, weight, value, index,
                   parent_width)


def final_level_b_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         index: torch.Tensor, scale: Optional[torch.Tensor] = None,
                         parent_width: int = 0) -> torch.Tensor:
    """Variant B's final level in one kernel: ``gathered_messages(softmax(
    gathered_scores(query, key, index)), value, index)`` (times ``scale``) without writing
    the ``(B, h, L, F, K)`` scores or weights (differentiable in ``query``, ``key``,
    ``value`` and ``scale``; the backward recomputes the weights from the saved softmax max
    and sum).

    Args:
        query: ``(B, h, L, F, d)`` child queries (already multiplied by the temperature).
        key: ``(B, h, M, d)`` keys of the level.
        value: ``(B, h, M, d)`` values of the level.
        index: ``(B, h, L, K)`` candidate rows, or with ``parent_width`` the ``(B, h, L, K /
            4)`` parent cells whose children they are (see ``check_inputs``).
        parent_width: 0, or the width of the coarser grid ``index`` holds cells of.
        scale: optional float32 one-element tensor on the device of ``query``, e.g. B's
            level weight: multiplied into the messages in the kernel, so that its gradient
            needs no saved copy of the unscaled messages (the backward forms it from the
            per-row ``g . out`` it computes anyway).

    Returns:
        ``(B, h, L, F, d)`` in the dtype of ``query`` (computed in float32).

    Raises:
        ValueError: inputs the kernels do not take (see ``check_inputs``).
    """
    return _run_op(final_b_problem(query, key, value, index, scale, parent_width),
                   torch.ops.flatten_mm.qt_final_level_b, query, key, value, index,
                   scale, parent_width)[0]


def _final_level_problem(query, key, value, index, parent_width) -> Optional[str]:
    """Why the fused final-level kernels cannot take these inputs (``None`` if they can)."""
    why = check_inputs(query, key, index, True, parent_width)
    if why is None and value.shape != key.shape:
        why = f'value {tuple(value.shape)} does not match key {tuple(key.shape)}'
    if why is None:
        why = check_inputs(query, value, index, True, parent_width)
    if why is None:
        why = shared_memory_problem('quadtree', lambda: limit_keys(
            _num_candidates(index, parent_width), query.shape[-1], key.dtype, 'final_level'),
            query.device)
    return why


def final_b_problem(query, key, value, index, scale, parent_width) -> Optional[str]:
    """``_final_level_problem`` and B's ``scale`` (one float32 element, or ``None``)."""
    why = _final_level_problem(query, key, value, index, parent_width)
    if why is None and scale is not None:
        if scale.numel() != 1 or scale.dtype != torch.float32:
            why = (f'scale must be a one-element float32 tensor, got {tuple(scale.shape)} '
                   f'{scale.dtype}')
        else:
            why = device_problem((query, scale), __name__)
    return why


def final_a_problem(query, key, value, index, prev_score, parent_width) -> Optional[str]:
    """``_final_level_problem`` and A's ``prev_score`` (``(B, h, L, K / 4)``, query dtype)."""
    why = _final_level_problem(query, key, value, index, parent_width)
    if why is None:
        shape = (*index.shape[:3], _num_candidates(index, parent_width) // 4)
        if not parent_width and index.shape[-1] % 4:
            why = f'{index.shape[-1]} candidates, not groups of 4'
        elif prev_score.shape != shape:
            why = f'prev_score {tuple(prev_score.shape)}, expected {shape}'
        elif prev_score.dtype != query.dtype:
            why = f'prev_score dtype {prev_score.dtype}, query {query.dtype}'
        else:
            why = device_problem((query, prev_score), __name__)
    return why


def final_level_a_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         index: torch.Tensor, prev_score: torch.Tensor,
                         parent_width: int = 0) -> torch.Tensor:
    """Variant A's final level in one kernel::

        scores = gathered_scores(query, key, index)                     # (B, h, L, F, K)
        attn = softmax(scores.unflatten(-1, (K // 4, 4)), -1)           # within groups of 4
        attn = (attn * prev_score[:, :, :, None, :, None]).flatten(-2)
        out = gathered_messages(attn, value, index)

    without writing the ``(B, h, L, F, K)`` scores or weights (differentiable in ``query``,
    ``key``, ``value`` and ``prev_score``; the backward recomputes the 4-wide softmax).

    Args:
        query: ``(B, h, L, F, d)`` child queries (already multiplied by the temperature).
        key: ``(B, h, M, d)`` keys of the level.
        value: ``(B, h, M, d)`` values of the level.
        index: ``(B, h, L, K)`` candidate rows: ``K // 4`` groups of 4 consecutive
            children of one candidate parent (as ``_child_candidates`` orders them), or
            with ``parent_width`` the ``(B, h, L, K // 4)`` candidate parents' cells.
        parent_width: 0, or the width of the coarser grid ``index`` holds cells of.
        prev_score: ``(B, h, L, K // 4)`` the coarser level's weight of each candidate
            parent, in the dtype of ``query``.

    Returns:
        ``(B, h, L, F, d)`` in the dtype of ``query`` (computed in float32).

    Raises:
        ValueError: inputs the kernels do not take (see ``check_inputs``).
    """
    return _run_op(final_a_problem(query, key, value, index, prev_score, parent_width),
                   torch.ops.flatten_mm.qt_final_level_a, query, key, value, index,
                   prev_score, parent_width)


# ----------------------------------------------------------------------------------------
# the final level on projected maps: the backward recomputes the query / key (/ value)


def _projected_map(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   hw: Tuple[int, int]) -> torch.Tensor:
    """``tokens_as_map(F.linear(x, weight, bias), hw)``: a map as ``Projections`` defines it."""
    return tokens_as_map(F.linear(x, weight, bias), hw)


class _ProjectedFinalLevel(torch.autograd.Function):
    """The fused final level (``qt_final_level_b``, or ``qt_final_level_a`` when
    ``grouped``) on a query, key (and value) that are projections of one input ``x``: the
    forward runs the op on the given tensors and keeps ``x`` and the weights, the backward
    recomputes the tensors from them (as ``quadtree_attention_core`` formed them) and runs
    the backward op (see ``final_level_projected_triton``)."""

    @staticmethod
    def forward(ctx, query, key, value, index, extra, x, wq, bq, wk, bk, wv, bv, hw,
                num_heads, temp, parent_width, grouped):
        if grouped:
            out = torch.ops.flatten_mm.qt_final_level_a(query, key, value, index, extra,
                                                        parent_width)
            stats = None
        else:
            out, stats = torch.ops.flatten_mm.qt_final_level_b(query, key, value, index,
                                                               extra, parent_width)
        # (the value only when it is not recomputed: B's, kept by its value branch anyway)
        ctx.save_for_backward(x, wq, bq, wk, bk, wv, bv, value if wv is None else None,
                              index, stats, extra)
        ctx.args = (hw, num_heads, temp, parent_width, grouped, key.dtype, value.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, wq, bq, wk, bk, wv, bv, value, index, stats, extra = ctx.saved_tensors
        hw, h, temp, pw, grouped, key_dtype, value_dtype = ctx.args
        # (the projections ran in the dtype of x and the weights: no autocast here, even if
        # the backward is called inside an autocast region)
        double = records_backward_graph()  # (create_graph: the registered formula)
        with torch.autocast(device_type=x.device.type, enabled=False), \
                torch.set_grad_enabled(double):
            query = level_queries(_projected_map(x, wq, bq, hw), h, temp)
            key = to_heads(_projected_map(x, wk, bk, hw), h).to(key_dtype)
            if wv is not None:
                value = to_heads(_projected_map(x, wv, bv, hw), h).to(value_dtype)
        if double:
            # (differentiated with respect to the recomputed maps, whose graph leads to x
            # and the weights as the forward's maps did)
            grads = differentiate_reference(
                'qt_final_a' if grouped else 'qt_final_b',
                (query, key, value, index, extra, pw), ctx.needs_input_grad[:3] + (
                    False, ctx.needs_input_grad[4], False), (grad, ))
            return tuple(grads[:3]) + (None, grads[4]) + (None, ) * 12
        grad = kernel_grad(grad)
        if grouped:
            dq, dk, dv, dextra = torch.ops.flatten_mm.qt_final_level_a_backward(
                grad, query, key, value, index, extra, pw)
        else:
            dq, dk, dv, dextra = torch.ops.flatten_mm.qt_final_level_b_backward(
                grad, query, key, value, index, stats, extra, pw)
            dextra = dextra if extra is not None else None
        return (dq, dk, dv, None, dextra) + (None, ) * 12


def _projections_problem(projections, query: torch.Tensor, key: torch.Tensor,
                         hw_shape: Tuple[int, int], num_heads: int) -> Optional[str]:
    """Why ``projections`` cannot be the source of these level tensors (shapes and dtypes;
    ``None`` if they can)."""
    x = projections.x
    B, h, L, nf, d = query.shape
    H, W = hw_shape
    if h != num_heads:
        return f'query has {h} heads, num_heads is {num_heads}'
    if x.dim() != 3 or x.shape[0] != B or x.shape[1] != H * W:
        return f'projection input {tuple(x.shape)} is not ({B}, {H * W}, C_in)'
    if L * nf != H * W or key.shape[2] != H * W:
        return f'a {H}x{W} map does not match query {tuple(query.shape)}'
    pairs = [('query', projections.query), ('key', projections.key)]
    if projections.value is not None:
        pairs.append(('value', projections.value))
    for name, (w, b) in pairs:
        if w.shape != (h * d, x.shape[2]) or b is not None and b.shape != (h * d, ):
            return (f'{name} projection {tuple(w.shape)} (bias '
                    f'{None if b is None else tuple(b.shape)}) is not {x.shape[2]} -> {h * d}')
        if w.dtype != x.dtype or b is not None and b.dtype != x.dtype:
            return f'{name} projection dtype {w.dtype} differs from its input ({x.dtype})'
    return device_problem((query, x), __name__)


def final_level_projected_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 index: torch.Tensor, extra: Optional[torch.Tensor],
                                 parent_width: int, projections, hw_shape: Tuple[int, int],
                                 num_heads: int, temp: float, variant: str) -> torch.Tensor:
    """The fused final level, ``final_level_b_triton(query, key, value, index, extra,
    parent_width)`` (``variant='B'``, ``extra`` the level weight or ``None``) or
    ``final_level_a_triton(..., extra, ...)`` (``'A'``, ``extra`` the prev_score), for a
    query, key (and value) that are projections of one input (``projections``, a
    ``quadtree_level.Projections``): the same output and gradients, but the backward
    recomputes them (one GEMM each, and the layout: ``query`` must be
    ``level_queries(query map, num_heads, temp)``, ``key`` / ``value`` the ``_to_heads``
    of their maps, in their own dtype) instead of keeping them, so a training step keeps
    no float32 grouped queries or key map of the finest level (``x`` is kept by the
    projections anyway).

    Raises:
        ValueError: inputs the kernels do not take, or projections whose shapes / dtypes
            cannot give these tensors (the values themselves are the caller's promise).
    """
    if variant not in ('A', 'B'):
        raise ValueError(f"variant must be 'A' or 'B', got {variant!r}")
    grouped = variant == 'A'
    why = (final_a_problem if grouped else final_b_problem)(query, key, value, index, extra,
                                                              parent_width)
    if why is None:
        why = _projections_problem(projections, query, key, hw_shape, num_heads)
    if why is not None:
        raise ValueError(f'QuadTree Triton kernels: {why}')
    wv, bv = projections.value if projections.value is not None else (None, None)
    with torch.autocast(device_type=query.device.type, enabled=False):
        return _ProjectedFinalLevel.apply(
            query, key, value, index, extra, projections.x, *projections.query,
            *projections.key, wv, bv, (int(hw_shape[0]), int(hw_shape[1])), int(num_heads),
            float(temp), int(parent_width), grouped)


__all__ = ['gathered_scores_triton', 'gathered_messages_triton', 'final_level_b_triton',
           'final_level_a_triton', 'final_level_projected_triton', 'check_inputs',
           'tile_fits', 'INTERPRETED']
