"""The training path of Focused Linear Attention on PyTorch, memory-lean.

``FocusedLinearCore`` is an autograd Function with the maths of
``focused_linear_core`` (see ``focused_linear_attention``): the forward runs without
autograd and keeps only its inputs and the per-head ``K^T V / n`` and ``mean(phi(K))``
(``(B, h, d, d)`` and ``(B, h, d, 1)``); the backward recomputes the focused features of
the queries and keys from the inputs and applies the gradient formulas below. Recorded
op by op, the same computation keeps about eight ``(B, N, C)`` tensors per layer (the
ReLU base, its power, the norms, the features of both sides); this keeps the queries and
keys (the values are kept by the DWC branch anyway) -- what the Triton kernels keep on
CUDA.

Per token, over the ``C`` channels (all heads), with ``s = 1 / softplus(scale)``:
``b = (ReLU(x) + 1e-6) s``, ``y = b^p``, ``r = ||b|| / ||y||`` and ``phi(x) = r y``.
Per head, ``out = (y_q KV) / (y_q . m + 1e-6 / r_q)`` with ``KV = phi(K)^T V / n`` and
``m = mean(phi(K))``. Backward of ``(y, r)`` to ``b``:
``db = p b^(p-1) (dy - dr ||b|| / ||y||^3 y) + dr b / (||b|| ||y||)`` (evaluated without
``||y||^3``, which underflows for tokens whose channels are all <= 0); then
``dx = db s`` where ``ReLU(x) > 0`` (NaN passes, as in torch's ReLU backward),
``ds = sum(db (ReLU(x) + 1e-6))`` and ``dscale = -ds s^2 sigmoid(scale)``.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from ..ops.autograd_paths import differentiate_reference, records_backward_graph
from ..ops.capture import graph_capture
from .pos_embed import _is_compiling


def _features(x: torch.Tensor, inv_scale: torch.Tensor, p: int):
    """``(b, y, nb, ny)``: ``b = (ReLU(x) + 1e-6) s``, ``y = b^p`` and the per-token norms
    of ``b`` and ``y`` (two new buffers)."""
    b = F.relu(x).add_(1e-6).mul_(inv_scale)
    y = b.pow(p)
    nb = torch.linalg.vector_norm(b, dim=-1, keepdim=True)
    ny = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    return b, y, nb, ny


def kernel_parts(x: torch.Tensor, inv_scale: torch.Tensor, p: int,
                 owned: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``y = ((ReLU(x) + 1e-6) / softplus(scale))^p`` and the per-token factor
    ``r = ||base|| / ||y||`` with ``phi_p(x) = r * y``, computed in place on one new
    buffer (no autograd; the forward needs neither the base nor the norms apart);
    ``owned`` says that ``x`` itself is a temporary of the caller and may be
    overwritten."""
    y = x.relu_() if owned else F.relu(x)
    y.add_(1e-6).mul_(inv_scale)
    norm = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    y = y.pow_(p)
    norm_p = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    return y, norm.div_(norm_p)


def _features_backward(x: torch.Tensor, inv_scale: torch.Tensor, p: int,
                       feats, dy: torch.Tensor, dr: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``x`` and of ``s`` (summed to ``s``'s shape) from those of ``y`` and
    ``r`` (see the module docstring), in place: ``x``'s gradient is written into ``dy``'s
    buffer and ``y``'s buffer is the scratch space (both are the caller's temporaries),
    so no new ``x``-sized buffer is made."""
    b, y, nb, ny = feats
    # grouped so that no power of ||y|| beyond the second is formed, and that one only
    # against ||b||: for a token whose channels are all <= 0, ||y|| ~ 1e-18 (p = 3), and
    # ||y||^3 would underflow (or a large dr times 1 / ||y||^3 overflow)
    dr_ny = dr / ny
    # db / p = b^(p-1) (dy - c (y / ||y||)) + (dr_ny / (p ||b||)) b, c = dr_ny ||b|| / ||y||
    # (y's buffer is scratch from here: it holds the unit vector y / ||y||, then b^(p-1))
    db = dy.addcmul_(y.div_(ny), dr_ny * (nb / ny), value=-1)
    db.mul_(torch.pow(b, p - 1, out=y)).addcmul_(b, dr_ny / (nb * p))
    # ds = sum(db (ReLU(x) + 1e-6)) = sum(db b) / s per channel
    dims = tuple(range(db.dim() - 1))
    ds = torch.mul(db, b, out=y).sum(dim=dims, keepdim=True).mul_(p).div_(inv_scale)
    # ReLU's own backward: zero where x <= 0 (NaN passes), one fused pass in place
    db.mul_(inv_scale * p)
    dx = torch.ops.aten.threshold_backward.grad_input(db, x, 0, grad_input=db)
    return dx, ds


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """``(B, N, h*d)`` -> its ``(B, h, N, d)`` view (no copy)."""
    B, N, C = x.shape
    return x.view(B, N, h, C // h).transpose(1, 2)


def _heads_matmul(a: torch.Tensor, m: torch.Tensor, h: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ m`` per head, ``a`` ``(B, N, h*d)``, ``m`` ``(B, h, d, e)``, written in the
    merged ``(B, N, h*e)`` layout (into ``out`` when given): the GEMMs read and write the
    head-strided views directly, where ``_heads(a) @ m`` followed by a head merge would
    copy twice. Call it on the ``batch_chunks`` of a batch."""
    if out is None:
        out = a.new_empty(*a.shape[:2], h * m.shape[-1])
    if strided_out_ok(out):
        torch.matmul(_heads(a, h), m, out=_heads(out, h))
    else:
        _heads(out, h).copy_(_heads(a, h) @ m)
    return out


def strided_out_ok(out: torch.Tensor) -> bool:
    """Whether GEMMs may write a head-strided view of ``out`` directly: on CPU and CUDA
    (BLAS leading dimensions) in eager mode; other backends and torch.compile (no
    ``out=``) get a computed copy."""
    return out.device.type in ('cpu', 'cuda') and not _is_compiling()


#: per-sample activations (tokens x channels) from which a multi-head batch is processed
#: one sample at a time; below it the per-sample calls cost more than the copies they
#: save (measured on CPU: 0.65-0.75x the time per-sample at 1024 x 160 and above, 1.3-1.6x
#: at 256 x 256 and below, batch 8-16)
PER_SAMPLE_NUMEL = 1 << 17


def batch_chunks(batch: int, num_heads: int, tokens: int, channels: int) -> List[slice]:
    """The batch in the pieces the per-head GEMMs take without copies: whole for one head
    (the head views are plain ``(B, N, C)``), an empty batch or small maps, else one
    sample at a time -- a strided ``(B, h, N, d)`` view does not fold into one BLAS batch,
    and ``matmul`` computes aside and copies back (2-3x the time of the per-sample calls
    at B = 2 and 16384 x 96)."""
    if num_heads == 1 or batch <= 1 or tokens * channels < PER_SAMPLE_NUMEL:
        return [slice(0, batch)]
    return [slice(i, i + 1) for i in range(batch)]


def _keys(k: torch.Tensor, k_pos: Optional[torch.Tensor], dt: torch.dtype) -> torch.Tensor:
    return k.to(dt) if k_pos is None else k.to(dt) + k_pos.to(dt)


class FocusedLinearCore(torch.autograd.Function):
    """``focused_linear_core`` (PyTorch path) with a backward that recomputes the focused
    features: ``apply(q, k, v, scale, k_pos, num_heads, focusing_factor)``, ``k_pos``
    ``None`` or ``(1, n, C)``; the output ``(B, N, C)`` is in ``v``'s dtype. A backward
    under ``create_graph=True`` differentiates the op-by-op formula instead (registered as
    ``'fla_core'``), so second derivatives are exact.

    Both passes work in the merged ``(B, N, C)`` layout (per-head GEMMs on strided views,
    ``batch_chunks`` at a time) and reuse their temporaries in place: at large ``N``
    every fresh ``(N, C)`` buffer costs page faults, which made the op-by-op backward
    several times its forward. The temporaries are those of one chunk."""

    @staticmethod
    def forward(ctx, q, k, v, scale, k_pos, num_heads: int, focusing_factor: int):
        dt = torch.promote_types(v.dtype, torch.float32)
        h, p = num_heads, focusing_factor
        inv_scale = 1.0 / F.softplus(scale.to(dt))
        out, kv, k_mean = core_forward(q, k, v, inv_scale, k_pos, h, p, dt)
        ctx.save_for_backward(q, k, v, scale, k_pos, kv, k_mean)
        ctx.shape = (h, p, dt)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if records_backward_graph():  # (create_graph: the formula op by op, differentiable)
            q, k, v, scale, k_pos = ctx.saved_tensors[:5]
            h, p, _ = ctx.shape
            grads = differentiate_reference(
                'fla_core', (q, k, v, scale, k_pos, None, h, p),
                ctx.needs_input_grad[:5] + (False, ) * 3, (grad_out, ))
            return tuple(grads[:5]) + (None, None)
        # in float32 (or float64) as the forward, whatever autocast the backward runs in
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            return FocusedLinearCore._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, scale, k_pos, kv, k_mean = ctx.saved_tensors
        h, p, dt = ctx.shape
        sc = scale.to(dt)
        inv_scale = 1.0 / F.softplus(sc)
        dq = q.new_empty(q.shape, dtype=dt)
        dk = k.new_empty(k.shape, dtype=dt)
        dv = v.new_empty(v.shape, dtype=dt) if ctx.needs_input_grad[2] else None
        ds = torch.zeros_like(sc)
        for c in batch_chunks(q.shape[0], h, max(q.shape[1], k.shape[1]), q.shape[2]):
            dkv, dk_mean = _query_backward(q[c].to(dt), grad_out[c].to(dt), kv[c],
                                           k_mean[c], inv_scale, h, p, dq[c], ds)
            _key_backward(_keys(k[c], k_pos, dt), v[c].to(dt), dkv, dk_mean, inv_scale,
                          h, p, dk[c], None if dv is None else dv[c], ds)
        dscale = None
        if ctx.needs_input_grad[3]:
            dscale = (ds * -inv_scale.pow(2) * torch.sigmoid(sc)).to(scale.dtype)
        dk_pos = None
        if k_pos is not None and ctx.needs_input_grad[4]:
            dk_pos = dk.sum(0, keepdim=True).to(k_pos.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), None if dv is None else dv.to(v.dtype),
                dscale, dk_pos, None, None)


def core_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_scale: torch.Tensor,
                 k_pos: Optional[torch.Tensor], h: int, p: int, dt: torch.dtype
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core's forward without autograd (the no-grad path and ``FocusedLinearCore``):
    ``(out, KV, m)``, the output ``(B, N, C)`` in ``dt`` and the per-head sums
    ``phi(K)^T V / n`` ``(B, h, d, d)`` and ``mean(phi(K))`` ``(B, h, d, 1)``; one
    temporary per side, ``batch_chunks`` at a time."""
    out = q.new_empty(q.shape, dtype=dt)
    sums = []
    for c in batch_chunks(q.shape[0], h, max(q.shape[1], k.shape[1]), q.shape[2]):
        kv, k_mean = _key_sums(_keys(k[c], k_pos, dt), v[c].to(dt), inv_scale, h, p,
                               owned=k_pos is not None or k.dtype != dt)
        _query_forward(q[c].to(dt), kv, k_mean, inv_scale, h, p, out[c],
                       owned=q.dtype != dt)
        sums.append((kv, k_mean))
    kv, k_mean = (torch.cat(t) for t in zip(*sums))
    return out, kv, k_mean


def _key_sums(kf, vf, inv_scale, h: int, p: int, owned: bool):
    """``(KV, m)`` of ``kf`` (overwritten when ``owned``)."""
    yk, rk = kernel_parts(kf, inv_scale, p, owned=owned)
    phi = yk.mul_(rk)  # phi(K), (B, n, C)
    kh = _heads(phi, h)
    kv = (kh.transpose(-2, -1) @ _heads(vf, h)).div_(kh.shape[2])
    if graph_capture():
        # m = (1/n) 1^T phi(K): ONNX Runtime reduces over tokens ~10x slower than this
        # matrix product (eager keeps the mean: a BLAS product's rounding can depend on
        # the buffer's alignment, so two eager runs could differ in the last bit)
        mean = phi.new_full((1, phi.shape[1]), 1.0 / phi.shape[1]) @ phi
    else:
        mean = phi.mean(dim=1)
    return kv, mean.view(kv.shape[0], h, kv.shape[2], 1)


def _query_forward(qf, kv, k_mean, inv_scale, h: int, p: int, out: torch.Tensor,
                   owned: bool) -> None:
    """``out = y_q KV / (y_q . m + 1e-6 / r_q)`` per head, into ``out``; ``qf``
    overwritten when ``owned``."""
    yq, rq = kernel_parts(qf, inv_scale, p, owned=owned)
    den = (_heads(yq, h) @ k_mean).add_((1e-6 / rq).unsqueeze(1))
    _heads(_heads_matmul(yq, kv, h, out=out), h).div_(den)


def _query_backward(qf, g, kv, k_mean, inv_scale, h: int, p: int, dq: torch.Tensor,
                    ds: torch.Tensor):
    """Queries' side: ``out = num / den``, ``num = y_q KV``, ``den = y_q . m + 1e-6 / r_q``
    per head. Writes ``dq``, adds to ``ds`` and returns ``(dKV, dm)``; four temporaries
    of ``qf``'s size."""
    B, N = qf.shape[:2]
    fq = _features(qf, inv_scale, p)
    yq, nbq, nyq = fq[1:]
    qh = _heads(yq, h)
    den = (qh @ k_mean).add_((1e-6 * nyq / nbq).unsqueeze(1))  # (B, h, N, 1)
    num = _heads_matmul(yq, kv, h)
    if strided_out_ok(num):
        dnum = torch.empty_like(num)
        torch.div(_heads(g, h), den, out=_heads(dnum, h))
    else:  # (torch.compile takes no strided out=: the quotient, merged by a copy)
        dnum = (_heads(g, h) / den).transpose(1, 2).reshape(num.shape)
    # d den = -sum(dnum num) / den per head, (B, h, N, 1)
    dden = num.mul_(dnum).view(B, N, h, num.shape[2] // h).sum(-1).transpose(1, 2).unsqueeze(-1)
    dden = dden.div_(den).neg_()
    del num
    dkv = qh.transpose(-2, -1) @ _heads(dnum, h)
    dk_mean = qh.transpose(-2, -1) @ dden
    dyq = _heads_matmul(dnum, kv.transpose(-2, -1), h, out=dq)
    del dnum
    _heads(dyq, h).addcmul_(dden, k_mean.transpose(-2, -1))
    # d(1e-6 / r_q) / d r_q = -1e-6 / r_q^2, summed over the heads
    drq = dden.sum(1) * -1e-6 * (nyq / nbq).pow(2)
    ds += _features_backward(qf, inv_scale, p, fq, dyq, drq)[1]
    return dkv, dk_mean


def _key_backward(kf, vf, dkv, dk_mean, inv_scale, h: int, p: int, dk: torch.Tensor,
                  dv: Optional[torch.Tensor], ds: torch.Tensor) -> None:
    """Keys' side: ``KV = phi(K)^T V / n``, ``m = mean(phi(K))``,
    ``phi(K) = r_k y_k``. Writes ``dk`` and ``dv`` (when given), adds to ``ds``."""
    fk = _features(kf, inv_scale, p)
    yk, nbk, nyk = fk[1:]
    n = kf.shape[1]
    rk_n = (nbk / nyk).div_(n)  # r_k / n, (B, n, 1)
    if dv is not None:
        _heads_matmul(yk, dkv, h, out=dv).mul_(rk_n)
    dphi_n = _heads_matmul(vf, dkv.transpose(-2, -1), h, out=dk)  # n dphi(K), less m's
    _heads(dphi_n, h).add_(dk_mean.transpose(-2, -1))
    # dy_k = dphi r_k, dr_k = sum(dphi y_k)
    drk = torch.linalg.vecdot(dphi_n, yk, dim=-1).unsqueeze(-1).div_(n)
    ds += _features_backward(kf, inv_scale, p, fk, dphi_n.mul_(rk_n), drk)[1]


def focused_linear_core_lean(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: torch.Tensor, num_heads: int, focusing_factor: int,
                             k_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``FocusedLinearCore.apply`` with keyword-friendly arguments (autocast off inside:
    the core runs in float32 as the rest of the PyTorch path)."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        return FocusedLinearCore.apply(q, k, v, scale, k_pos, num_heads, focusing_factor)
