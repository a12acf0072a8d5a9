"""Parity adapter of FLatten-CSwin fixtures (``models/flatten_cswin.py``,
``CSWinTransformer``)."""
from typing import Any, Dict, List, Mapping, Sequence

import torch
import torch.nn as nn

from flatten_mm.checkpoints.converters import CONVERTERS
from flatten_mm.models.backbones.flatten_cswin import FLattenCSWin
from .core import FixtureAdapter, register_adapter


def official_cswin_attn_cfgs(kw: Mapping[str, Any]) -> List[dict]:
    """Per-stage ``attn_cfg`` equivalent to an official FLatten-CSwin model.

    Official per stage (resolution ``R_i = img_size / 4 / 2^i``): a block is in the
    single-branch "last stage" mode when its split equals ``R_i`` or in stage 4.
    ``L`` stages use ``la_split_size`` (a ``'56-28-14-7'`` string) and are only
    well-defined in that single-branch mode (the official FLA cannot run on stripes);
    ``S`` stages use ``split_size`` and otherwise run two cross-shaped LePE branches.
    """
    img = kw.get('img_size', 224)
    patch = kw.get('patch_size', 4)
    attn_type = kw.get('attn_type', 'LLLL')
    if len(attn_type) != 4 or set(attn_type) - {'L', 'S'}:
        raise NotImplementedError(f'official attn_type {attn_type!r}: only per-stage L/S strings '
                                  '(no M<k> mixed stages) are supported')
    la_split = [int(s) for s in str(kw.get('la_split_size', '56-28-14-7')).split('-')]
    split = list(kw.get('split_size', (3, 5, 7)))
    if len(split) < 4:  # official CSWin uses split_size[-1] for the last stage
        split = split + [split[-1]] * (4 - len(split))
    cfgs = []
    for i, t in enumerate(attn_type):
        res = img // patch // 2**i
        last = i == 3
        if t == 'L':
            if not (last or la_split[i] == res):
                raise NotImplementedError(
                    f'stage {i + 1}: focused linear attention on stripes (la_split {la_split[i]} '
                    f'< resolution {res}) is not runnable in the official code; no reference')
            cfgs.append(dict(type='CrossShapedAttention', split_size=None,
                             branch_cfg=dict(type='FocusedLinearQKV', lepe=True,
                                             focusing_factor=kw.get('focusing_factor', 3),
                                             kernel_size=kw.get('kernel_size', 5))))
        else:
            global_ = last or split[i] == res
            cfgs.append(dict(type='CrossShapedAttention',
                             split_size=None if global_ else split[i],
                             branch_cfg=dict(type='LePEAttention')))
    return cfgs


@register_adapter
class FLattenCSWinAdapter(FixtureAdapter):
    """FLatten-CSwin classification model -> ``FLattenCSWin`` (stage outputs before the
    new output norms, read with ``FLattenCSWin.forward_raw``)."""

    name = 'flatten_cswin'
    dense_only_prefixes = FLattenCSWin.dense_only_prefixes

    def matches(self, fx: Mapping[str, Any]) -> bool:
        ctor = fx.get('official_ctor', {})
        return ctor.get('module') == 'models/flatten_cswin.py'

    def backbone_cfg(self, fx: Mapping[str, Any]) -> dict:
        kw = fx['official_ctor']['kwargs']
        if kw.get('patch_size', 4) != 4:
            raise NotImplementedError('FLattenCSWin has a fixed stem stride of 4')
        if kw.get('qk_scale') is not None:
            raise NotImplementedError('qk_scale other than None is not supported')
        if 'norm_layer' in kw and 'LayerNorm' not in str(kw['norm_layer']):
            raise NotImplementedError(f"norm_layer {kw['norm_layer']!r}")
        arch = dict(embed_dims=kw['embed_dim'], depths=tuple(kw['depth']),
                    num_heads=tuple(kw['num_heads']))
        return dict(type=FLattenCSWin, arch=arch, in_channels=kw.get('in_chans', 3),
                    attn_cfg=official_cswin_attn_cfgs(kw),
                    pretrain_img_size=kw.get('img_size', 224),
                    mlp_ratio=kw.get('mlp_ratio', 4.), qkv_bias=kw.get('qkv_bias', True),
                    drop_path_rate=kw.get('drop_path_rate', 0.))

    def convert(self, fx: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
        converted, _ = CONVERTERS['flatten_cswin'](fx['state_dict'])
        return converted

    def stage_outputs(self, model: nn.Module, x: torch.Tensor) -> Sequence[torch.Tensor]:
        return model.forward_raw(x)
