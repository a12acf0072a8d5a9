"""Official checkpoint files as flatten_mm checkpoints, in memory.

* ``convert_official_file``: an official ImageNet file (backbone keys, checked against the
  backbone of ``family`` / ``arch``) or an official mmdet 2.x / mmseg 0.x whole model (key
  renaming and ``meta``) -> the checkpoint our configs load, ``{'state_dict', 'meta'}``.
* ``whole_model_as_ours``: what the checkpoint loaders (``flatten_mm.compat``) apply to
  every file they read: an official whole detector / segmentor of one of our families
  comes back converted (logged once per load), anything else unchanged.
"""
from collections import OrderedDict
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from mmengine.logging import print_log

from .convert import convert_checkpoint, convert_classifier_checkpoint
from .converters import guess_family
from .converters.whole_model import convert_meta, convert_whole_model, is_whole_model, \
    split_whole_model


def _model_state_dict(ckpt: Mapping) -> Optional[Dict[str, torch.Tensor]]:
    sd = ckpt.get('state_dict', ckpt)
    if not isinstance(sd, Mapping):
        return None
    return OrderedDict((k[7:] if k.startswith('module.') else k, v) for k, v in sd.items()
                       if isinstance(v, torch.Tensor))


def official_whole_model_family(ckpt: Any) -> Optional[str]:
    """The backbone family of an official whole-model checkpoint (backbone keys in an
    official layout that differs from ours), or ``None``."""
    if not isinstance(ckpt, Mapping):
        return None
    state_dict = _model_state_dict(ckpt)
    if not state_dict or not is_whole_model(state_dict):
        return None
    backbone, _ = split_whole_model(state_dict)
    families = guess_family(backbone)
    if len(families) != 1:
        return None
    converted, _, _ = convert_whole_model(state_dict, families[0])
    if set(converted) == set(state_dict):  # already our layout (e.g. SimA keeps its names)
        return None
    return families[0]


def convert_whole_file(ckpt: Mapping, family: Optional[str] = None, source: str = ''
                       ) -> Dict[str, Any]:
    """An official whole-model checkpoint -> ``{'state_dict', 'meta'}`` of mmdet 3.x /
    mmseg 1.x (``meta``: ``dataset_meta`` from ``CLASSES`` / ``PALETTE``, the source's
    versions under ``source_meta``, ``converted_from``, ``family``)."""
    state_dict = _model_state_dict(ckpt)
    converted, _, family = convert_whole_model(state_dict, family)
    meta = convert_meta(ckpt.get('meta'))
    meta.update(converted_from=str(source), family=family)
    return dict(state_dict=converted, meta=meta)


def whole_model_as_ours(ckpt: Any, source: str) -> Any:
    """``ckpt`` converted when it is an official whole model of one of our families (one
    log line says so), else ``ckpt`` itself."""
    family = official_whole_model_family(ckpt)
    if family is None:
        return ckpt
    print_log(f'{source} is an official {family} whole-model checkpoint (mmdet 2.x / '
              'mmseg 0.x layout): converted in memory to the layout of this release',
              logger='current')
    return convert_whole_file(ckpt, family, source)


def convert_official_file(ckpt: Mapping, family: str, arch: str, whole_model: bool,
                          source: str = '', target: str = 'backbone',
                          expected_classifier: Optional[Callable] = None) -> Dict[str, Any]:
    """The flatten_mm checkpoint of an official file: ``{'state_dict', 'meta'}``; an
    ImageNet file converts to the dense backbone (``target='backbone'``) or to the whole
    mmpretrain classifier (``'classifier'``, checked against ``expected_classifier``, see
    ``convert_classifier_checkpoint``).

    Raises:
        ConversionError: ImageNet weights that do not fit ``family`` / ``arch`` (the
            message lists the mismatching keys).
        ValueError: a whole model whose backbone family cannot be converted.
    """
    if whole_model:
        return convert_whole_file(ckpt, family, source)
    if target == 'classifier':
        state_dict, _, family = convert_classifier_checkpoint(ckpt, family, arch,
                                                              expected=expected_classifier)
    else:
        state_dict, _, family = convert_checkpoint(ckpt, family, arch)
    return dict(state_dict=state_dict,
                meta=dict(source=source, family=family, arch=arch, target=target))
