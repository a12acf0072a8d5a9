"""Official FLatten-CSwin classification checkpoints -> ``FLattenCSWin``.

Official layout (``shared/spec/state_dicts.md`` §4): ``stage1_conv_embed.{0,2}.*`` (conv,
LayerNorm), ``merge{m}.{conv,norm}.*``, ``stage{s}.{j}.{qkv,norm1,proj,norm2,mlp}.*``,
``stage{s}.{j}.attns.{b}.*`` (``scale``, ``positional_encoding``, ``get_v``, ``dwc``),
``norm.*``, ``head.*``. flatten_mm: ``stages.{s-1}.patch_embed.{proj,norm}`` (the stem
for stage 0, ``merge{m}`` for stage ``m``), ``stages.{s-1}.blocks.{j}.{norm1,norm2,mlp}``
and the block attention ``stages.{s-1}.blocks.{j}.attn.{qkv,proj,branches.{b}.*}``.
Dropped: ``head.*`` and the classification ``norm.*`` (the dense model has new per-output
``norm1..4``).
"""
from typing import Mapping

import torch

from .common import ConvertResult, register_converter, rename

DROP = (r'head\..*', r'norm\.(weight|bias)')
_EMBED = {'conv': 'proj', 'norm': 'norm'}


def _stage(m) -> str:
    """0-based stage index of the 1-based ``stage{s}`` in group 1."""
    return str(int(m.group(1)) - 1)


RULES = (
    (r'stage1_conv_embed\.0\.(.*)', r'stages.0.patch_embed.proj.\1'),
    (r'stage1_conv_embed\.2\.(.*)', r'stages.0.patch_embed.norm.\1'),
    (r'merge(\d)\.(conv|norm)\.(.*)',  # merge{m} precedes stage m+1 (0-based index m)
     lambda m: f'stages.{m.group(1)}.patch_embed.{_EMBED[m.group(2)]}.{m.group(3)}'),
    (r'stage(\d)\.(\d+)\.(qkv|proj)\.(.*)',
     lambda m: f'stages.{_stage(m)}.blocks.{m.group(2)}.attn.{m.group(3)}.{m.group(4)}'),
    (r'stage(\d)\.(\d+)\.attns\.(\d+)\.(.*)',
     lambda m: f'stages.{_stage(m)}.blocks.{m.group(2)}.attn.branches.{m.group(3)}.{m.group(4)}'),
    (r'stage(\d)\.(\d+)\.(.*)', lambda m: f'stages.{_stage(m)}.blocks.{m.group(2)}.{m.group(3)}'),
)

#: classifier: the final ``norm`` is the output norm of the last stage (``norm4``)
CLASSIFIER = ((r'norm\.(weight|bias)', r'backbone.norm4.\1'),
              (r'head\.(weight|bias)', r'head.fc.\1'))


def _is_flatten_cswin(sd: Mapping) -> bool:
    return 'stage1_conv_embed.0.weight' in sd and \
        any(k.endswith('.positional_encoding') and '.attns.' in k for k in sd)


@register_converter('flatten_cswin', _is_flatten_cswin, backbone='FLattenCSWin',
                    classifier_rules=CLASSIFIER)
def convert_flatten_cswin(state_dict: Mapping[str, torch.Tensor]) -> ConvertResult:
    """Rename an official FLatten-CSwin state dict (any size, 224 or 384).

    Idempotent: an already converted dict (``stages.*`` keys) is returned unchanged.
    """
    if any(k.startswith('stages.') for k in state_dict):
        return dict(state_dict), []
    return rename(state_dict, RULES, drop=DROP)
