"""The classification part of SimA after its trunk: class token, class attention, norm."""
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_

from ...registry import MODELS
from ..layers.class_attention import ClassAttentionBlock


@MODELS.register_module()
class SimAClassAttentionNeck(BaseModule):
    """SimA's classifier neck: the official ``cls_token``, ``cls_attn_blocks`` and final
    ``norm`` of ``SimAVisionTransformer`` (UCDvision/sima ``sima.py``), between the
    ``SimAXCiT`` trunk and a linear head.

    Takes the backbone's last map -- the token map after the last SimA block at stride
    ``patch_size`` (``SimAXCiT`` with the output whose adapter is the identity and
    ``block_indices`` at the last block; ``flatten_mm.models.classification`` writes that
    config) -- prepends the class token, runs the class-attention blocks and returns the
    normalised class token ``(B, C)`` for the head.

    Args:
        embed_dims: channels ``C`` of the trunk.
        num_heads: heads of the class attention (the trunk's).
        num_layers: class-attention blocks (2 in every official variant).
        mlp_ratio: hidden/``C`` ratio of their MLPs.
        qkv_bias: bias of their q/k/v projections.
        drop_rate: dropout in the blocks.
        layer_scale_init_value: initial LayerScale (the official ``eta``: 1.0 for 12-block,
            1e-5 for 24-block trunks); ``None``: no LayerScale.
        tokens_norm: ``norm2`` of each block on all tokens (every official variant but
            nano) instead of the class token only.
        init_cfg: mmengine init config; by default the official init (class token and
            linears truncated normal, std 0.02; unit LayerNorms).
    """

    def __init__(self, embed_dims: int, num_heads: int, num_layers: int = 2,
                 mlp_ratio: float = 4., qkv_bias: bool = True, drop_rate: float = 0.,
                 layer_scale_init_value: Optional[float] = 1.0, tokens_norm: bool = True,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        if num_layers < 0:
            raise ValueError(f'SimAClassAttentionNeck: num_layers must be >= 0, got {num_layers}')
        self.embed_dims = embed_dims
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims))
        self.cls_attn_blocks = nn.ModuleList([
            ClassAttentionBlock(embed_dims, num_heads, mlp_ratio, qkv_bias, drop_rate,
                                layer_scale_init_value=layer_scale_init_value,
                                tokens_norm=tokens_norm) for _ in range(num_layers)
        ])
        self.norm = nn.LayerNorm(embed_dims, eps=1e-6)

    def init_weights(self) -> None:
        if self.init_cfg is not None:
            super().init_weights()
            return
        trunc_normal_(self.cls_token, std=.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, inputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor]:
        """Args: the backbone's maps; the last is ``(B, C, Hp, Wp)``. Returns ``((B, C),)``,
        the normalised class token."""
        x = inputs[-1] if isinstance(inputs, (tuple, list)) else inputs
        if x.dim() != 4 or x.shape[1] != self.embed_dims:
            raise ValueError(f'SimAClassAttentionNeck expects a (B, {self.embed_dims}, H, W) '
                             f'token map, got shape {tuple(x.shape)}')
        tokens = x.flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(tokens.dtype), tokens], 1)
        for block in self.cls_attn_blocks:
            x = block(x)
        return (self.norm(x[:, 0]), )
