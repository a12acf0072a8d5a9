"""SimA's class attention: the two blocks that turn the patch tokens into one class token.

The SimA classifier (UCDvision/sima ``sima.py``; CaiT / XCiT layout) prepends a learnable
class token to the patch tokens after the last SimA block and runs two class-attention
blocks, in which only the class token is updated. Classification only: the dense
backbone (``SimAXCiT``) ends before them.

Class attention is softmax-free like SimA (``shared/spec/attention.md`` §2.2): per head,
Q and K of all ``1 + N`` tokens are l1-normalised along the tokens (eps ``1e-6``), the
class token's weights are ``a[n] = sum_c q_cls[c] * k[n, c]`` (no scale, no softmax),
and its new value is ``proj(a @ V)``. The cost is linear in ``N``.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath


class SimAClassAttention(nn.Module):
    """Softmax-free class attention: updates token 0 of ``(B, 1 + N, C)``, keeps the rest.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads (``C`` must be divisible by it).
        qkv_bias: bias of the q/k/v projection.
        proj_drop: dropout after the output projection.
    """

    def __init__(self, embed_dims: int, num_heads: int, qkv_bias: bool = True,
                 proj_drop: float = 0.) -> None:
        super().__init__()
        if embed_dims % num_heads:
            raise ValueError(f'SimAClassAttention: embed_dims {embed_dims} is not divisible by '
                             f'num_heads {num_heads}')
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, 1 + N, C)``, class token first. Returns the same shape with the
        class token replaced by its attention output."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, 1 + N, d)
        # l1 normalisation of every channel over the tokens (class token included)
        q = F.normalize(q, p=1.0, dim=-2, eps=1e-6)
        k = F.normalize(k, p=1.0, dim=-2, eps=1e-6)
        weights = (q[:, :, :1] * k).sum(dim=-1)  # (B, heads, 1 + N): a[n] = q_cls . k[n]
        cls_token = (weights.unsqueeze(2) @ v).transpose(1, 2).reshape(B, 1, C)
        cls_token = self.proj_drop(self.proj(cls_token))
        return torch.cat([cls_token, x[:, 1:]], dim=1)


class ClassAttentionBlock(nn.Module):
    """Class-attention block (CaiT / XCiT layout with SimA's class attention):

    ``x += g1 * CA(LN1(x))``; then ``LN2`` on every token (``tokens_norm=True``) or on the
    class token only; then ``x += [g2 * MLP(cls), patch tokens]`` (the official residual:
    patch tokens never pass through the MLP and are added to themselves). Parameter names
    follow the official ``cls_attn_blocks.{j}``.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads.
        mlp_ratio: hidden/``C`` ratio of the MLP.
        qkv_bias: bias of the q/k/v projection.
        drop_rate: dropout after the projections and in the MLP.
        drop_path: stochastic depth (the official classifiers use 0 here).
        layer_scale_init_value: initial ``gamma1, gamma2`` (the official ``eta``);
            ``None``: no LayerScale.
        tokens_norm: ``LN2`` on all tokens (every official variant except nano) or on the
            class token only.
    """

    def __init__(self, embed_dims: int, num_heads: int, mlp_ratio: float = 4.,
                 qkv_bias: bool = True, drop_rate: float = 0., drop_path: float = 0.,
                 layer_scale_init_value: Optional[float] = 1.0,
                 tokens_norm: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.attn = SimAClassAttention(embed_dims, num_heads, qkv_bias, drop_rate)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(embed_dims, eps=1e-6)
        hidden = int(embed_dims * mlp_ratio)
        self.mlp = nn.Sequential()
        self.mlp.add_module('fc1', nn.Linear(embed_dims, hidden))
        self.mlp.add_module('act', nn.GELU())
        self.mlp.add_module('drop1', nn.Dropout(drop_rate))
        self.mlp.add_module('fc2', nn.Linear(hidden, embed_dims))
        self.mlp.add_module('drop2', nn.Dropout(drop_rate))
        if layer_scale_init_value is None:
            self.gamma1 = self.gamma2 = None
        else:
            self.gamma1 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))
            self.gamma2 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))
        self.tokens_norm = tokens_norm

    @staticmethod
    def _scale(gamma: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x if gamma is None else gamma * x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, 1 + N, C)``, class token first. Returns the same shape."""
        x = x + self.drop_path(self._scale(self.gamma1, self.attn(self.norm1(x))))
        if self.tokens_norm:
            x = self.norm2(x)
        else:
            x = torch.cat([self.norm2(x[:, :1]), x[:, 1:]], dim=1)
        # as the official block: the residual adds the MLP branch of the class token and
        # the patch tokens themselves (with stochastic depth off they leave the block
        # doubled; the next block's LN1 and the l1-normalised keys are insensitive to it,
        # its values are not)
        branch = torch.cat([self._scale(self.gamma2, self.mlp(x[:, :1])), x[:, 1:]], dim=1)
        return x + self.drop_path(branch)
