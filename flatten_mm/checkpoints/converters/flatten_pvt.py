"""Official FLatten-PVT / FLatten-PVTv2 classification checkpoints -> flatten_mm.

Official layout (``shared/spec/state_dicts.md`` §1-2): ``patch_embed{i}.*``,
``pos_embed{i}`` (v1), ``block{i}.{j}.*``, ``norm{i}.*`` (v2), ``norm.*`` (v1, unused),
``head.*``. flatten_mm: ``stages.{i-1}.{patch_embed,pos_embed,blocks.{j},norm}``; the
PVTv2 MLP conv ``mlp.dwconv.dwconv`` becomes ``mlp.dwconv``. Attention parameters keep
their names (``q``, ``kv``, ``scale``, ``positional_encoding``, ``dwc``, ``sr``, ``norm``).
"""
from typing import Mapping

import torch

from .common import ConvertResult, register_converter, rename

#: the official linear head -> mmpretrain ``LinearClsHead`` (the classifier of every
#: PVT-family model averages the last stage map; PVT v1's unused ``norm`` stays dropped)
HEAD_RULES = ((r'head\.(weight|bias)', r'head.fc.\1'), )


def _stage_rules():
    """Regex rules mapping official PVT-family keys to ``stages.*`` (1-based -> 0-based)."""

    def s(m, i=1):
        return str(int(m.group(i)) - 1)

    return [
        (r'patch_embed(\d)\.(.*)', lambda m: f'stages.{s(m)}.patch_embed.{m.group(2)}'),
        (r'pos_embed(\d)', lambda m: f'stages.{s(m)}.pos_embed'),
        (r'block(\d)\.(\d+)\.mlp\.dwconv\.dwconv\.(.*)',
         lambda m: f'stages.{s(m)}.blocks.{m.group(2)}.mlp.dwconv.{m.group(3)}'),
        (r'block(\d)\.(\d+)\.(.*)', lambda m: f'stages.{s(m)}.blocks.{m.group(2)}.{m.group(3)}'),
        (r'norm(\d)\.(.*)', lambda m: f'stages.{s(m)}.norm.{m.group(2)}'),
    ]


def convert_pvt_family(state_dict: Mapping[str, torch.Tensor]) -> ConvertResult:
    """Rename any official PVT-family (FLatten-PVT/-PVTv2, QuadTree) state dict.

    Drops the classification ``head.*`` and the unused final ``norm.*`` of PVT v1.
    Idempotent: an already converted dict is returned unchanged.
    """
    if any(k.startswith('stages.') for k in state_dict):
        return dict(state_dict), []
    return rename(state_dict, _stage_rules(), drop=[r'head\..*', r'norm\.(weight|bias)'])


def _is_flatten_pvt_v2(sd: Mapping) -> bool:
    return any(k.endswith('attn.positional_encoding') for k in sd) and \
        any('mlp.dwconv.dwconv' in k for k in sd) and 'pos_embed1' not in sd


def _is_flatten_pvt(sd: Mapping) -> bool:
    return 'pos_embed1' in sd and any(k.startswith('block1.') for k in sd)


@register_converter('flatten_pvt_v2', _is_flatten_pvt_v2, backbone='FLattenPVTv2',
                    classifier_rules=HEAD_RULES)
def convert_flatten_pvt_v2(state_dict: Mapping[str, torch.Tensor]) -> ConvertResult:
    """Official FLatten-PVTv2 -> ``FLattenPVTv2``."""
    return convert_pvt_family(state_dict)


@register_converter('flatten_pvt', _is_flatten_pvt, backbone='FLattenPVT',
                    classifier_rules=HEAD_RULES)
def convert_flatten_pvt(state_dict: Mapping[str, torch.Tensor]) -> ConvertResult:
    """Official FLatten-PVT (v1) -> ``FLattenPVT``."""
    return convert_pvt_family(state_dict)
