"""Fused Triton kernels of the FLA core (``focused_linear_core``), forward and backward.

The same maths as ``focused_linear_attention.focused_linear_core`` (the PyTorch path,
which stays the fallback and the reference)::

    base = (ReLU(x) + 1e-6) / softplus(scale)        # x = q, or k + k_pos
    phi(x) = ||base|| / ||base^p|| * base^p           # norms over all C channels
    out_i = phi(q_i) KV / (phi(q_i) . mean_j phi(k_j) + 1e-6),  KV = sum_j phi(k_j)^T v_j / n

per head, computed in float32 whatever the input dtype (fp32 / bf16 / fp16). The power is
taken of ``base / max(base)`` (``phi`` is invariant to that scale), so no intermediate can
overflow, not even float32 ``||base^p||`` for large activations.

Forward, two kernels and one reduction:

1. ``_fla_kv_fwd`` (grid: token chunks x batch x heads) reads ``k`` (+ ``k_pos``), ``v``
   once, forms ``phi(k)`` in registers and accumulates per-chunk partial sums of
   ``phi(k)^T v`` and ``phi(k)``; the chunks are summed in PyTorch (deterministic).
2. ``_fla_out_fwd`` (grid: token blocks x batch) reads ``q`` once and writes the
   normalised ``phi(q) KV`` of every head, head-merged ``(B, N, C)``, plus an optional
   residual read in the same pass (the operators' DWC branch: one add kernel less, and
   one rounding in half precision).

Backward (recompute-based, nothing ``(B, N, C)`` is saved but the inputs):
``_fla_q_bwd`` gives ``dphi(q)`` and partial ``dKV``, ``dmean``; ``_fla_k_bwd`` gives
``dphi(k)`` and ``dv``; ``_focus_bwd`` (twice) turns ``dphi`` into ``dq`` / ``dk`` and a
per-block partial of the ``softplus`` scale gradient. The gradient of ``k_pos`` is the batch
sum of ``dk``.

Both directions are ``torch.library.triton_op`` custom ops (``flatten_mm::fla_core`` and
``flatten_mm::fla_core_backward``) joined by ``register_autograd``, so autograd treats the
forward as one function with its backward and ``torch.compile`` sees one node each.

FLatten-PVT's layers without key reduction (the released models) go one step further,
``fla_projected_triton``: the ``kv`` projection, the DWC and the core form one
``autograd.Function`` whose backward recomputes ``k, v`` from the projection's input (one
GEMM) instead of keeping the ``(B, N, 2C)`` projection for the backward, adds the DWC's
``dv`` inside the key kernel and writes ``[dk | dv]`` as the projection's gradient
(``flatten_mm::fla_core_backward_packed``): no add, no concatenation, and the layer keeps
the activations of a softmax layer with reduced keys (its input, ``q`` and its output).
FLatten-Swin's FLA layers do the same with their ``qkv`` projection (``q`` recomputed
too).

On CUDA tensors the kernels are compiled by Triton; on CPU tensors they run only under
Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``) before this
module is imported (Triton reads it when the kernels are decorated) -- the tests do so.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .autograd_paths import (autocast_operands, differentiate_reference, records_backward_graph,
                             reference)
from .layout import map_as_tokens, tokens_as_map
from .specialisation import kernel_grad
from .triton_common import (INTERPRETED, cast_rne, device_problem, on_tensor_device, relu,
                            shared_memory_problem)

_EPS = 1e-6  # the ReLU floor and the normaliser's epsilon of FLA
_MAX_HEAD_DIM = 128  # register budget of the per-head tiles


# ----------------------------------------------------------------------------------------
# kernels


@triton.jit
def _row_stats(x_ptr, pos_ptr, inv_s_ptr, row_off, pos_row_off, rmask, C, sxc, spc,
               HAS_POS: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per token of a row block: ``m = max(base)``, ``||base||`` and ``||(base/m)^p||``
    over all ``C`` channels, in chunks of ``BLOCK_C`` with running rescaling."""
    m = tl.zeros(row_off.shape, tl.float32) + 1e-30
    s_b = tl.zeros(row_off.shape, tl.float32)  # sum (base/m)^2
    s_y = tl.zeros(row_off.shape, tl.float32)  # sum (base/m)^(2p)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        msk = rmask[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + row_off[:, None] + cols[None, :] * sxc, mask=msk,
                    other=0.).to(tl.float32)
        if HAS_POS:
            x += tl.load(pos_ptr + pos_row_off[:, None] + cols[None, :] * spc, mask=msk,
                         other=0.).to(tl.float32)
        inv_s = tl.load(inv_s_ptr + cols, mask=cols < C, other=0.)
        base = tl.where(msk, (relu(x) + 1e-6) * inv_s[None, :], 0.)
        m_new = tl.maximum(m, tl.max(base, axis=1))
        a = m / m_new
        t = base / m_new[:, None]
        a2 = a * a
        t2 = t * t
        ap = a2
        tp = t2
        for _ in tl.static_range(P - 1):
            ap = ap * a2
            tp = tp * t2
        s_b = s_b * a2 + tl.sum(t2, axis=1)
        s_y = s_y * ap + tl.sum(tp, axis=1)
        m = m_new
    m = tl.where(rmask, m, 1.)
    nb = tl.where(rmask, m * tl.sqrt(s_b), 1.)
    ny = tl.where(rmask, tl.sqrt(s_y), 1.)
    return m, nb, ny


@triton.jit
def _head_features(x_ptr, pos_ptr, inv_s_ptr, row_off, pos_row_off, msk, cols, m, C, sxc,
                   spc, HAS_POS: tl.constexpr, P: tl.constexpr):
    """``x`` (+ pos), ``base`` and ``t^p`` (``t = base / m``) of one head's channels."""
    x = tl.load(x_ptr + row_off[:, None] + cols[None, :] * sxc, mask=msk, other=0.).to(tl.float32)
    if HAS_POS:
        x += tl.load(pos_ptr + pos_row_off[:, None] + cols[None, :] * spc, mask=msk,
                     other=0.).to(tl.float32)
    inv_s = tl.load(inv_s_ptr + cols, mask=cols < C, other=0.)
    base = tl.where(msk, (relu(x) + 1e-6) * inv_s[None, :], 0.)
    t = base / m[:, None]
    y = t
    for _ in tl.static_range(P - 1):
        y = y * t
    return x, base, t, y


@triton.jit
def _fla_kv_fwd(k_ptr, pos_ptr, v_ptr, inv_s_ptr, kv_ptr, ks_ptr,
                n, C, chunk, skb, skn, skc, spn, spc, svb, svn, svc,
                H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_C: tl.constexpr, P: tl.constexpr, HAS_POS: tl.constexpr,
                PREC: tl.constexpr):
    """Partial ``sum phi(k)^T v`` ``(BD, BD)`` and ``sum phi(k)`` ``(BD,)`` of one token
    chunk, batch element and head, stored at ``[chunk, b, h]``."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    B = tl.num_programs(1)
    dcol = tl.arange(0, BD)
    cols = h * D + dcol
    cmask = dcol < D
    kv = tl.zeros((BD, BD), tl.float32)
    ks = tl.zeros((BD,), tl.float32)
    k_b = k_ptr + b.to(tl.int64) * skb
    v_b = v_ptr + b.to(tl.int64) * svb
    start = s * chunk
    end = tl.minimum(start + chunk, n)
    for r0 in range(start, end, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        rmask = rows < end
        m, nb, ny = _row_stats(k_b, pos_ptr, inv_s_ptr, rows * skn, rows * spn, rmask, C,
                               skc, spc, HAS_POS, P, BLOCK_C)
        msk = rmask[:, None] & cmask[None, :]
        _, _, _, y = _head_features(k_b, pos_ptr, inv_s_ptr, rows * skn, rows * spn, msk, cols,
                                    m, C, skc, spc, HAS_POS, P)
        phi = y * (nb / ny)[:, None]
        vv = tl.load(v_b + rows[:, None] * svn + cols[None, :] * svc, mask=msk,
                     other=0.).to(tl.float32)
        kv += tl.dot(tl.trans(phi), vv, input_precision=PREC)
        ks += tl.sum(phi, axis=0)
    part = (s * B + b) * H + h
    tl.store(kv_ptr + part * BD * BD + dcol[:, None] * BD + dcol[None, :], kv)
    tl.store(ks_ptr + part * BD + dcol, ks)


@triton.jit
def _fla_out_fwd(q_ptr, inv_s_ptr, kv_ptr, ks_ptr, r_ptr, o_ptr, N, C, inv_n,
                 sqb, sqn, sqc, srb, srn, src, sob, son, soc,
                 H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_C: tl.constexpr, P: tl.constexpr, HAS_RES: tl.constexpr,
                 PREC: tl.constexpr):
    """``out = phi(q) KV / (phi(q) . mean(phi(k)) + 1e-6) [+ residual]`` of every head,
    for one block of query tokens; ``kv_ptr`` / ``ks_ptr`` hold the (unscaled) sums
    ``(B, H, BD, BD)`` / ``(B, H, BD)``; the residual (``r_ptr``, any dtype, e.g. the DWC
    branch) is added in float32 before the one rounding to the output dtype."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    dcol = tl.arange(0, BD)
    cmask = dcol < D
    msk = rmask[:, None] & cmask[None, :]
    q_b = q_ptr + b.to(tl.int64) * sqb
    o_b = o_ptr + b.to(tl.int64) * sob
    m, nb, ny = _row_stats(q_b, q_b, inv_s_ptr, rows * sqn, rows * sqn, rmask, C, sqc, sqc,
                           False, P, BLOCK_C)
    r = nb / ny
    for h in range(H):
        cols = h * D + dcol
        _, _, _, y = _head_features(q_b, q_b, inv_s_ptr, rows * sqn, rows * sqn, msk, cols, m,
                                    C, sqc, sqc, False, P)
        phi = y * r[:, None]
        hb = b * H + h
        kv = tl.load(kv_ptr + hb * BD * BD + dcol[:, None] * BD + dcol[None, :]) * inv_n
        km = tl.load(ks_ptr + hb * BD + dcol) * inv_n
        num = tl.dot(phi, kv, input_precision=PREC)
        den = tl.sum(phi * km[None, :], axis=1) + 1e-6
        out = num / den[:, None]
        if HAS_RES:
            out += tl.load(r_ptr + b.to(tl.int64) * srb + rows[:, None] * srn
                           + cols[None, :] * src, mask=msk, other=0.).to(tl.float32)
        tl.store(o_b + rows[:, None] * son + cols[None, :] * soc,
                 cast_rne(out, o_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _fla_q_bwd(q_ptr, g_ptr, inv_s_ptr, kv_ptr, ks_ptr, dphi_ptr, dkv_ptr, dks_ptr,
               N, C, chunk, inv_n, sqb, sqn, sqc, sgb, sgn, sgc,
               H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_C: tl.constexpr, P: tl.constexpr, PREC: tl.constexpr):
    """Query side of the backward, one token chunk, batch element and head: writes
    ``dL/dphi(q)`` (float32, contiguous ``(B, N, C)``) and partial ``dL/dKV`` and
    ``dL/dmean`` (of the ``1/n``-scaled ``KV`` and ``mean``) at ``[chunk, b, h]``."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    B = tl.num_programs(1)
    dcol = tl.arange(0, BD)
    cols = h * D + dcol
    cmask = dcol < D
    hb = b * H + h
    kv = tl.load(kv_ptr + hb * BD * BD + dcol[:, None] * BD + dcol[None, :]) * inv_n
    km = tl.load(ks_ptr + hb * BD + dcol) * inv_n
    dkv = tl.zeros((BD, BD), tl.float32)
    dkm = tl.zeros((BD,), tl.float32)
    q_b = q_ptr + b.to(tl.int64) * sqb
    g_b = g_ptr + b.to(tl.int64) * sgb
    dphi_b = dphi_ptr + b.to(tl.int64) * N * C
    start = s * chunk
    end = tl.minimum(start + chunk, N)
    for r0 in range(start, end, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        rmask = rows < end
        msk = rmask[:, None] & cmask[None, :]
        m, nb, ny = _row_stats(q_b, q_b, inv_s_ptr, rows * sqn, rows * sqn, rmask, C, sqc,
                               sqc, False, P, BLOCK_C)
        _, _, _, y = _head_features(q_b, q_b, inv_s_ptr, rows * sqn, rows * sqn, msk, cols, m,
                                    C, sqc, sqc, False, P)
        phi = y * (nb / ny)[:, None]
        num = tl.dot(phi, kv, input_precision=PREC)
        den = tl.sum(phi * km[None, :], axis=1) + 1e-6
        out = num / den[:, None]
        g = tl.load(g_b + rows[:, None] * sgn + cols[None, :] * sgc, mask=msk,
                    other=0.).to(tl.float32)
        dnum = g / den[:, None]
        dden = -tl.sum(g * out, axis=1) / den
        dphi = tl.dot(dnum, tl.trans(kv), input_precision=PREC) + dden[:, None] * km[None, :]
        tl.store(dphi_b + rows[:, None] * C + cols[None, :], dphi, mask=msk)
        dkv += tl.dot(tl.trans(phi), dnum, input_precision=PREC)
        dkm += tl.sum(dden[:, None] * phi, axis=0)
    part = (s * B + b) * H + h
    tl.store(dkv_ptr + part * BD * BD + dcol[:, None] * BD + dcol[None, :], dkv)
    tl.store(dks_ptr + part * BD + dcol, dkm)


@triton.jit
def _fla_k_bwd(k_ptr, pos_ptr, v_ptr, inv_s_ptr, dkv_ptr, dks_ptr, dphi_ptr, e_ptr, dv_ptr,
               n, C, inv_n, skb, skn, skc, spn, spc, svb, svn, svc, seb, sen, sec,
               sdvb, sdvn, sdvc,
               H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_C: tl.constexpr, P: tl.constexpr, HAS_POS: tl.constexpr,
               HAS_EXTRA: tl.constexpr, PREC: tl.constexpr):
    """Key side of the backward, one block of key tokens, batch element and head:
    ``dphi(k) = (v dKV^T + dmean) / n`` (float32 ``(B, n, C)``) and ``dv = phi(k) dKV / n``
    [+ the gradient ``e_ptr`` that v receives elsewhere, e.g. from the DWC branch, added in
    float32 before the one rounding]."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n
    dcol = tl.arange(0, BD)
    cols = h * D + dcol
    cmask = dcol < D
    msk = rmask[:, None] & cmask[None, :]
    hb = b * H + h
    dkv = tl.load(dkv_ptr + hb * BD * BD + dcol[:, None] * BD + dcol[None, :])
    dkm = tl.load(dks_ptr + hb * BD + dcol)
    k_b = k_ptr + b.to(tl.int64) * skb
    m, nb, ny = _row_stats(k_b, pos_ptr, inv_s_ptr, rows * skn, rows * spn, rmask, C, skc, spc,
                           HAS_POS, P, BLOCK_C)
    _, _, _, y = _head_features(k_b, pos_ptr, inv_s_ptr, rows * skn, rows * spn, msk, cols, m,
                                C, skc, spc, HAS_POS, P)
    phi = y * (nb / ny)[:, None]
    vv = tl.load(v_ptr + b.to(tl.int64) * svb + rows[:, None] * svn + cols[None, :] * svc,
                 mask=msk, other=0.).to(tl.float32)
    dphi = (tl.dot(vv, tl.trans(dkv), input_precision=PREC) + dkm[None, :]) * inv_n
    tl.store(dphi_ptr + b.to(tl.int64) * n * C + rows[:, None] * C + cols[None, :], dphi,
             mask=msk)
    dv = tl.dot(phi, dkv, input_precision=PREC) * inv_n
    if HAS_EXTRA:
        dv += tl.load(e_ptr + b.to(tl.int64) * seb + rows[:, None] * sen + cols[None, :] * sec,
                      mask=msk, other=0.).to(tl.float32)
    tl.store(dv_ptr + b.to(tl.int64) * sdvb + rows[:, None] * sdvn + cols[None, :] * sdvc,
             cast_rne(dv, dv_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _focus_bwd(x_ptr, pos_ptr, inv_s_ptr, dphi_ptr, dx_ptr, dsp_ptr, N, C,
               sxb, sxn, sxc, spn, spc, sdb, sdn, sdc,
               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, P: tl.constexpr,
               HAS_POS: tl.constexpr, KEEP_F32: tl.constexpr):
    """``dL/dphi`` -> ``dL/dx`` through the focusing function, for one block of tokens
    (all channels). ``dphi_ptr``: contiguous float32 ``(B, N, C)``; ``dL/dx`` goes to
    ``dx_ptr`` (strides ``sd*``, rounded to its dtype; it may be ``dphi_ptr`` itself) and,
    with ``KEEP_F32``, also in float32 over ``dphi`` (for the positional table's sum);
    ``dsp_ptr[block, :]`` receives the block's ``sum dL/dbase * (ReLU(x)+1e-6)`` (the
    gradient of ``1 / softplus(scale)``)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    x_b = x_ptr + b.to(tl.int64) * sxb
    d_b = dphi_ptr + b.to(tl.int64) * N * C
    m, nb, ny = _row_stats(x_b, pos_ptr, inv_s_ptr, rows * sxn, rows * spn, rmask, C, sxc, spc,
                           HAS_POS, P, BLOCK_C)
    r = nb / ny
    # dL/dr = dphi . y (over all channels)
    dr = tl.zeros((BLOCK_N,), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        msk = rmask[:, None] & (cols < C)[None, :]
        _, _, _, y = _head_features(x_b, pos_ptr, inv_s_ptr, rows * sxn, rows * spn, msk, cols,
                                    m, C, sxc, spc, HAS_POS, P)
        dphi = tl.load(d_b + rows[:, None] * C + cols[None, :], mask=msk, other=0.)
        dr += tl.sum(dphi * y, axis=1)
    c_y = dr * r / (ny * ny)  # through ||y||
    c_b = dr / (ny * nb)  # through ||base||
    blk = b * tl.num_programs(0) + pid
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        msk = rmask[:, None] & (cols < C)[None, :]
        x, base, t, y = _head_features(x_b, pos_ptr, inv_s_ptr, rows * sxn, rows * spn, msk,
                                       cols, m, C, sxc, spc, HAS_POS, P)
        dphi = tl.load(d_b + rows[:, None] * C + cols[None, :], mask=msk, other=0.)
        dy = r[:, None] * dphi - c_y[:, None] * y
        tp1 = tl.full(t.shape, 1., tl.float32)
        for _ in tl.static_range(P - 1):
            tp1 = tp1 * t
        dbase = dy * (P * tp1) / m[:, None] + c_b[:, None] * base
        dbase = tl.where(msk, dbase, 0.)
        inv_s = tl.load(inv_s_ptr + cols, mask=cols < C, other=0.)
        dx = tl.where(x <= 0., 0., dbase * inv_s[None, :])  # (NaN passes, as in torch)
        if KEEP_F32:
            tl.store(d_b + rows[:, None] * C + cols[None, :], dx, mask=msk)
        tl.store(dx_ptr + b.to(tl.int64) * sdb + rows[:, None] * sdn + cols[None, :] * sdc,
                 cast_rne(dx, dx_ptr.dtype.element_ty), mask=msk)
        tl.store(dsp_ptr + blk * C + cols, tl.sum(dbase * (relu(x) + 1e-6), axis=0),
                 mask=cols < C)


# ----------------------------------------------------------------------------------------
# launch helpers


def _cfg(C: int, d: int, precision: Optional[str] = None) -> dict:
    """Tile sizes: ``BD`` the padded head dim, ``BLOCK_N`` tokens, ``BLOCK_C`` channels of
    the all-channel loops (small, so that the tests cover several channel chunks and
    the per-thread registers of ``_focus_bwd`` stay bounded); 8 warps (fewer spill in
    ``docs/benchmarks/kernel_limits.md``); matmul ``precision`` (``'ieee'`` / ``'tf32'``,
    default ``matmul_precision()``)."""
    bd = max(16, triton.next_power_of_2(d))
    return dict(BD=bd, BLOCK_N=16 if INTERPRETED else 64 if bd <= 32 else 32,
                BLOCK_C=min(32, max(16, triton.next_power_of_2(C))),
                PREC=precision or 'ieee', num_warps=_NUM_WARPS)


def matmul_precision(device: torch.device) -> str:
    """``'tf32'`` where PyTorch's float32 matmuls may use TF32 and the GPU has it (compute
    capability 8.0 and later), else ``'ieee'``: the kernels' products follow PyTorch's."""
    if not torch.backends.cuda.matmul.allow_tf32:
        return 'ieee'
    if device.type == 'cuda' and torch.cuda.get_device_capability(device) < (8, 0):
        return 'ieee'
    return 'tf32'


_NUM_WARPS = 8


def tile_tokens(C: int, d: int) -> int:
    """Tokens per tile (``BLOCK_N``) of the kernels for ``C`` channels of head dim ``d``."""
    return _cfg(C, d)['BLOCK_N']


def _chunk(n: int, groups: int, block: int) -> Tuple[int, int]:
    """Token chunk per program and number of chunks, so that ``groups * chunks`` fills the
    GPU (about 512 programs) without tiny chunks. Interpreted: 2 chunks, so that the tests
    cover both the partial sums over chunks and several blocks per chunk."""
    target = 2 if INTERPRETED else max(1, 512 // max(groups, 1))
    chunks = max(1, min(triton.cdiv(n, block), target))
    chunk = triton.cdiv(triton.cdiv(n, chunks), block) * block
    return chunk, triton.cdiv(n, chunk)


def _inv_softplus(scale: torch.Tensor) -> torch.Tensor:
    return (1.0 / F.softplus(scale.detach().reshape(-1).float())).contiguous()


def _pos_args(k_pos: Optional[torch.Tensor], like: torch.Tensor):
    if k_pos is None:
        return like, 0, 0, False
    pos = k_pos.reshape(k_pos.shape[-2], k_pos.shape[-1])
    return pos, pos.stride(0), pos.stride(1), True


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                 num_heads: int, focusing_factor: int, k_pos: Optional[torch.Tensor],
                 residual: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why the kernels cannot take these inputs (``None`` if they can)."""
    if not (q.dim() == k.dim() == v.dim() == 3):
        return (f'q, k, v must be (B, N, C), got {tuple(q.shape)}, {tuple(k.shape)}, '
                f'{tuple(v.shape)}')
    B, N, C = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != C:
        return f'k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}'
    if k.shape[1] == 0 or N == 0 or B == 0:
        return 'empty token set'
    if B > 65535 or num_heads > 65535:  # CUDA grid limit of the 2nd / 3rd dimension
        return f'batch {B} (windows folded in) or heads {num_heads} above 65535'
    if scale.numel() != C:
        return f'scale has {scale.numel()} entries, expected {C}'
    if k_pos is not None and k_pos.numel() != k.shape[1] * C:
        return f'k_pos {tuple(k_pos.shape)} does not match k {tuple(k.shape)}'
    if C % num_heads:
        return f'C={C} is not divisible by num_heads={num_heads}'
    if C // num_heads > _MAX_HEAD_DIM:
        return f'head dim {C // num_heads} > {_MAX_HEAD_DIM}'
    if (not isinstance(focusing_factor, int) or isinstance(focusing_factor, bool)
            or focusing_factor < 1):
        return f'focusing_factor must be an int >= 1, got {focusing_factor!r}'
    if residual is not None and residual.shape != q.shape:
        return f'residual {tuple(residual.shape)} does not match q {tuple(q.shape)}'
    tensors = [t for t in (q, k, v, scale, k_pos, residual) if t is not None]
    bad = [t.dtype for t in (q, k, v, residual) if t is not None and t.dtype not in (
        torch.float32, torch.bfloat16, torch.float16)]
    if bad:
        return f'dtype {bad[0]} (the kernels take float32 / bfloat16 / float16)'
    return device_problem(tensors, __name__) or shared_memory_problem(
        'fla', lambda: limit_keys(C, num_heads, v.dtype, matmul_precision(q.device)), q.device)


_KERNELS = {'_fla_kv_fwd': _fla_kv_fwd, '_fla_out_fwd': _fla_out_fwd, '_fla_q_bwd': _fla_q_bwd,
            '_fla_k_bwd': _fla_k_bwd, '_focus_bwd': _focus_bwd}
#: pointer arguments in the input / output dtype (all others are float32)
_IO_POINTERS = ('q_ptr', 'k_ptr', 'v_ptr', 'r_ptr', 'o_ptr', 'g_ptr', 'e_ptr', 'dv_ptr',
                'x_ptr', 'dx_ptr')


def aot_specs(channels: int, num_heads: int, focusing_factor: int, dtype: torch.dtype,
              has_pos: bool = True, has_res: bool = True, precision: str = 'ieee') -> list:
    """What the launches of one call compile: ``(name, kernel, signature, constexprs,
    options)`` per kernel, for ahead-of-time compilation without a GPU
    (``triton.compile(ASTSource(kernel, signature, constexprs), target, options)``, see
    dev/kernel_limits.py). Needs the kernels compiled, not interpreted."""
    if INTERPRETED:
        raise RuntimeError('aot_specs needs the compiled kernels (TRITON_INTERPRET unset)')
    io = {torch.float32: '*fp32', torch.bfloat16: '*bf16', torch.float16: '*fp16'}[dtype]
    cfg = _cfg(channels, channels // num_heads, precision)
    options = dict(num_warps=cfg.pop('num_warps'))
    const = dict(cfg, H=num_heads, D=channels // num_heads, P=focusing_factor,
                 HAS_POS=has_pos, HAS_RES=has_res, HAS_EXTRA=has_res, KEEP_F32=has_pos)
    specs = []
    for name, fn in _KERNELS.items():
        sig, cst = {}, {}
        for arg in fn.arg_names:
            if arg in const:
                sig[arg], cst[arg] = 'constexpr', const[arg]
            elif arg.endswith('_ptr'):
                sig[arg] = io if arg in _IO_POINTERS else '*fp32'
            else:
                sig[arg] = 'fp32' if arg == 'inv_n' else 'i32'
        specs.append((name, fn, sig, cst, options))
    return specs


def limit_key(name: str, const: dict, options: dict, dtype: torch.dtype) -> str:
    """The row of the ahead-of-time limit table (``ops/kernel_limits.json``) of one kernel
    specialisation: what sets its shared memory and registers."""
    c = {k: const.get(k, '-') for k in ('PREC', 'BD', 'BLOCK_N', 'BLOCK_C')}
    return (f"{name}|{str(dtype).replace('torch.', '')}|{c['PREC']}|BD{c['BD']}"
            f"|BN{c['BLOCK_N']}|BC{c['BLOCK_C']}|w{options['num_warps']}")


def limit_keys(channels: int, num_heads: int, dtype: torch.dtype, precision: str) -> list:
    """``limit_key`` of every kernel a call with these settings launches."""
    return [limit_key(name, const, options, dtype) for name, _, _, const, options
            in aot_specs(channels, num_heads, 3, dtype, precision=precision)]


# ----------------------------------------------------------------------------------------
# custom ops


@on_tensor_device
def _forward_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                     k_pos: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                     num_heads: int, focusing_factor: int):
    """The forward launches: ``out`` (dtype of ``v``) and the float32 sums ``KV``, ``K``
    (saved for the backward)."""
    B, N, C = q.shape
    n = k.shape[1]
    d = C // num_heads
    cfg = _cfg(C, d, matmul_precision(q.device))
    bd = cfg['BD']
    inv_s = _inv_softplus(scale)
    pos, spn, spc, has_pos = _pos_args(k_pos, k)
    chunk, chunks = _chunk(n, B * num_heads, cfg['BLOCK_N'])
    kv_p = q.new_empty((chunks, B, num_heads, bd, bd), dtype=torch.float32)
    ks_p = q.new_empty((chunks, B, num_heads, bd), dtype=torch.float32)
    torch.library.wrap_triton(_fla_kv_fwd)[(chunks, B, num_heads)](
        k, pos, v, inv_s, kv_p, ks_p, n, C, chunk, *k.stride(), spn, spc, *v.stride(),
        H=num_heads, D=d, P=focusing_factor, HAS_POS=has_pos, **cfg)
    kv = kv_p.sum(0)
    ks = ks_p.sum(0)
    out = torch.empty((B, N, C), dtype=v.dtype, device=q.device)
    res = q if residual is None else residual
    torch.library.wrap_triton(_fla_out_fwd)[(triton.cdiv(N, cfg['BLOCK_N']), B)](
        q, inv_s, kv, ks, res, out, N, C, 1.0 / n, *q.stride(), *res.stride(), *out.stride(),
        H=num_heads, D=d, P=focusing_factor, HAS_RES=residual is not None, **cfg)
    return out, kv, ks


@torch.library.triton_op('flatten_mm::fla_core', mutates_args=())
def _fla_core_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                 k_pos: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                 num_heads: int,
                 focusing_factor: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_kernels(q, k, v, scale, k_pos, residual, num_heads, focusing_factor)


@_fla_core_op.register_fake
def _(q, k, v, scale, k_pos, residual, num_heads, focusing_factor):
    B, N, C = q.shape
    bd = max(16, triton.next_power_of_2(C // num_heads))
    return (q.new_empty((B, N, C), dtype=v.dtype),
            q.new_empty((B, num_heads, bd, bd), dtype=torch.float32),
            q.new_empty((B, num_heads, bd), dtype=torch.float32))


@on_tensor_device
def _backward_kernels(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: torch.Tensor, k_pos: Optional[torch.Tensor], kv: torch.Tensor,
                      ks: torch.Tensor, num_heads: int, focusing_factor: int,
                      dv_extra: Optional[torch.Tensor] = None,
                      packed_out: Optional[torch.Tensor] = None):
    """The backward launches: ``dq, dk, dv`` (in the dtypes of ``q, k, v``), ``dscale``
    (float32 ``(C,)``) and ``dpos`` (float32 ``(n, C)``, empty without ``k_pos``).

    ``dv_extra``: a gradient of ``v`` from elsewhere (the DWC branch), added inside the key
    kernel. ``packed_out``: a ``(B, n, 2C)`` buffer receiving ``[dk | dv]``, or ``(B, N, 3C)``
    receiving ``[dq | dk | dv]`` (the gradient of a packed projection, so no concatenation
    is needed)."""
    B, N, C = q.shape
    n = k.shape[1]
    d = C // num_heads
    cfg = _cfg(C, d, matmul_precision(q.device))
    bd, bn = cfg['BD'], cfg['BLOCK_N']
    inv_s = _inv_softplus(scale)
    pos, spn, spc, has_pos = _pos_args(k_pos, k)
    # query side: dphi(q) and dKV, dmean (of the 1/n-scaled KV and mean)
    chunk, chunks = _chunk(N, B * num_heads, bn)
    dphi_q = torch.empty((B, N, C), dtype=torch.float32, device=q.device)
    dkv_p = q.new_empty((chunks, B, num_heads, bd, bd), dtype=torch.float32)
    dks_p = q.new_empty((chunks, B, num_heads, bd), dtype=torch.float32)
    torch.library.wrap_triton(_fla_q_bwd)[(chunks, B, num_heads)](
        q, grad, inv_s, kv, ks, dphi_q, dkv_p, dks_p, N, C, chunk, 1.0 / n, *q.stride(),
        *grad.stride(), H=num_heads, D=d, P=focusing_factor, **cfg)
    dkv = dkv_p.sum(0)
    dks = dks_p.sum(0)
    # key side: dphi(k), dv (+ dv_extra)
    dphi_k = torch.empty((B, n, C), dtype=torch.float32, device=q.device)
    parts = () if packed_out is None else packed_out.split(C, dim=-1)
    if parts:
        dk, dv = parts[-2:]
    else:
        dk = dphi_k if k.dtype == torch.float32 else torch.empty((B, n, C), dtype=k.dtype,
                                                                  device=q.device)
        dv = torch.empty((B, n, C), dtype=v.dtype, device=q.device)
    extra = dv if dv_extra is None else dv_extra
    torch.library.wrap_triton(_fla_k_bwd)[(triton.cdiv(n, bn), B, num_heads)](
        k, pos, v, inv_s, dkv, dks, dphi_k, extra, dv, n, C, 1.0 / n, *k.stride(), spn, spc,
        *v.stride(), *extra.stride(), *dv.stride(), H=num_heads, D=d, P=focusing_factor,
        HAS_POS=has_pos, HAS_EXTRA=dv_extra is not None, **cfg)
    # through the focusing function (dphi -> dx, written in the input dtype)
    if len(parts) == 3:
        dq = parts[0]
    else:
        dq = dphi_q if q.dtype == torch.float32 else torch.empty((B, N, C), dtype=q.dtype,
                                                                 device=q.device)
    bq, bk = triton.cdiv(N, bn), triton.cdiv(n, bn)
    ds_q = q.new_empty((B * bq, C), dtype=torch.float32)
    ds_k = q.new_empty((B * bk, C), dtype=torch.float32)
    torch.library.wrap_triton(_focus_bwd)[(bq, B)](
        q, q, inv_s, dphi_q, dq, ds_q, N, C, *q.stride(), 0, 0, *dq.stride(), BLOCK_N=bn,
        BLOCK_C=cfg['BLOCK_C'], P=focusing_factor, HAS_POS=False, KEEP_F32=False,
        num_warps=_NUM_WARPS)
    # (the positional table's gradient sums the float32 dk over the batch)
    keep = has_pos and (packed_out is not None or k.dtype != torch.float32)
    torch.library.wrap_triton(_focus_bwd)[(bk, B)](
        k, pos, inv_s, dphi_k, dk, ds_k, n, C, *k.stride(), spn, spc, *dk.stride(),
        BLOCK_N=bn, BLOCK_C=cfg['BLOCK_C'], P=focusing_factor, HAS_POS=has_pos,
        KEEP_F32=keep, num_warps=_NUM_WARPS)
    # d(1/softplus(s))/ds = -sigmoid(s) / softplus(s)^2
    s = scale.detach().reshape(-1).float()
    dscale = (ds_q.sum(0) + ds_k.sum(0)) * (-torch.sigmoid(s) * inv_s * inv_s)
    dpos = dphi_k.sum(0) if has_pos else dphi_k.new_empty((0, ))
    return dq, dk, dv, dscale, dpos


@torch.library.triton_op('flatten_mm::fla_core_backward', mutates_args=())
def _fla_core_backward_op(
        grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        scale: torch.Tensor, k_pos: Optional[torch.Tensor], kv: torch.Tensor, ks: torch.Tensor,
        num_heads: int, focusing_factor: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dscale, dpos = _backward_kernels(grad, q, k, v, scale, k_pos, kv, ks,
                                                 num_heads, focusing_factor)
    return dq, dk, dv, dscale.to(scale.dtype), dpos


@_fla_core_backward_op.register_fake
def _(grad, q, k, v, scale, k_pos, kv, ks, num_heads, focusing_factor):
    C = q.shape[2]
    dpos = (k.new_empty(k.shape[1:], dtype=torch.float32) if k_pos is not None else
            k.new_empty((0, ), dtype=torch.float32))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            scale.new_empty((C, )), dpos)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, k_pos, residual, num_heads, focusing_factor = inputs
    _, kv, ks = output
    ctx.save_for_backward(q, k, v, scale, k_pos, kv, ks)
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.num_heads = num_heads
    ctx.focusing_factor = focusing_factor
    ctx.mark_non_differentiable(kv, ks)


def _backward(ctx, grad_out, grad_kv, grad_ks):
    q, k, v, scale, k_pos, kv, ks = ctx.saved_tensors
    # the residual is added to the output: its gradient is the output's (no kernel)
    dres = None if ctx.residual_dtype is None else grad_out.to(ctx.residual_dtype)
    if records_backward_graph():  # (create_graph: the formula op by op, ``'fla_core'``)
        grads = differentiate_reference(
            'fla_core', (q, k, v, scale, k_pos, None, ctx.num_heads, ctx.focusing_factor),
            ctx.needs_input_grad[:5] + (False, ) * 3, (grad_out, ))
        return tuple(grads[:5]) + (dres, None, None)
    dq, dk, dv, dscale, dpos = torch.ops.flatten_mm.fla_core_backward(
        kernel_grad(grad_out), q, k, v, scale, k_pos, kv, ks, ctx.num_heads,
        ctx.focusing_factor)
    dpos = dpos.reshape(k_pos.shape).to(k_pos.dtype) if k_pos is not None else None
    return dq, dk, dv, dscale.reshape(scale.shape), dpos, dres, None, None


_fla_core_op.register_autograd(_backward, setup_context=_setup_context)


def fla_core_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                    num_heads: int, focusing_factor: int,
                    k_pos: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``focused_linear_core`` by the fused kernels (differentiable in ``q, k, v, scale,
    k_pos, residual``; a double backward differentiates the registered op-by-op formula).

    Args:
        q: ``(B, N, C)`` queries (any strides), float32 / bfloat16 / float16.
        k: ``(B, n, C)`` keys.
        v: ``(B, n, C)`` values.
        scale: raw ``(1, 1, C)`` scale parameter (``softplus`` applied inside).
        num_heads: ``h`` (``C % h == 0``, head dim at most 128).
        focusing_factor: integer power ``p >= 1``.
        k_pos: optional ``(1, n, C)`` positional encoding added to the keys.
        residual: optional ``(B, N, C)`` tensor (any strides, float32 / bfloat16 /
            float16) added to the output inside the output kernel, in float32 before
            the one rounding (FLA's DWC branch: no separate add kernel; its gradient is
            the output's).

    Returns:
        ``(B, N, C)`` in the dtype of ``v`` (computed in float32).

    Raises:
        ValueError: inputs the kernels do not take (see ``check_inputs``).
    """
    why = check_inputs(q, k, v, scale, num_heads, focusing_factor, k_pos, residual)
    if why is not None:
        raise ValueError(f'FLA Triton kernels: {why}')
    with torch.autocast(device_type=q.device.type, enabled=False):
        out, _, _ = torch.ops.flatten_mm.fla_core(q, k, v, scale, k_pos, residual,
                                                   int(num_heads), int(focusing_factor))
    return out


# ----------------------------------------------------------------------------------------
# FLA layers with a packed projection and no key reduction (FLatten-PVT's ``kv``,
# FLatten-Swin's ``qkv``): projection + DWC + core, the projection recomputed in the backward


def _dwc_tokens(v: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                hw: Tuple[int, int]) -> torch.Tensor:
    """The depth-wise conv (``weight`` ``(C, 1, k, k)``, same padding) on tokens ``(B, N, C)``
    viewed as a channels-last map, as ``conv.token_conv`` does."""
    img = tokens_as_map(v, hw)
    return map_as_tokens(F.conv2d(img, weight, bias, 1, weight.shape[-1] // 2, 1,
                                  img.shape[1]))


@torch.library.triton_op('flatten_mm::fla_core_backward_packed', mutates_args=())
def _fla_core_backward_packed_op(
        grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        scale: torch.Tensor, k_pos: Optional[torch.Tensor], kv: torch.Tensor, ks: torch.Tensor,
        dv_extra: Optional[torch.Tensor], with_q: bool, num_heads: int, focusing_factor: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fla_core_backward`` for k, v (``with_q``: q, k, v) that are the parts of one packed
    projection: ``(dq, [dk | dv], dscale, dpos)`` (``with_q``: ``(empty, [dq | dk | dv],
    ...)``), ``dv_extra`` (v's gradient from elsewhere) added inside the key kernel."""
    B, n, C = k.shape
    m = 3 if with_q else 2
    packed = torch.empty((B, n, m * C), dtype=k.dtype, device=k.device)
    dq, _, _, dscale, dpos = _backward_kernels(grad, q, k, v, scale, k_pos, kv, ks, num_heads,
                                               focusing_factor, dv_extra=dv_extra,
                                               packed_out=packed)
    return (dq.new_empty((0, )) if with_q else dq), packed, dscale.to(scale.dtype), dpos


@_fla_core_backward_packed_op.register_fake
def _(grad, q, k, v, scale, k_pos, kv, ks, dv_extra, with_q, num_heads, focusing_factor):
    B, n, C = k.shape
    dpos = (k.new_empty((n, C), dtype=torch.float32) if k_pos is not None else
            k.new_empty((0, ), dtype=torch.float32))
    dq = (q.new_empty((0, )) if with_q else
          torch.empty_like(q, memory_format=torch.contiguous_format))
    return (dq, k.new_empty((B, n, (3 if with_q else 2) * C)), scale.new_empty((C, )), dpos)


class _ProjectedFLA(torch.autograd.Function):
    """``[q |] k | v = x W^T + b``, ``FLA(q, k + k_pos, v) + DWC(v)``; the backward
    recomputes the projection from ``x`` instead of keeping it (see
    ``fla_projected_triton``). The projection and the DWC are PyTorch calls, the core the
    ``fla_core`` / ``fla_core_backward_packed`` ops. ``q=None``: q is the first part of
    the projection."""

    @staticmethod
    def forward(ctx, q, x, weight, bias, scale, k_pos, dwc_weight, dwc_bias, hw_shape,
                num_heads, focusing_factor):
        C = x.shape[2]
        parts = F.linear(x, weight, bias).split(C, dim=-1)
        qq = parts[0] if q is None else q
        k, v = parts[-2:]
        res = _dwc_tokens(v, dwc_weight, dwc_bias, hw_shape)
        out, kv, ks = torch.ops.flatten_mm.fla_core(qq, k, v, scale, k_pos, res, num_heads,
                                                    focusing_factor)
        # (the DWC bias only for a double backward's formula)
        ctx.save_for_backward(q, x, weight, bias, scale, k_pos, dwc_weight, dwc_bias, kv, ks)
        ctx.has_dwc_bias = dwc_bias is not None
        ctx.args = (hw_shape, num_heads, focusing_factor)
        return out

    @staticmethod
    def reference(q, x, weight, bias, scale, k_pos, dwc_weight, dwc_bias, hw_shape,
                  num_heads, focusing_factor):
        """The forward op by op (``'fla_core'``): what a double backward differentiates."""
        C = x.shape[2]
        parts = F.linear(x, weight, bias).split(C, dim=-1)
        res = _dwc_tokens(parts[-1], dwc_weight, dwc_bias, hw_shape)
        return reference('fla_core')(
            parts[0] if q is None else q, parts[-2], parts[-1], scale, k_pos, res,
            num_heads, focusing_factor)

    @staticmethod
    def backward(ctx, grad):
        q, x, weight, bias, scale, k_pos, dwc_weight, dwc_bias, kv, ks = ctx.saved_tensors
        hw, num_heads, focusing_factor = ctx.args
        if records_backward_graph():  # (create_graph: the formula op by op)
            return tuple(differentiate_reference(
                _ProjectedFLA.reference, (q, x, weight, bias, scale, k_pos, dwc_weight,
                                          dwc_bias, hw, num_heads, focusing_factor),
                ctx.needs_input_grad, (grad, )))
        grad = kernel_grad(grad)
        B, n, C = x.shape
        parts = F.linear(x, weight, bias).split(C, dim=-1)  # recomputed: one GEMM
        with_q = q is None
        k, v = parts[-2:]
        dv_map, ddwc_w, ddwc_b = torch.ops.aten.convolution_backward(
            tokens_as_map(grad, hw), tokens_as_map(v, hw), dwc_weight,
            [C] if ctx.has_dwc_bias else None, [1, 1], [dwc_weight.shape[-1] // 2] * 2,
            [1, 1], False, [0, 0], C, [True, True, ctx.has_dwc_bias])
        dq, packed, dscale, dpos = torch.ops.flatten_mm.fla_core_backward_packed(
            grad, parts[0] if with_q else q, k, v, scale, k_pos, kv, ks,
            map_as_tokens(dv_map), with_q, num_heads, focusing_factor)
        g2 = packed.view(B * n, packed.shape[-1])
        dx = (g2 @ weight).view(B, n, C)
        dw = g2.t() @ x.reshape(B * n, C)
        db = g2.sum(0) if bias is not None else None
        dpos = dpos.reshape(k_pos.shape).to(k_pos.dtype) if k_pos is not None else None
        return (None if with_q else dq, dx, dw, db, dscale.reshape(scale.shape), dpos, ddwc_w,
                ddwc_b, None, None, None)


def check_projected_inputs(q: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                           bias: Optional[torch.Tensor], dwc_weight: torch.Tensor,
                           dwc_bias: Optional[torch.Tensor],
                           hw_shape: Tuple[int, int]) -> Optional[str]:
    """Why ``fla_projected_triton`` cannot take these (``None`` if it can; the core's
    own conditions are ``check_inputs``)."""
    if x.dim() != 3:
        return f'x must be (B, N, C), got {tuple(x.shape)}'
    B, N, C = x.shape
    if q is not None and q.shape != x.shape:
        return f'x {tuple(x.shape)} does not match q {tuple(q.shape)} (no key reduction)'
    if N != hw_shape[0] * hw_shape[1]:
        return f'{N} tokens do not make a {tuple(hw_shape)} map'
    m = 3 if q is None else 2
    if weight.shape != (m * C, C) or bias is not None and bias.shape != (m * C, ):
        return (f'projection {tuple(weight.shape)} is not C -> {m}C for C={C} '
                f'({"q, k, v" if q is None else "k, v"})')
    ks = dwc_weight.shape[-1]
    if (dwc_weight.shape != (C, 1, ks, ks) or ks % 2 == 0
            or dwc_bias is not None and dwc_bias.shape != (C, )):
        return f'DWC weight {tuple(dwc_weight.shape)} is not a ({C}, 1, k, k) odd-k kernel'
    dtypes = {t.dtype for t in (x, weight, bias, dwc_weight, dwc_bias) if t is not None}
    if len(dtypes) > 1:
        return (f'x and the projection / DWC parameters have different dtypes '
                f'{sorted(map(str, dtypes))}')
    return None


def fla_projected_triton(q: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor], scale: torch.Tensor, num_heads: int,
                         focusing_factor: int, hw_shape: Tuple[int, int],
                         dwc_weight: torch.Tensor, dwc_bias: Optional[torch.Tensor] = None,
                         k_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An FLA layer without key reduction from its packed projection on:
    ``k, v = (x W^T + b).chunk(2)`` (FLatten-PVT's ``kv``, ``q`` given) or
    ``q, k, v = (x W^T + b).chunk(3)`` (FLatten-Swin's ``qkv``, ``q=None``), then
    ``out = FLA(q, k + k_pos, v) + DWC(v)``, with its own backward (an
    ``autograd.Function``).

    The forward is the projection and the DWC (PyTorch: cuBLAS / cuDNN) and the
    ``fla_core`` kernels (the DWC output added in the output kernel). The backward is what
    differs from autograd's: the projection is recomputed from ``x`` (one GEMM; ``x`` is kept
    anyway, by the ``q`` projection or as this function's input) instead of being saved, so
    a training step keeps no ``(B, N, 2C)`` / ``(B, N, 3C)`` tensor per layer; the DWC's
    ``dv`` is added inside the key kernel and ``[dq |] dk | dv`` is written side by side as
    the projection's gradient (``fla_core_backward_packed``: no add, no concatenation).
    Under autocast ``x`` and the parameters are cast as ``nn.Linear`` / ``nn.Conv2d`` would
    be.

    Args:
        q: ``(B, N, C)`` queries, or ``None`` (q is the first third of the projection).
        x: ``(B, N, C)`` input of the projection (the normalised block input).
        weight, bias: the ``C -> 2C`` (``C -> 3C`` without ``q``) projection (bias
            optional).
        scale: raw ``(1, 1, C)`` scale parameter.
        num_heads, focusing_factor: ``h``, ``p``.
        hw_shape: ``(H, W)`` with ``H * W = N``.
        dwc_weight: ``(C, 1, k, k)`` depth-wise kernel (odd ``k``; FLA's head-shared
            ``(C/h, 1, k, k)`` kernel repeated over the heads), ``dwc_bias`` ``(C,)``.
        k_pos: optional ``(1, N, C)`` positional encoding added to the keys.

    Returns:
        ``(B, N, C)`` in the projection's dtype.

    Raises:
        ValueError: inputs it does not take (``check_projected_inputs``, ``check_inputs``).
    """
    dev = x.device.type
    # (what nn.Linear / nn.Conv2d would run in under autocast)
    x, weight, bias, dwc_weight, dwc_bias = autocast_operands(x, weight, bias, dwc_weight,
                                                              dwc_bias)
    why = (check_projected_inputs(q, x, weight, bias, dwc_weight, dwc_bias, hw_shape)
           or check_inputs(x if q is None else q, x, x, scale, num_heads, focusing_factor,
                           k_pos))
    if why is not None:
        raise ValueError(f'FLA Triton kernels: {why}')
    with torch.autocast(device_type=dev, enabled=False):
        return _ProjectedFLA.apply(q, x, weight, bias, scale, k_pos, dwc_weight, dwc_bias,
                                   (int(hw_shape[0]), int(hw_shape[1])), int(num_heads),
                                   int(focusing_factor))


__all__ = ['fla_core_triton', 'fla_projected_triton', 'check_inputs',
           'check_projected_inputs', 'INTERPRETED']
