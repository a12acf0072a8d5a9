"""Whole detector / segmentor checkpoints (mmdet 2.x / mmseg 0.x) -> mmdet 3.x / mmseg 1.x.

An official detection or segmentation checkpoint (QuadTree's RetinaNet 1x, Mask R-CNN 1x
and Semantic FPN 160k files; ``shared/spec/state_dicts.md`` §6.1) is the mmcv 1.x runner's
``{'meta': ..., 'state_dict': ..., 'optimizer': ...}`` with every key prefixed by its
sub-module: ``backbone.``, ``neck.``, ``rpn_head.``, ``roi_head.``, ``bbox_head.``,
``decode_head.`` (``auxiliary_head.`` in mmseg models that have one).

* ``backbone.*``: the family converter (``CONVERTERS[family]``) on the keys without the
  prefix, then the prefix again;
* every other key: ``MODULE_RENAMES`` (mmdet 2.x -> 3.x and mmseg 0.x -> 1.x renames of
  the modules these checkpoints contain). For the FPN neck, RPN head, Shared2FC bbox head,
  FCN mask head, RetinaNet head and mmseg's FPNHead there are none: mmdet 3 and mmseg 1
  kept every parameter name and shape (checked against the models our configs build,
  ``tests/test_converters/test_whole_model.py``); the table is where a rename goes if a
  future checkpoint needs one. The optimizer state is dropped;
* ``meta``: mmdet 2.x / mmseg 0.x keep the class names in ``meta['CLASSES']`` (and the
  mmseg palette in ``meta['PALETTE']``); mmengine's runner reads
  ``meta['dataset_meta']`` (``classes``, ``palette``), so ``convert_meta`` moves them there
  and records the versions the file was written with.

Pure functions: no file I/O, no model building (``flatten_mm.apis.whole_model`` checks
the result against a config's model).
"""
import re
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from .common import CONVERTERS, StateDict, guess_family, rename

#: top-level sub-modules of mmdet / mmseg models besides the backbone
MODEL_PARTS = ('neck', 'rpn_head', 'roi_head', 'bbox_head', 'mask_head', 'decode_head',
               'auxiliary_head')

#: mmdet 2.x -> 3.x / mmseg 0.x -> 1.x key renames (regex, replacement), first match
#: wins; keys matching none are kept. Empty: none of the modules of the official
#: RetinaNet / Mask R-CNN / Semantic FPN checkpoints was renamed (see the module doc).
MODULE_RENAMES: Tuple[Tuple[str, str], ...] = ()


def is_whole_model(state_dict: Mapping[str, Any]) -> bool:
    """Whether a (unwrapped) state dict holds a whole detector / segmentor: ``backbone.``
    keys together with a neck or head (``neck.``, ``*_head.``)."""
    has_backbone = any(k.startswith('backbone.') for k in state_dict)
    has_rest = any(k.split('.', 1)[0] in MODEL_PARTS or re.match(r'[a-z_]+_head\.', k)
                   for k in state_dict)
    return has_backbone and has_rest


def split_whole_model(state_dict: Mapping[str, torch.Tensor]
                      ) -> Tuple[StateDict, StateDict]:
    """``(backbone keys without the prefix, every other key)``."""
    backbone, rest = OrderedDict(), OrderedDict()
    for key, value in state_dict.items():
        if key.startswith('backbone.'):
            backbone[key[len('backbone.'):]] = value
        else:
            rest[key] = value
    return backbone, rest


def convert_whole_model(state_dict: Mapping[str, torch.Tensor], family: Optional[str] = None
                        ) -> Tuple[StateDict, List[str], str]:
    """Convert an official mmdet 2.x / mmseg 0.x model state dict.

    Args:
        state_dict: the checkpoint's ``state_dict`` (``module.`` already stripped).
        family: converter of the backbone (``CONVERTERS``); detected from the backbone
            keys when ``None``.

    Returns:
        ``(converted, dropped_keys, family)``; dropped keys carry their full name
        (``backbone.head.weight``).

    Raises:
        ValueError: no ``backbone.`` keys, or a family that is unknown / cannot be told
            from the keys.
    """
    backbone, rest = split_whole_model(state_dict)
    if not backbone:
        raise ValueError('not a whole-model checkpoint: no key starts with "backbone." '
                         f'(first keys: {list(state_dict)[:5]})')
    if family is None:
        candidates = guess_family(backbone)
        if len(candidates) != 1:
            raise ValueError('cannot tell the backbone family from the backbone keys '
                             f'(candidates: {candidates or "none"}); pass the family, one of '
                             f'{sorted(CONVERTERS)}')
        family = candidates[0]
    if family not in CONVERTERS:
        raise ValueError(f'unknown family {family!r}; available: {sorted(CONVERTERS)}')
    converted_backbone, dropped_backbone = CONVERTERS[family](backbone)
    converted_rest, dropped_rest = rename(rest, MODULE_RENAMES)
    out: StateDict = OrderedDict((f'backbone.{k}', v) for k, v in converted_backbone.items())
    out.update(converted_rest)
    return out, [f'backbone.{k}' for k in dropped_backbone] + dropped_rest, family


_VERSION_KEYS = ('mmdet_version', 'mmseg_version', 'mmcv_version', 'time', 'epoch', 'iter',
                 'exp_name', 'seed')


def convert_meta(meta: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """mmdet 2.x / mmseg 0.x checkpoint ``meta`` -> the mmengine layout.

    ``CLASSES`` / ``PALETTE`` become ``dataset_meta['classes']`` / ``['palette']`` (tuples
    / lists of lists of ints, which ``torch.load(weights_only=True)`` reads); the versions,
    time and training progress of the source are kept under ``source_meta``. The pickled
    config text and environment report are not carried over.
    """
    meta = dict(meta or {})
    out: Dict[str, Any] = {}
    dataset_meta = {}
    if meta.get('CLASSES') is not None:
        dataset_meta['classes'] = tuple(str(c) for c in meta['CLASSES'])
    if meta.get('PALETTE') is not None:
        dataset_meta['palette'] = [[int(v) for v in color] for color in meta['PALETTE']]
    if dataset_meta:
        out['dataset_meta'] = dataset_meta
    source = {k: meta[k] for k in _VERSION_KEYS
              if k in meta and isinstance(meta[k], (str, int, float))}
    if source:
        out['source_meta'] = source
    return out
