"""Parity adapter of SimA fixtures (official ``sima.py``, ``SimAVisionTransformer``).

The fixture's ``stage_outputs[i]`` is the token map after ``blocks[i]`` for every block
(SimA is isotropic); ``extra_outputs['patch_embed']`` is the conv patch embedding before
the positional encoding. Both are read from ``SimAXCiT`` (``forward_blocks`` and
``patch_embed``). The classification-only parts (class token, class-attention blocks,
norm, head) are ``SimAClassAttentionNeck`` and the head of the converted classifier:
``extra_outputs['cls_attn_block_outputs']``, ``features`` and ``logits`` are compared
through it (``core.compare_classifier``).
"""
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch
import torch.nn as nn

from flatten_mm.checkpoints.converters import CONVERTERS
from flatten_mm.models.backbones.sima_xcit import SimAXCiT
from flatten_mm.models.layers import nlc_to_nchw
from .core import REL_TOL, FixtureAdapter, StageResult, compare_tensors, register_adapter


@register_adapter
class SimAXCiTAdapter(FixtureAdapter):
    """``sima.py`` of UCDvision/sima."""

    name = 'sima_xcit'
    dense_only_prefixes = SimAXCiT.dense_only_prefixes

    def matches(self, fx: Mapping[str, Any]) -> bool:
        ctor = fx.get('official_ctor', {})
        return ctor.get('module') == 'sima.py' or ctor.get('cls') == 'SimAVisionTransformer'

    def backbone_cfg(self, fx: Mapping[str, Any]) -> dict:
        kw = fx['official_ctor']['kwargs']
        norm = kw.get('norm_layer', 'functools.partial(torch.nn.LayerNorm, eps=1e-06)')
        if 'eps=1e-06' not in str(norm):
            raise NotImplementedError(f'official norm_layer {norm!r}: SimAXCiT blocks use '
                                      'LayerNorm(eps=1e-6)')
        if kw.get('qk_scale') is not None:
            raise NotImplementedError('qk_scale (unused by the official SimA attention)')
        arch = dict(embed_dims=kw.get('embed_dim', 768), depth=kw.get('depth', 12),
                    num_heads=kw.get('num_heads', 12))
        # stage_outputs come from forward_blocks (every block); block_indices only have
        # to be valid for any depth
        depth = arch['depth']
        return dict(type=SimAXCiT, arch=arch, patch_size=kw.get('patch_size', 16),
                    in_channels=kw.get('in_chans', 3), mlp_ratio=kw.get('mlp_ratio', 4.),
                    qkv_bias=kw.get('qkv_bias', True), drop_rate=kw.get('drop_rate', 0.),
                    attn_drop_rate=kw.get('attn_drop_rate', 0.),
                    drop_path_rate=kw.get('drop_path_rate', 0.),
                    layer_scale_init_value=kw.get('eta', 1.0),
                    use_pos_embed=kw.get('use_pos', True),
                    block_indices=(depth - 1, ) * 4)

    def classifier_args(self, fx: Mapping[str, Any]) -> dict:
        kw = fx['official_ctor']['kwargs']
        return dict(tokens_norm=bool(kw.get('tokens_norm', False)),
                    num_layers=int(kw.get('cls_attn_layers', 2)))

    def classifier_points(self, fx: Mapping[str, Any], classifier: nn.Module
                          ) -> Dict[str, Tuple[nn.Module, torch.Tensor]]:
        """The output of every class-attention block (``extra_outputs
        ['cls_attn_block_outputs']``: class token first, then the patch tokens)."""
        refs = fx.get('extra_outputs', {}).get('cls_attn_block_outputs') or []
        return {f"extra_outputs['cls_attn_block_outputs'][{j}]": (block, ref)
                for j, (block, ref) in enumerate(zip(classifier.neck.cls_attn_blocks, refs))}

    def convert(self, fx: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
        converted, _ = CONVERTERS['sima_xcit'](fx['state_dict'])
        return converted

    def stage_outputs(self, model: nn.Module, x: torch.Tensor) -> Sequence[torch.Tensor]:
        """Every block's map, then the patch-embedding map (compared with
        ``extra_outputs['patch_embed']``)."""
        blocks = model.forward_blocks(x)
        tokens, hw = model.patch_embed(x)
        return list(blocks) + [nlc_to_nchw(tokens, hw)]

    def compare(self, fx: Mapping[str, Any], outputs: Sequence[torch.Tensor],
                rel_tol: float = REL_TOL) -> List[StageResult]:
        *blocks, patch_embed = outputs
        results = super().compare(fx, blocks, rel_tol)
        ref = fx.get('extra_outputs', {}).get('patch_embed')
        if ref is not None:
            results.append(compare_tensors("extra_outputs['patch_embed']", patch_embed, ref,
                                           rel_tol))
        return results
