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
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _features(x: torch.Tensor, inv_scale: torch.Tensor, p: int):
    """``(b, y, nb, ny)``: ``b = (ReLU(x) + 1e-6) s``, ``y = b^p`` and the per-token norms
    of ``b`` and ``y`` (two new buffers)."""
    b = F.relu(x).add_(1e-6).mul_(inv_scale)
    y = b.pow(p)
    nb = torch.linalg.vector_norm(b, dim=-1, keepdim=True)
    ny = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    return b, y, nb, ny


def _features_backward(x: torch.Tensor, inv_scale: torch.Tensor, p: int,
                       feats, dy: torch.Tensor, dr: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``x`` and of ``s`` (summed to ``s``'s shape) from those of ``y`` and
    ``r`` (see the module docstring), with three new ``x``-sized buffers (``x``'s
    gradient among them)."""
    b, y, nb, ny = feats
    # grouped so that no power of ||y|| beyond the first is formed: for a token whose
    # channels are all <= 0, ||y|| ~ 1e-18 (p = 3) and ||y||^3 would underflow
    dr_ny = dr / ny
    # db / p = b^(p-1) (dy - c y) + (dr_ny / (p ||b||)) b, c = dr_ny ||b|| / ||y||^2
    db = b.pow(p - 1).mul_(torch.addcmul(dy, y, (dr_ny * (nb / ny)) / ny, value=-1))
    db.addcmul_(b, dr_ny / (nb * p))
    # ds = sum(db (ReLU(x) + 1e-6)) = sum(db b) / s per channel
    dims = tuple(range(db.dim() - 1))
    ds = (db * b).sum(dim=dims, keepdim=True).mul_(p).div_(inv_scale)
    # ReLU's own backward: zero where x <= 0 (NaN passes), one fused pass in place
    db.mul_(inv_scale * p)
    dx = torch.ops.aten.threshold_backward.grad_input(db, x, 0, grad_input=db)
    return dx, ds


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    B, N, C = x.shape
    return x.view(B, N, h, C // h).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    B, h, N, d = x.shape
    return x.transpose(1, 2).reshape(B, N, h * d)


class FocusedLinearCore(torch.autograd.Function):
    """``focused_linear_core`` (PyTorch path) with a backward that recomputes the focused
    features: ``apply(q, k, v, scale, k_pos, num_heads, focusing_factor)``, ``k_pos``
    ``None`` or ``(1, n, C)``; the output ``(B, N, C)`` is in ``v``'s dtype."""

    @staticmethod
    def forward(ctx, q, k, v, scale, k_pos, num_heads: int, focusing_factor: int):
        dt = torch.promote_types(v.dtype, torch.float32)
        h, p = num_heads, focusing_factor
        inv_scale = 1.0 / F.softplus(scale.to(dt))
        kf = k.to(dt) if k_pos is None else k.to(dt) + k_pos.to(dt)
        _, yk, nbk, nyk = _features(kf, inv_scale, p)
        kh = _heads(yk.mul_(nbk.div_(nyk)), h)  # phi(K) per head
        n = kh.shape[2]
        kv = (kh.transpose(-2, -1) @ _heads(v.to(dt), h)).div_(n)
        k_mean = kh.mean(dim=-2, keepdim=True).transpose(-2, -1)
        del kf, yk, kh
        _, yq, nbq, nyq = _features(q.to(dt), inv_scale, p)
        qh = _heads(yq, h)
        den = (qh @ k_mean).add_((1e-6 * nyq / nbq).unsqueeze(1))
        out = _merge((qh @ kv).div_(den))
        ctx.save_for_backward(q, k, v, scale, k_pos, kv, k_mean)
        ctx.shape = (h, p, dt)
        return out.to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, scale, k_pos, kv, k_mean = ctx.saved_tensors
        h, p, dt = ctx.shape
        sc = scale.to(dt)
        inv_scale = 1.0 / F.softplus(sc)
        g = _heads(grad_out.to(dt), h)
        # ---- queries: out = num / den, num = y_q KV, den = y_q . m + 1e-6 / r_q
        qf = q.to(dt)
        fq = _features(qf, inv_scale, p)
        yq, nbq, nyq = fq[1:]
        qh = _heads(yq, h)
        eps = (1e-6 * nyq / nbq).unsqueeze(1)  # 1e-6 / r_q, (B, 1, N, 1)
        den = (qh @ k_mean).add_(eps)
        num = qh @ kv
        dnum = g / den
        dden = -(dnum * num).sum(-1, keepdim=True).div_(den)
        del num
        dkv = qh.transpose(-2, -1) @ dnum
        dk_mean = qh.transpose(-2, -1) @ dden
        dyq = _merge(dnum @ kv.transpose(-2, -1) + dden * k_mean.transpose(-2, -1))
        # d(1e-6 / r_q) / d r_q = -1e-6 / r_q^2, summed over the heads
        drq = (dden.sum(1) * -1e-6 * (nyq / nbq).pow(2))
        dq, ds = _features_backward(qf, inv_scale, p, fq, dyq, drq)
        del fq, qh, yq, dyq, dnum, dden
        # ---- keys: KV = phi(K)^T V / n, m = mean(phi(K)); phi(K) = r_k y_k
        kf = k.to(dt) if k_pos is None else k.to(dt) + k_pos.to(dt)
        fk = _features(kf, inv_scale, p)
        yk, nbk, nyk = fk[1:]
        rk = nbk / nyk
        vh = _heads(v.to(dt), h)
        n = vh.shape[2]
        dphi = _merge((vh @ dkv.transpose(-2, -1)).add_(dk_mean.transpose(-2, -1))) / n
        dv = _merge(_heads(yk * rk, h) @ dkv) / n if ctx.needs_input_grad[2] else None
        dk, dsk = _features_backward(kf, inv_scale, p, fk, dphi * rk,
                                     (dphi * yk).sum(-1, keepdim=True))
        ds += dsk
        dscale = None
        if ctx.needs_input_grad[3]:
            dscale = (ds * -inv_scale.pow(2) * torch.sigmoid(sc)).to(scale.dtype)
        dk_pos = None
        if k_pos is not None and ctx.needs_input_grad[4]:
            dk_pos = dk.sum(0, keepdim=True).to(k_pos.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), None if dv is None else dv.to(v.dtype),
                dscale, dk_pos, None, None)


def focused_linear_core_lean(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: torch.Tensor, num_heads: int, focusing_factor: int,
                             k_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``FocusedLinearCore.apply`` with keyword-friendly arguments (autocast off inside:
    the core runs in float32 as the rest of the PyTorch path)."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        return FocusedLinearCore.apply(q, k, v, scale, k_pos, num_heads, focusing_factor)
