"""Official QuadTree checkpoints -> ``QuadTreePVTv2``.

Accepted sources (``shared/spec/state_dicts.md`` §6):

* classification checkpoints (``classification/quadtree.py``; ``{'model': ...}``),
  QuadTree-B (``quadtree_b0..b4``) and QuadTree-A (``quadtreeA_b0``);
* detection / segmentation checkpoints (mmdet 2.x / mmseg 0.x ``{'state_dict': ...}``
  with ``backbone.`` prefixes; ``unwrap_checkpoint`` keeps only the backbone keys).

Both are the PVTv2 layout (``patch_embed{i}``, ``block{i}.{j}``, ``norm{i}``); the attention
parameters keep their official names (``q_proj``/``k_proj``/``v_proj`` 1x1 convs, ``proj``,
``py_att.weight``, ``py_att.get_vs.{l}``, ``value_branchs.{t}.{0,2,3,5}``), so conversion is
the PVT-family prefix renaming plus dropping the classification ``head.*``. The dense and
classification trunks have identical parameters (the GELU -> ReLU swap and top-k 8 -> 32
have none).
"""
from typing import Mapping

import torch

from .common import ConvertResult, register_converter
from .flatten_pvt import HEAD_RULES, convert_pvt_family


def _is_quadtree(sd: Mapping) -> bool:
    return any(k.startswith('block1.') and '.attn.q_proj.' in k for k in sd) and \
        any(k.startswith('patch_embed1.') for k in sd)


@register_converter('quadtree', _is_quadtree, backbone='QuadTreePVTv2',
                    classifier_rules=HEAD_RULES)
def convert_quadtree(state_dict: Mapping[str, torch.Tensor]) -> ConvertResult:
    """Official QuadTree (A or B; classification or dense trunk) -> ``QuadTreePVTv2``.

    Idempotent: an already converted dict is returned unchanged.
    """
    return convert_pvt_family(state_dict)
