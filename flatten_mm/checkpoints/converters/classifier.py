"""Official ImageNet classifiers -> mmpretrain ``ImageClassifier`` state dicts.

The backbone target (``CONVERTERS[family]``) keeps the dense trunk and drops what the
official classifier has after it. The classifier target keeps both: the trunk under
``backbone.`` (the family converter's output), and the classification-only entries placed
by the family's ``CLASSIFIER_RULES`` -- ``head.*`` -> ``head.fc.*`` (``LinearClsHead``),
Swin / CSwin's final ``norm`` -> the last output norm of the backbone, SimA's class token,
class-attention blocks and ``norm`` -> ``neck.*`` (``SimAClassAttentionNeck``). The
result loads with ``strict=True`` into the classifier that
``flatten_mm.models.classification.classifier_cfg`` builds for the same variant.
"""
import re
from collections import OrderedDict
from typing import Mapping

import torch

from .common import CLASSIFIER_RULES, CONVERTERS, ConvertResult


def convert_classifier(state_dict: Mapping[str, torch.Tensor], family: str) -> ConvertResult:
    """Convert an official classifier of ``family`` (an unwrapped state dict).

    Returns:
        ``(state_dict, dropped)``: ``backbone.* / neck.* / head.*`` keys, and the official
        keys neither model uses (e.g. FLatten-PVT v1's never-applied ``norm``, Swin's
        run-time buffers).

    Raises:
        KeyError: ``family`` has no converter.
        ValueError: the checkpoint has no classification head (a dense backbone file, e.g.
            a converted or detection checkpoint): there is no classifier to convert.
    """
    if family not in CONVERTERS:
        raise KeyError(f'unknown family {family!r}; available: {sorted(CONVERTERS)}')
    if not any(k.startswith('head.') for k in state_dict):
        raise ValueError(f'the {family} checkpoint has no classification head (head.*): '
                         'it holds a backbone only; convert it with the backbone target')
    rules = [(re.compile(p), r) for p, r in CLASSIFIER_RULES[family]]
    out: 'OrderedDict[str, torch.Tensor]' = OrderedDict()
    trunk = OrderedDict()
    for key, value in state_dict.items():
        for pattern, repl in rules:
            if pattern.fullmatch(key):
                out[pattern.sub(repl, key)] = value
                break
        else:
            trunk[key] = value
    converted, dropped = CONVERTERS[family](trunk)
    backbone = OrderedDict((f'backbone.{k}', v) for k, v in converted.items())
    return OrderedDict(list(backbone.items()) + list(out.items())), dropped
