"""PVT's reduction of the key/value tokens, shared by the PVT-style attentions
(``SpatialReductionAttention``, ``FocusedLinearAttention``).

Upstream (whai362/PVT, Apache-2.0; kept in LeapLabTHU/FLatten-Transformer @ abdb115): a
strided ``sr`` conv (kernel = stride = ``sr_ratio``, no padding) + LayerNorm ``norm``, or
PVTv2-li's ``linear`` variant (adaptive 7x7 ``pool``, 1x1 ``sr`` conv, ``norm``, GELU
``act``). The module names are the official ones, so checkpoints load as they are.
"""
from typing import Tuple

import torch
import torch.nn as nn

from .conv import map_as_tokens, tokens_as_map


class KVReductionMixin:
    """Adds ``sr``/``norm`` (and ``pool``/``act`` with ``linear``) to an ``nn.Module`` and
    the methods ``check_map_size`` and ``reduce_kv_input``."""

    def _init_kv_reduction(self, embed_dims: int, sr_ratio: int, linear: bool) -> None:
        self.sr_ratio = sr_ratio
        self.linear = linear
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
            raise ValueError(f'{type(self).__name__}: a {hw_shape[0]}x{hw_shape[1]} map is '
                             f'smaller than the {self.sr_ratio}x{self.sr_ratio} reduction conv '
                             f'(sr_ratio={self.sr_ratio})')

    def reduce_kv_input(self, x: torch.Tensor, hw_shape: Tuple[int, int]
                        ) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Tokens ``(B, n, C)`` that produce K and V, with their grid."""
        # tokens are viewed as a channels-last map (no transposed copies)
        if self.linear:
            x_ = self.pool(tokens_as_map(x, hw_shape))
            x_ = self.act(self.norm(map_as_tokens(self.sr(x_))))
            return x_, (7, 7)
        if self.sr_ratio > 1:
            self.check_map_size(hw_shape)
            x_ = self.sr(tokens_as_map(x, hw_shape))
            return self.norm(map_as_tokens(x_)), (x_.shape[2], x_.shape[3])
        return x, hw_shape
