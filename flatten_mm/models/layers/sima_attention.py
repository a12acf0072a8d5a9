"""SimA: softmax-free attention with L1-normalised queries and keys.

Paper: Koohpayegani & Pirsiavash, "SimA: Simple Softmax-free Attention for Vision
Transformers", WACV 2024, https://arxiv.org/abs/2206.08898.
Upstream: https://github.com/UCDvision/sima @ 3ec3b8e, ``sima.py`` (MIT licence); this is
an independent re-implementation of ``shared/spec/attention.md`` §2.1.

Per head, with ``Q, K, V`` of shape ``(N, d)`` and ``n1(X)`` dividing every column of
``X`` by its L1 norm over the ``N`` tokens (``max(sum_n |x_nc|, 1e-12)``)::

    out = n1(Q) n1(K)^T V            (no softmax, no scale, no temperature)

Both association orders give the same result; they differ in cost:

* ``'qk_first'``: ``(n1(Q) n1(K)^T) V`` -- ``2 N^2 d`` multiply-adds, an ``N x N`` matrix;
* ``'kv_first'``: ``n1(Q) (n1(K)^T V)`` -- ``2 N d^2`` multiply-adds, a ``d x d`` matrix.

``order='auto'`` takes ``'qk_first'`` iff ``N < d`` (strictly cheaper), else
``'kv_first'``: exactly the official rule at HEAD (on a tie both cost the same and the
official code takes ``kv_first``). At dense-prediction sizes (thousands of tokens, ``d``
of 32-64) ``kv_first`` is chosen: linear in ``N``.

Numerics: after the normalisation each entry is ``O(1/N)``; in fp16 it approaches the
subnormal range for ``N`` of ~16k tokens (p8 at detection sizes). The normalisation and
both products therefore always run in float32, also under autocast; the result is cast
back to the input dtype before ``proj``.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

#: valid values of ``SimAAttention(order=...)``
SIMA_ORDERS = ('auto', 'qk_first', 'kv_first')


def sima_order(num_tokens: int, head_dims: int) -> str:
    """The cheaper association order for ``N`` tokens and head dim ``d``.

    ``'qk_first'`` costs ``2 N^2 d``, ``'kv_first'`` ``2 N d^2`` multiply-adds, so
    ``'qk_first'`` iff ``N < d`` (the official rule; ties go to ``'kv_first'``).
    """
    return 'qk_first' if num_tokens < head_dims else 'kv_first'


def sima_core_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        order: str = 'auto') -> torch.Tensor:
    """``sima_core`` computed literally: normalise ``Q`` and ``K`` (``F.normalize``), then
    multiply in the given order. Kept as the reference of the fast path (tests)."""
    if order == 'auto':
        order = sima_order(q.shape[-2], q.shape[-1])
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q = F.normalize(q.to(dtype), p=1.0, dim=-2, eps=1e-12)
        k = F.normalize(k.to(dtype), p=1.0, dim=-2, eps=1e-12)
        v = v.to(dtype)
        if order == 'qk_first':
            return (q @ k.transpose(-2, -1)) @ v
        if order == 'kv_first':
            return q @ (k.transpose(-2, -1) @ v)
    raise ValueError(f'order must be one of {SIMA_ORDERS}, got {order!r}')


def _column_l1(x: torch.Tensor) -> torch.Tensor:
    """``max(sum_n |x[b, h, n, c]|, 1e-12)`` as ``(B, h, d)``.

    Reduced in the token layout ``(B, N, h, d)`` (contiguous channels innermost): for
    the strided head views of a ``qkv`` projection this is ~10x faster on CPU than a
    norm over ``dim=-2``."""
    return x.transpose(1, 2).abs().sum(dim=1).clamp_min_(1e-12)


def sima_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              order: str = 'auto') -> torch.Tensor:
    """SimA attention on split heads, in float32.

    The L1 normalisations are diagonal scalings of the channels, so they are folded
    into the small operand instead of normalising ``Q`` and ``K``:
    ``n1(Q) n1(K)^T V = Q diag(s) K^T V`` with ``s = 1 / (|Q|_1 |K|_1)`` per channel
    (column L1 norms over the tokens, each clamped at 1e-12 as ``F.normalize`` does);
    ``kv_first`` scales the rows of ``K^T V`` (``d x d``), ``qk_first`` the columns of
    ``Q``. Same result as ``sima_core_reference`` up to rounding.

    Args:
        q: ``(B, h, N, d)`` queries.
        k: ``(B, h, N, d)`` keys.
        v: ``(B, h, N, d)`` values.
        order: ``'auto'`` (cheaper order, see ``sima_order``), ``'qk_first'`` or
            ``'kv_first'``.

    Returns:
        ``(B, h, N, d)`` output ``n1(Q) n1(K)^T V`` in float32 (float64 for float64
        inputs).
    """
    if order == 'auto':
        order = sima_order(q.shape[-2], q.shape[-1])
    if order not in ('qk_first', 'kv_first'):
        raise ValueError(f'order must be one of {SIMA_ORDERS}, got {order!r}')
    # at least float32 (float64 stays float64)
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        scale = 1.0 / (_column_l1(q) * _column_l1(k))  # (B, h, d)
        if order == 'qk_first':
            return ((q * scale.unsqueeze(-2)) @ k.transpose(-2, -1)) @ v
        return q @ ((k.transpose(-2, -1) @ v) * scale.unsqueeze(-1))


class SimAAttention(nn.Module):
    """SimA attention with XCiT/ViT-style projections (``qkv``, ``proj``).

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h``; ``C % h == 0``, head dim ``d = C / h``.
        qkv_bias: bias of ``qkv``.
        attn_drop: accepted for interface uniformity; must be 0 (the official code
            never applies attention dropout, and ``kv_first`` has no attention map).
        proj_drop: dropout after ``proj``.
        order: matmul association order: ``'auto'`` (cheaper one for the current
            ``N`` and ``d``; see the module docstring), or ``'qk_first'`` /
            ``'kv_first'`` to force one (tests, benchmarks).
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 order: str = 'auto') -> None:
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        if attn_drop != 0:
            raise NotImplementedError('SimAAttention has no attention-map dropout '
                                      f'(got attn_drop={attn_drop})')
        if order not in SIMA_ORDERS:
            raise ValueError(f'order must be one of {SIMA_ORDERS}, got {order!r}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.order = order
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def resolved_order(self, num_tokens: int) -> str:
        """The order ``forward`` uses for ``num_tokens`` tokens."""
        if self.order == 'auto':
            return sima_order(num_tokens, self.head_dims)
        return self.order

    def forward(self, x: torch.Tensor,
                hw_shape: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Args: x ``(B, N, C)``; ``hw_shape`` is accepted for the common interface and
        not needed (SimA is global and position-free). Returns ``(B, N, C)``."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dims)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, h, N, d)
        out = sima_core(q, k, v, self.resolved_order(N))
        # back to the projection dtype (the autocast dtype under autocast)
        out = out.transpose(1, 2).reshape(B, N, C).to(qkv.dtype)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'order={self.order!r}')
