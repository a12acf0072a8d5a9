"""Checkpoint conversion workflow used by ``tools/convert_checkpoint.py``.

Pure conversion lives in ``flatten_mm.checkpoints.converters``; this module adds family detection,
verification against the target backbone and readable errors.
"""
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from ..registry import MODELS
from .converters import (BACKBONES, CONVERTERS, convert_classifier, guess_family,
                         key_mismatch_report, unwrap_checkpoint)

#: what an official ImageNet file converts to: the dense backbone (``init_cfg`` of our
#: detection / segmentation configs) or the whole classifier (mmpretrain configs)
TARGETS = ('backbone', 'classifier')


class ConversionError(ValueError):
    """The checkpoint does not fit the requested family / variant."""


def build_backbone(family: str, arch) -> torch.nn.Module:
    """An un-initialised flatten_mm backbone of ``family`` / ``arch`` (for key checks)."""
    if family not in BACKBONES:
        raise ConversionError(f'no backbone is associated with family {family!r}')
    # the registry imports flatten_mm.models (its ``locations``) on the first build
    return MODELS.build(dict(type=f'flatten_mm.{BACKBONES[family]}', arch=arch))


def _detect_family(state_dict: Mapping[str, torch.Tensor], family: Optional[str]) -> str:
    looks_like = guess_family(state_dict)
    if family is None:
        if len(looks_like) != 1:
            raise ConversionError(
                'cannot tell the checkpoint family from its keys '
                f'(candidates: {looks_like or "none"}); pass --family, one of {sorted(CONVERTERS)}')
        family = looks_like[0]
    if family not in CONVERTERS:
        raise ConversionError(f'unknown family {family!r}; available: {sorted(CONVERTERS)}')
    return family


def convert_classifier_checkpoint(
        ckpt: Mapping, family: Optional[str] = None, arch=None, use_ema: bool = False,
        expected: Optional[Callable[[str, object, int], Mapping[str, torch.Tensor]]] = None
) -> Tuple[Dict[str, torch.Tensor], List[str], str]:
    """Unwrap and convert an official ImageNet classifier to the mmpretrain classifier of
    ``flatten_mm.models.classification`` (``backbone.`` / ``neck.`` / ``head.`` keys).

    Args:
        ckpt: the loaded checkpoint object.
        family: converter name; detected from the keys if ``None``.
        arch: the variant the checkpoint is for (checked with ``expected``).
        use_ema: take the EMA weights of the checkpoint.
        expected: ``(family, arch, num_classes) -> state dict`` of the target classifier
            (``flatten_mm.models.classification.classifier_state_dict``); with ``arch``,
            keys and shapes must match it exactly.

    Returns:
        ``(state_dict, dropped_keys, family)``.

    Raises:
        ConversionError: unknown / undetectable family, no classification head, or keys
            that do not fit ``expected``.
    """
    state_dict = unwrap_checkpoint(ckpt, use_ema=use_ema)
    family = _detect_family(state_dict, family)
    try:
        converted, dropped = convert_classifier(state_dict, family)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    if expected is not None and arch is not None:
        target = expected(family, arch, converted['head.fc.weight'].shape[0])
        problem = key_mismatch_report(converted, target)
        if problem:
            raise ConversionError(f'checkpoint does not match the {BACKBONES[family]} '
                                  f'arch={arch!r} classifier:\n{problem}')
    return converted, dropped, family


def convert_checkpoint(ckpt: Mapping, family: Optional[str] = None, arch=None,
                       use_ema: bool = False) -> Tuple[Dict[str, torch.Tensor], List[str], str]:
    """Unwrap, convert and (when ``arch`` is given) verify an official checkpoint.

    Args:
        ckpt: the loaded checkpoint object.
        family: converter name (see ``CONVERTERS``); detected from the keys if ``None``.
        arch: variant of the target backbone; when given, the converted keys and shapes
            must match that backbone exactly.
        use_ema: take the EMA weights of the checkpoint.

    Returns:
        ``(state_dict, dropped_keys, family)``.

    Raises:
        ConversionError: unknown/undetectable family, or keys/shapes that do not fit
            (the message lists missing and unexpected keys and the family the
            checkpoint looks like).
    """
    state_dict = unwrap_checkpoint(ckpt, use_ema=use_ema)
    looks_like = guess_family(state_dict)
    family = _detect_family(state_dict, family)
    converted, dropped = CONVERTERS[family](state_dict)
    if arch is not None:
        model = build_backbone(family, arch)
        expected = model.state_dict()
        # parameters that only the dense backbone has (new output norms / adapters)
        dense_only = getattr(model, 'dense_only_prefixes', ())
        expected = {k: v for k, v in expected.items()
                    if not any(k.startswith(p) for p in dense_only)}
        problem = key_mismatch_report(converted, expected)
        if problem:
            hint = (f'the checkpoint looks like {looks_like}' if looks_like and family not in looks_like
                    else f'the checkpoint looks like {looks_like or "no known family"}')
            raise ConversionError(
                f'checkpoint does not match {BACKBONES.get(family, family)} arch={arch!r} '
                f'({hint}):\n{problem}')
    return converted, dropped, family
