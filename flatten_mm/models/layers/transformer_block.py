"""Pre-norm transformer block around any ``(x, hw_shape)`` attention operator.

Used by the Swin- and CSWin-based backbones (the PVT family keeps its own block with
the PVT norm epsilon and MLP variants): ``x + DropPath(attn(LN(x)))``, then
``x + DropPath(MLP(LN(x)))`` with a plain ``fc1 -> GELU -> fc2`` MLP.
"""
from typing import Tuple

import torch
import torch.nn as nn
from timm.layers import DropPath

from .ffn import PVTMlp


class PreNormBlock(nn.Module):
    """Pre-norm transformer block.

    Args:
        embed_dims: channels ``C``.
        attn: the attention operator, ``attn(x: (B, N, C), hw_shape) -> (B, N, C)``
            (built by the backbone, e.g. with ``build_attention``).
        mlp_ratio: hidden/``C`` ratio of the MLP.
        drop_rate: dropout in the MLP.
        drop_path: stochastic-depth rate of this block.
        norm_eps: epsilon of both LayerNorms.
        recompute_mlp_act: the MLP's GELU output recomputed in the backward instead of
            kept (``PVTMlp(recompute_act=...)``).
    """

    def __init__(self, embed_dims: int, attn: nn.Module, mlp_ratio: float = 4.,
                 drop_rate: float = 0., drop_path: float = 0., norm_eps: float = 1e-5,
                 recompute_mlp_act: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=norm_eps)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(embed_dims, eps=norm_eps)
        self.mlp = PVTMlp(embed_dims, int(embed_dims * mlp_ratio), drop=drop_rate, dwconv=False,
                          recompute_act=recompute_mlp_act)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape`` map. Returns ``(B, N, C)``."""
        x = x + self.drop_path(self.attn(self.norm1(x), hw_shape))
        return x + self.drop_path(self.mlp(self.norm2(x), hw_shape))
