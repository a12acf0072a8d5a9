"""Official SimA classification checkpoints (UCDvision/sima ``sima.py``) -> ``SimAXCiT``.

Official layout (``shared/spec/state_dicts.md`` §5): ``cls_token``, ``patch_embed.proj.*``,
``pos_embeder.token_projection.*``, ``blocks.{j}.{gamma1,gamma2,gamma3,norm1,norm2,norm3,
attn.qkv,attn.proj,local_mp.{conv1,bn,conv2},mlp.{fc1,fc2}}``, ``cls_attn_blocks.*``,
``norm.*``, ``head.*``. ``SimAXCiT`` keeps the upstream names of everything it has, so
the conversion only drops the classification-only entries (``cls_token``,
``cls_attn_blocks.*``, ``norm.*``, ``head.*``). BatchNorm running statistics and
``num_batches_tracked`` are kept. The dense adapters ``fpn1.*``/``fpn2.*`` are new and
absent from the result (they keep their initialisation when loading).
"""
from typing import Mapping

import torch

from .common import ConvertResult, register_converter, rename

#: classification-only keys of the official model
SIMA_DROP = (r'cls_token', r'cls_attn_blocks\..*', r'norm\.(weight|bias)', r'head\..*')

#: classifier: class token, class-attention blocks and final norm form
#: ``SimAClassAttentionNeck`` (same names), the head is ``LinearClsHead``
CLASSIFIER = ((r'(cls_token|cls_attn_blocks\..*|norm\.(weight|bias))', r'neck.\1'),
              (r'head\.(weight|bias)', r'head.fc.\1'))


def _is_sima(sd: Mapping) -> bool:
    """SimA: XCiT block layout (``local_mp`` LPI, ``attn.qkv``) without XCiT's
    ``attn.temperature``."""
    keys = list(sd)
    return (any(k.startswith('blocks.') and k.endswith('.attn.qkv.weight') for k in keys)
            and any('.local_mp.' in k for k in keys)
            and not any(k.endswith('attn.temperature') for k in keys))


@register_converter('sima_xcit', _is_sima, backbone='SimAXCiT', classifier_rules=CLASSIFIER)
def convert_sima_xcit(state_dict: Mapping[str, torch.Tensor]) -> ConvertResult:
    """Official SimA -> ``SimAXCiT``: drop ``cls_token``, ``cls_attn_blocks.*``,
    ``norm.*`` and ``head.*``; other keys are unchanged. Idempotent (a converted dict
    has nothing left to drop).

    Returns:
        ``(converted, dropped_keys)``.
    """
    return rename(state_dict, rules=(), drop=SIMA_DROP)
