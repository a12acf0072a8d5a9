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

from .conv import map_as_tokens, tokens_as_map


class SpatialReductionAttention(nn.Module):
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
        self.sr_ratio = sr_ratio
        self.linear = linear
        self.attn_drop = attn_drop
        self.q = nn.Linear(embed_dims, embed_dims, bias=qkv_bias)
        self.kv = nn.Linear(embed_dims, 2 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)
        if linear:
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.sr = nn.Conv2d(embed_dims, embed_dims, kernel_size=1, stride=1)
            self.norm = nn.LayerNorm(embed_dims)
            self.act = nn.GELU()
        elif sr_ratio > 1:
            self.sr = nn.Conv2d(embed_dims, embed_dims, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(embed_dims)

    def check_map_size(self, hw_shape: Tuple[int, int]) -> None:
        """Raise ``ValueError`` if the map is smaller than the reduction conv
        (``sr_ratio`` x ``sr_ratio``, no padding, as upstream)."""
        if not self.linear and self.sr_ratio > 1 and min(hw_shape) < self.sr_ratio:
            raise ValueError(f'SpatialReductionAttention: a {hw_shape[0]}x{hw_shape[1]} map is '
                             f'smaller than the {self.sr_ratio}x{self.sr_ratio} reduction conv '
                             f'(sr_ratio={self.sr_ratio})')

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        self.check_map_size(hw_shape)
        B, N, C = x.shape
        h = self.num_heads
        q = self.q(x).reshape(B, N, h, C // h).transpose(1, 2)
        # tokens viewed as a channels-last map (no transposed copies)
        if self.linear:
            x_ = self.sr(self.pool(tokens_as_map(x, hw_shape)))
            x_ = self.act(self.norm(map_as_tokens(x_)))
        elif self.sr_ratio > 1:
            x_ = self.sr(tokens_as_map(x, hw_shape))
            if x_.shape[2] == 0 or x_.shape[3] == 0:
                raise ValueError(f'feature map {hw_shape} is smaller than sr_ratio {self.sr_ratio}')
            x_ = self.norm(map_as_tokens(x_))
        else:
            x_ = x
        k, v = self.kv(x_).reshape(B, -1, 2, h, C // h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        out = out.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(out))
