"""Parity adapter of FLatten-Swin fixtures (``models/flatten_swin.py``,
``FLattenSwinTransformer``)."""
from typing import Any, Dict, List, Mapping, Sequence

import torch
import torch.nn as nn

from flatten_mm.checkpoints.converters import CONVERTERS
from flatten_mm.models.backbones.flatten_swin import FLattenSwin
from .core import FixtureAdapter, register_adapter


def official_softmax_window(window_size: int) -> int:
    """Window of the official ``S`` blocks: 7 when ``window_size <= 56``, else 12
    (``shared/spec/backbones.md`` §1.3, FLatten issue #29)."""
    return 7 if window_size <= 56 else 12


def official_swin_attn_cfgs(kw: Mapping[str, Any]) -> List[dict]:
    """Per-stage ``attn_cfg`` equivalent to an official FLatten-Swin model.

    Official per block: ``window = min(window, min(resolution))`` and no shift when
    ``min(resolution) <= window``. A linear (``L``) stage whose window covers its whole
    map is global FLA (positional table = the stage grid); otherwise it is windowed FLA
    with that window (cyclic shift in odd blocks, no mask). A softmax (``S``) stage is
    Swin window attention with the clamped softmax window. The no-shift rule is the
    flatten_mm per-axis rule (a single window along an axis is never shifted), identical
    for the square maps of the official models.
    """
    img = kw.get('img_size', 224)
    patch = kw.get('patch_size', 4)
    window = kw.get('window_size', 7)
    attn_type = kw.get('attn_type', 'LLLL')
    if len(attn_type) != 4 or set(attn_type) - {'L', 'S'}:
        raise NotImplementedError(f'official attn_type {attn_type!r}: only per-stage L/S strings '
                                  '(no M<k> mixed stages) are supported')
    cfgs = []
    for i, t in enumerate(attn_type):
        res = img // patch // 2**i
        if t == 'L':
            eff = min(window, res)
            cfgs.append(dict(type='FocusedLinearAttentionQKV',
                             window_size=None if eff == res else eff,
                             focusing_factor=kw.get('focusing_factor', 3),
                             kernel_size=kw.get('kernel_size', 5)))
        else:
            cfgs.append(dict(type='ShiftedWindowAttention',
                             window_size=min(official_softmax_window(window), res)))
    return cfgs


@register_adapter
class FLattenSwinAdapter(FixtureAdapter):
    """FLatten-Swin classification model -> ``FLattenSwin`` (stage outputs before the
    new output norms, read with ``FLattenSwin.forward_raw``)."""

    name = 'flatten_swin'
    dense_only_prefixes = FLattenSwin.dense_only_prefixes

    def matches(self, fx: Mapping[str, Any]) -> bool:
        ctor = fx.get('official_ctor', {})
        return ctor.get('module') == 'models/flatten_swin.py'

    def backbone_cfg(self, fx: Mapping[str, Any]) -> dict:
        kw = fx['official_ctor']['kwargs']
        if kw.get('patch_size', 4) != 4:
            raise NotImplementedError('FLattenSwin has a fixed patch size of 4')
        if kw.get('ape', False):
            raise NotImplementedError('absolute position embedding (ape=True) is not supported')
        if not kw.get('patch_norm', True):
            raise NotImplementedError('patch_norm=False is not supported')
        if kw.get('qk_scale') is not None:
            raise NotImplementedError('qk_scale other than None is not supported')
        if 'norm_layer' in kw and 'LayerNorm' not in str(kw['norm_layer']):
            raise NotImplementedError(f"norm_layer {kw['norm_layer']!r}")
        arch = dict(embed_dims=kw['embed_dim'], depths=tuple(kw['depths']),
                    num_heads=tuple(kw['num_heads']))
        return dict(type=FLattenSwin, arch=arch, in_channels=kw.get('in_chans', 3),
                    attn_cfg=official_swin_attn_cfgs(kw),
                    pretrain_img_size=kw.get('img_size', 224),
                    mlp_ratio=kw.get('mlp_ratio', 4.), qkv_bias=kw.get('qkv_bias', True),
                    drop_path_rate=kw.get('drop_path_rate', 0.))

    def convert(self, fx: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
        converted, _ = CONVERTERS['flatten_swin'](fx['state_dict'])
        return converted

    def stage_outputs(self, model: nn.Module, x: torch.Tensor) -> Sequence[torch.Tensor]:
        return model.forward_raw(x)
