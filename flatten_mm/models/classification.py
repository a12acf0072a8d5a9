"""ImageNet classifiers of the dense backbones, as mmpretrain ``ImageClassifier`` configs.

Each official classifier is its trunk plus what it has after the last stage. The dense
backbone is that trunk; the rest is a neck and mmpretrain's ``LinearClsHead``:

* FLatten-PVT (v1): the official model averages the stage-4 tokens (its final ``norm``
  is never applied): ``out_indices=(3,)`` and ``GlobalAveragePooling``;
* FLatten-PVTv2, QuadTree, PVTv2: stage-4 ``norm4``, then the mean: ``out_indices=(3,)``
  (the stage norm is part of the stage) and ``GlobalAveragePooling``;
* FLatten-Swin / FLatten-CSwin: the final ``norm``, then the mean: ``out_indices=(3,)``,
  whose output norm (``norm3`` / ``norm4``) is that norm, and ``GlobalAveragePooling``;
* SimA-XCiT: class token, two class-attention blocks and ``norm``: the token map after
  the last block (the identity adapter of the patch stride) and
  ``flatten_mm.SimAClassAttentionNeck``.

The head is ``LinearClsHead`` (``head.fc``). ``classifier_cfg`` writes the config for any
backbone config; ``configs/mmpretrain`` spells the same dicts out with the training
recipe, and ``flatten_mm.checkpoints.converters.convert_classifier`` maps the official
classification checkpoints onto exactly these modules.
"""
import copy
from typing import Dict, Optional

import torch
import torch.nn as nn
from mmengine.registry import DefaultScope

from ..checkpoints.converters import BACKBONES
from ..registry import MODELS
from .catalogue import BackboneSpec, _meta_parameters

#: SimA archs whose class-attention blocks normalise only the class token (the official
#: ``tokens_norm=False``); every other official SimA model has ``tokens_norm=True``
SIMA_CLS_TOKEN_NORM_ONLY = ('n12', 'nano_12')
#: the official heads' initialisation (``trunc_normal_(std=.02)``, zero bias)
HEAD_INIT = dict(type='TruncNormal', layer='Linear', std=.02, bias=0.)


def _build_meta(backbone_cfg: dict) -> nn.Module:
    """The backbone of ``backbone_cfg`` with parameters on the meta device (no memory)."""
    with _meta_parameters():
        return MODELS.build(copy.deepcopy(backbone_cfg))


def _scoped(cfg: dict) -> dict:
    """A copy of ``cfg`` whose string ``type`` carries the ``flatten_mm.`` scope (the
    classifier is built from mmpretrain's registry)."""
    cfg = dict(cfg)
    if isinstance(cfg.get('type'), str) and '.' not in cfg['type']:
        cfg['type'] = f'flatten_mm.{cfg["type"]}'
    return cfg


def _is_sima(cfg: dict) -> bool:
    kind = cfg.get('type')
    return getattr(kind, '__name__', str(kind)).split('.')[-1] == 'SimAXCiT'


def classification_backbone(backbone_cfg: dict) -> dict:
    """The backbone config of the classifier: the official classifier's last feature
    map only (``out_indices`` of the last stage; for SimA the token map after the last
    block, through the identity adapter)."""
    cfg = _scoped(backbone_cfg)
    if _is_sima(cfg):
        model = _build_meta(dict(cfg, out_indices=(0, 1, 2, 3)))
        token_map = model.map_strides.index(model.patch_size)
        return dict(cfg, out_indices=(token_map, ), block_indices=(model.depth - 1, ) * 4)
    return dict(cfg, out_indices=(_build_meta(cfg).num_stages - 1, ))


def classifier_neck(backbone_cfg: dict, tokens_norm: Optional[bool] = None,
                    num_layers: int = 2) -> dict:
    """The neck after ``backbone_cfg`` (see the module doc). SimA only: ``tokens_norm``
    ``None`` follows the official variant (``SIMA_CLS_TOKEN_NORM_ONLY``); ``num_layers``
    class-attention blocks (2 in every official model), with the trunk's heads, LayerScale
    init, MLP ratio, q/k/v bias and dropout."""
    cfg = _scoped(backbone_cfg)
    if not _is_sima(cfg):
        return dict(type='GlobalAveragePooling')
    model = _build_meta(dict(cfg, out_indices=(0, 1, 2, 3)))
    if tokens_norm is None:
        arch = cfg.get('arch', 's12')
        base = arch.lower().split('-p')[0].split('_p')[0] if isinstance(arch, str) else None
        tokens_norm = base not in SIMA_CLS_TOKEN_NORM_ONLY
    neck = dict(type='flatten_mm.SimAClassAttentionNeck', embed_dims=model.embed_dims,
                num_heads=model.num_heads, layer_scale_init_value=model.layer_scale_init_value,
                tokens_norm=tokens_norm)
    # the other arguments only where they differ from the neck's defaults (the trunk's)
    for key, value, default in (('num_layers', num_layers, 2),
                                ('mlp_ratio', cfg.get('mlp_ratio', 4.), 4.),
                                ('qkv_bias', cfg.get('qkv_bias', True), True),
                                ('drop_rate', cfg.get('drop_rate', 0.), 0.)):
        if value != default:
            neck[key] = value
    return neck


def classifier_cfg(backbone_cfg: dict, num_classes: int = 1000,
                   tokens_norm: Optional[bool] = None, num_layers: int = 2,
                   **head: Dict) -> dict:
    """mmpretrain ``ImageClassifier`` config of the official classifier around
    ``backbone_cfg`` (e.g. ``dict(type='flatten_mm.FLattenSwin', arch='t')``).

    Args:
        backbone_cfg: any flatten_mm backbone config; ``out_indices`` (and SimA's
            ``block_indices``) are set for classification.
        num_classes: classes of the ``LinearClsHead``.
        tokens_norm, num_layers: SimA only, see ``classifier_neck``.
        **head: other ``LinearClsHead`` arguments (``loss``, ``topk``, ``cal_acc``).
    """
    backbone = classification_backbone(backbone_cfg)
    channels = _build_meta(backbone).out_channels[-1]
    return dict(
        type='ImageClassifier',
        backbone=backbone,
        neck=classifier_neck(backbone_cfg, tokens_norm, num_layers),
        head=dict(type='LinearClsHead', num_classes=num_classes, in_channels=channels,
                  init_cfg=dict(HEAD_INIT), **head))


#: backbone arguments of the official classifiers that differ from the dense defaults:
#: QuadTree was trained on ImageNet with top-k 8 and GELU value branches (its dense
#: models fine-tune with top-k 32 and ReLU, the backbone's default)
CLASSIFICATION_BACKBONE_ARGS: Dict[str, dict] = {
    'QuadTreePVTv2': dict(attn_cfg=dict(topk=8, value_act='gelu')),
}


def catalogue_classifier_cfg(spec: BackboneSpec, num_classes: int = 1000, **backbone) -> dict:
    """``classifier_cfg`` of a catalogue entry (``get_backbone_spec('flatten-swin-t')``)
    with the official classifier's backbone arguments (``CLASSIFICATION_BACKBONE_ARGS``);
    ``backbone`` overrides them."""
    args = {**copy.deepcopy(CLASSIFICATION_BACKBONE_ARGS.get(spec.cls_name, {})), **backbone}
    return classifier_cfg(spec.config(**args), num_classes)


def classifier_state_dict(family: str, arch, num_classes: int = 1000
                          ) -> Dict[str, torch.Tensor]:
    """Keys and shapes (meta tensors) of the classifier of converter ``family`` /
    ``arch`` with ``num_classes`` classes: what an official classifier converts to
    (``flatten_mm.checkpoints.convert.convert_classifier_checkpoint(expected=...)``).
    Needs mmpretrain."""
    cfg = classifier_cfg(dict(type=f'flatten_mm.{BACKBONES[family]}', arch=arch), num_classes)
    with _meta_parameters():
        return build_classifier(cfg).state_dict()


def build_classifier(cfg: dict) -> nn.Module:
    """Build an mmpretrain classifier config (e.g. ``classifier_cfg(...)``) in the
    ``mmpretrain`` scope, whatever the default scope of the process (mmdet's and mmseg's
    registries have no classifiers, and some names -- losses -- mean other classes there).
    Needs mmpretrain."""
    import mmpretrain.models  # noqa: F401  (optional dependency: registers ImageClassifier)
    from mmpretrain.registry import MODELS as MMPRETRAIN_MODELS
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        return MMPRETRAIN_MODELS.build(copy.deepcopy(cfg))
