"""Pre-norm transformer block around any ``(x, hw_shape)`` attention operator.

Used by the Swin- and CSWin-based backbones (the PVT family keeps its own block with
the PVT norm epsilon and MLP variants): ``x + DropPath(attn(LN(x)))``, then
``x + DropPath(MLP(LN(x)))`` with a plain ``fc1 -> GELU -> fc2`` MLP.
"""
import functools
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath

from ..ops.autograd_paths import recomputed_when_saved, recorded_eagerly
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
        recompute_norms: when autograd records the block (eagerly, without other
            saved-tensor hooks such as ``with_cp``'s), the outputs of ``norm1`` and
            ``norm2`` are not kept for the backward where the attention and the MLP would
            keep them (their first projections' inputs): the backward recomputes each
            from the block's input, which the LayerNorm keeps anyway
            (``ops.autograd_paths.recomputed_when_saved``). The same outputs and
            gradients, two ``(B, N, C)`` activations less per block, for two LayerNorm
            forwards in the backward. ``False`` keeps them, as timm / mmdet do.
    """

    def __init__(self, embed_dims: int, attn: nn.Module, mlp_ratio: float = 4.,
                 drop_rate: float = 0., drop_path: float = 0., norm_eps: float = 1e-5,
                 recompute_mlp_act: bool = True, recompute_norms: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=norm_eps)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(embed_dims, eps=norm_eps)
        self.mlp = PVTMlp(embed_dims, int(embed_dims * mlp_ratio), drop=drop_rate, dwconv=False,
                          recompute_act=recompute_mlp_act)
        self.recompute_norms = bool(recompute_norms)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape`` map. Returns ``(B, N, C)``."""
        if not (self.recompute_norms and recorded_eagerly(x, *self.parameters())):
            x = x + self.drop_path(self.attn(self.norm1(x), hw_shape))
            return x + self.drop_path(self.mlp(self.norm2(x), hw_shape))
        x = x + self.drop_path(self._normed(self.norm1, self.attn, x, hw_shape))
        return x + self.drop_path(self._normed(self.norm2, self.mlp, x, hw_shape))

    @staticmethod
    def _normed(norm: nn.Module, fn: nn.Module, x: torch.Tensor,
                hw_shape: Tuple[int, int]) -> torch.Tensor:
        """``fn(norm(x), hw_shape)`` with ``norm(x)`` recomputed, not kept, for the backward
        (``recompute_norms``); ``y`` stays referenced while ``fn`` runs (see
        ``recomputed_when_saved``)."""
        y = norm(x)
        if type(norm) is nn.LayerNorm:
            again = functools.partial(F.layer_norm, x, norm.normalized_shape, norm.weight,
                                      norm.bias, norm.eps)
        else:  # a replaced norm: its own forward
            again = functools.partial(norm, x)
        with recomputed_when_saved(y, again):
            return fn(y, hw_shape)
