"""Patch embeddings of the PVT family."""
import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .conv import map_as_tokens
from .pos_embed import _exporting


class PVTPatchEmbed(nn.Module):
    """Strided conv + LayerNorm producing tokens.

    ``overlap=True`` is PVTv2's overlapping embedding (kernel ``2s-1`` rounded to 7 for
    stride 4 / 3 for stride 2, padding ``k // 2``): output size ``ceil(H / s)``.
    ``overlap=False`` is PVT v1's non-overlapping ``k = s`` embedding; the map is
    zero-padded at the bottom/right to a multiple of the stride first, so the output
    size is also ``ceil(H / s)``.

    Args:
        in_channels: input channels.
        embed_dims: output channels.
        stride: down-sampling factor.
        overlap: overlapping (PVTv2) or non-overlapping (PVT v1) embedding.
        norm_eps: epsilon of the LayerNorm.
    """

    def __init__(self, in_channels: int, embed_dims: int, stride: int,
                 overlap: bool = True, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.stride = stride
        self.overlap = overlap
        if overlap:
            kernel = {4: 7, 2: 3}.get(stride, 2 * stride - 1)
            self.proj = nn.Conv2d(in_channels, embed_dims, kernel, stride, kernel // 2)
        else:
            self.proj = nn.Conv2d(in_channels, embed_dims, stride, stride)
        self.norm = nn.LayerNorm(embed_dims, eps=norm_eps)

    def out_hw(self, hw: Tuple[int, int]) -> Tuple[int, int]:
        """Output grid for an input ``(H, W)``."""
        return math.ceil(hw[0] / self.stride), math.ceil(hw[1] / self.stride)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Args: x ``(B, C_in, H, W)``. Returns tokens ``(B, N, C)`` and their ``(H', W')``."""
        if not self.overlap:
            H, W = x.shape[-2:]
            if _exporting():
                # ``if pad`` would pin H, W to multiples (or not) of the stride: always
                # pad (a zero pad is a copy), to the ceil-divided size (floor divisions
                # keep torch.export's symbolic sizes simple; a modulo nests per stage)
                s = self.stride
                x = F.pad(x, (0, (W + s - 1) // s * s - W, 0, (H + s - 1) // s * s - H))
            else:
                pad_h, pad_w = (-H) % self.stride, (-W) % self.stride
                if pad_h or pad_w:
                    x = F.pad(x, (0, pad_w, 0, pad_h))
        x = self.proj(x)
        hw = (x.shape[2], x.shape[3])
        # a view for channels-last maps (stages 2-4 get the previous tokens as one)
        return self.norm(map_as_tokens(x)), hw
