"""Official FLatten-Swin classification checkpoints -> ``FLattenSwin``.

Official layout (``shared/spec/state_dicts.md`` §3): ``patch_embed.*``,
``layers.{i}.blocks.{j}.*``, ``layers.{i}.downsample.*``, ``norm.*``, ``head.*``.
flatten_mm: ``stages.{i}.blocks.{j}.*`` and ``stages.{i}.downsample.*``; attention and
MLP parameters keep their names (``attn.qkv``, ``attn.scale``,
``attn.positional_encoding``, ``attn.dwc``, ``attn.relative_position_bias_table``,
``attn.proj``, ``mlp.fc1/fc2``). Dropped: ``head.*``, the classification ``norm.*``
(the dense model has new per-output ``norm0..3``), and the buffers
``relative_position_index`` / ``attn_mask`` (recomputed for the actual window / size).
"""
from typing import Mapping

import torch

from .common import ConvertResult, register_converter, rename

DROP = (r'head\..*', r'norm\.(weight|bias)', r'.*\.relative_position_index', r'.*\.attn_mask')
RULES = (
    (r'layers\.(\d+)\.(blocks\.\d+\..*|downsample\..*)', r'stages.\1.\2'),
)

#: classifier: the final ``norm`` is the output norm of the last stage (``norm3``)
CLASSIFIER = ((r'norm\.(weight|bias)', r'backbone.norm3.\1'),
              (r'head\.(weight|bias)', r'head.fc.\1'))


def _is_flatten_swin(sd: Mapping) -> bool:
    return 'patch_embed.proj.weight' in sd and \
        any(k.startswith('layers.') and k.endswith('.attn.positional_encoding') for k in sd)


@register_converter('flatten_swin', _is_flatten_swin, backbone='FLattenSwin',
                    classifier_rules=CLASSIFIER)
def convert_flatten_swin(state_dict: Mapping[str, torch.Tensor]) -> ConvertResult:
    """Rename an official FLatten-Swin state dict (any size, 224 or 384).

    Idempotent: an already converted dict (``stages.*`` keys) is returned unchanged.
    """
    if any(k.startswith('stages.') for k in state_dict):
        return dict(state_dict), []
    return rename(state_dict, RULES, drop=DROP)
