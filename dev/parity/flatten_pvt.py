"""Parity adapter of FLatten-PVT (v1) and FLatten-PVTv2 fixtures."""
from typing import Any, Dict, List, Mapping, Sequence

import torch
import torch.nn as nn

from flatten_mm.checkpoints.converters import CONVERTERS
from flatten_mm.models.backbones.pvt import FLattenPVT, FLattenPVTv2
from .core import FixtureAdapter, register_adapter


def official_pvt_attn_cfgs(kw: Mapping[str, Any]) -> List[dict]:
    """Per-stage ``attn_cfg`` equivalent to the official ``attn_type`` string
    (``L`` = focused linear attention with ``la_sr_ratios[i]``, ``S`` = softmax
    spatial-reduction attention with ``sr_ratios[i]``)."""
    attn_type = kw.get('attn_type', 'LLLL')
    la_sr = [int(c) for c in str(kw.get('la_sr_ratios', '1111'))]
    sr = list(kw.get('sr_ratios', (8, 4, 2, 1)))
    cfgs = []
    for i, t in enumerate(attn_type):
        if t == 'L':
            cfgs.append(dict(type='FocusedLinearAttention', sr_ratio=la_sr[i],
                             focusing_factor=kw.get('focusing_factor', 3),
                             kernel_size=kw.get('kernel_size', 5)))
        elif t == 'S':
            cfgs.append(dict(type='SpatialReductionAttention', sr_ratio=sr[i]))
        else:
            raise NotImplementedError(f'official attn_type letter {t!r} (only L and S are used '
                                      'by released models)')
    return cfgs


def check_norm_layer(kw: Mapping[str, Any]) -> None:
    norm = kw.get('norm_layer', 'functools.partial(torch.nn.LayerNorm, eps=1e-06)')
    if 'eps=1e-06' not in str(norm):
        raise NotImplementedError(f'official norm_layer {norm!r}: flatten_mm PVT blocks use '
                                  'LayerNorm(eps=1e-6)')


@register_adapter
class FLattenPVTAdapter(FixtureAdapter):
    """``models/flatten_pvt.py`` / ``models/flatten_pvt_v2.py`` of FLatten-Transformer."""

    name = 'flatten_pvt'
    _modules = {'models/flatten_pvt.py': (FLattenPVT, 'flatten_pvt'),
                'models/flatten_pvt_v2.py': (FLattenPVTv2, 'flatten_pvt_v2')}

    def matches(self, fx: Mapping[str, Any]) -> bool:
        return fx.get('official_ctor', {}).get('module') in self._modules

    def backbone_cfg(self, fx: Mapping[str, Any]) -> dict:
        kw = fx['official_ctor']['kwargs']
        check_norm_layer(kw)
        if kw.get('patch_size', 4) != 4:
            raise NotImplementedError('patch_size other than 4')
        cls, _ = self._modules[fx['official_ctor']['module']]
        arch = dict(embed_dims=tuple(kw['embed_dims']), depths=tuple(kw['depths']),
                    num_heads=tuple(kw['num_heads']), mlp_ratios=tuple(kw['mlp_ratios']))
        extra = {'linear': kw['linear']} if 'linear' in kw else {}
        return dict(type=cls, arch=arch, attn_cfg=official_pvt_attn_cfgs(kw),
                    pretrain_img_size=kw.get('img_size', 224), qkv_bias=kw.get('qkv_bias', True),
                    drop_path_rate=kw.get('drop_path_rate', 0.), **extra)

    def family(self, fx: Mapping[str, Any]) -> str:
        return self._modules[fx['official_ctor']['module']][1]

    def convert(self, fx: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
        family = self.family(fx)
        converted, _ = CONVERTERS[family](fx['state_dict'])
        return converted

    def stage_outputs(self, model: nn.Module, x: torch.Tensor) -> Sequence[torch.Tensor]:
        # PVTv2: after norm{i}; PVT v1: after the last block (no stage norm) --
        # exactly what the backbone returns with out_indices=(0, 1, 2, 3).
        return model(x)
