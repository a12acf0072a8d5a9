"""Spatial-reduction softmax attention of PVT / PVTv2 (the 'S' stages of FLatten models).

Papers: Wang et al., PVT (https://arxiv.org/abs/2102.12122) and PVTv2
(https://arxiv.org/abs/2106.13797); upstream https://github.com/whai362/PVT (Apache-2.0),
as kept inside LeapLabTHU/FLatten-Transformer @ abdb115. The product uses
``F.scaled_dot_product_attention`` (fused kernels where available).
"""
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kv_reduction import KVReductionMixin


class SpatialReductionAttention(KVReductionMixin, nn.Module):
    """Multi-head softmax attention with keys/values from a reduced map.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h``; scale ``(C/h)^-0.5``.
        qkv_bias: bias of ``q`` and ``kv``.
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after ``proj``.
        sr_ratio: stride of the key/value reduction conv (+ LayerNorm) when > 1.
        linear: PVTv2-li reduction (adaptive 7x7 pool, 1x1 conv, LayerNorm, GELU).
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 sr_ratio: int = 1,
                 linear: bool = False) -> None:
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.attn_drop = attn_drop
        self.q = nn.Linear(embed_dims, embed_dims, bias=qkv_bias)
        self.kv = nn.Linear(embed_dims, 2 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)
        self._init_kv_reduction(embed_dims, sr_ratio, linear)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        B, N, C = x.shape
        h = self.num_heads
        q = self.q(x).reshape(B, N, h, C // h).transpose(1, 2)
        x_, _ = self.reduce_kv_input(x, hw_shape)
        k, v = self.kv(x_).reshape(B, x_.shape[1], 2, h, C // h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        out = out.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(out))
