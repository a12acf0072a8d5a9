"""Shared helpers of the checkpoint converters (pure functions, no file I/O)."""
import re
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

StateDict = Dict[str, torch.Tensor]
ConvertResult = Tuple[StateDict, List[str]]

#: family name -> converter ``fn(state_dict) -> (converted, dropped_keys)``
CONVERTERS: Dict[str, Callable[[Mapping[str, torch.Tensor]], ConvertResult]] = {}
#: family name -> predicate telling whether an (unwrapped) official state dict looks like it
SIGNATURES: Dict[str, Callable[[Mapping[str, torch.Tensor]], bool]] = {}
#: family name -> name of the flatten_mm backbone class the converted dict loads into
BACKBONES: Dict[str, str] = {}
#: family name -> regex rules ``(official key, classifier key)`` of the classification-only
#: entries of the official classifier (head, final norm, class token...), mapped onto the
#: mmpretrain ``ImageClassifier`` of ``flatten_mm.models.classification``
CLASSIFIER_RULES: Dict[str, Tuple[Tuple[str, str], ...]] = {}


def register_converter(family: str, signature: Callable[[Mapping], bool],
                       backbone: Optional[str] = None,
                       classifier_rules: Tuple[Tuple[str, str], ...] = ()):
    """Decorator registering a converter, the key signature of its family, (optionally)
    the flatten_mm backbone class its output is for, and the rules that place the
    official classifier's own parts in the mmpretrain classifier (``convert_classifier``)."""

    def wrap(fn):
        CONVERTERS[family] = fn
        SIGNATURES[family] = signature
        if backbone is not None:
            BACKBONES[family] = backbone
        CLASSIFIER_RULES[family] = tuple(classifier_rules)
        return fn

    return wrap


WRAPPER_KEYS = ('state_dict', 'model', 'module')
EMA_KEYS = ('state_dict_ema', 'model_ema', 'ema_state_dict')
STRIP_PREFIXES = ('module.', 'backbone.')


def unwrap_checkpoint(ckpt: Mapping, use_ema: bool = False) -> StateDict:
    """Return the tensor dict inside a training checkpoint.

    Handles ``{'model': ...}`` (timm / FLatten / SimA / QuadTree classification),
    ``{'state_dict': ...}`` (mmengine / mmcv runners), EMA copies when ``use_ema``
    and a bare state dict. Prefixes ``module.`` (DDP) and ``backbone.`` (a detector or
    segmentor checkpoint: only the backbone keys are kept) are stripped.

    Raises:
        KeyError: ``use_ema`` is set and the checkpoint has no EMA weights.
        ValueError: no tensor dict could be found.
    """
    if use_ema:
        for key in EMA_KEYS:
            if key in ckpt:
                ckpt = ckpt[key]
                break
        else:
            raise KeyError(f'no EMA weights in the checkpoint (looked for {EMA_KEYS}); '
                           f'top-level keys: {sorted(ckpt)[:20]}')
    else:
        for key in WRAPPER_KEYS:
            if key in ckpt and isinstance(ckpt[key], Mapping):
                ckpt = ckpt[key]
                break
    if isinstance(ckpt, Mapping) and hasattr(ckpt, 'state_dict') and not isinstance(ckpt, dict):
        ckpt = ckpt.state_dict()
    tensors = OrderedDict((k, v) for k, v in ckpt.items() if isinstance(v, torch.Tensor))
    if not tensors:
        raise ValueError('no tensors found in the checkpoint; top-level keys: '
                         f'{sorted(ckpt)[:20] if isinstance(ckpt, Mapping) else type(ckpt)}')
    if any(k.startswith('module.') for k in tensors):
        tensors = OrderedDict((k[len('module.'):] if k.startswith('module.') else k, v)
                              for k, v in tensors.items())
    if any(k.startswith('backbone.') for k in tensors):
        tensors = OrderedDict((k[len('backbone.'):], v) for k, v in tensors.items()
                              if k.startswith('backbone.'))
    return tensors


def rename(state_dict: Mapping[str, torch.Tensor], rules: Iterable[Tuple[str, str]],
           drop: Iterable[str] = ()) -> ConvertResult:
    """Apply regex rename ``rules`` (first match wins) and drop keys matching ``drop``.

    Keys matching no rule and no drop pattern are kept unchanged.
    """
    rules = [(re.compile(p), r) for p, r in rules]
    drop = [re.compile(p) for p in drop]
    out: StateDict = OrderedDict()
    dropped: List[str] = []
    for key, value in state_dict.items():
        if any(p.fullmatch(key) for p in drop):
            dropped.append(key)
            continue
        new_key = key
        for pattern, repl in rules:
            if pattern.fullmatch(key):
                new_key = pattern.sub(repl, key)
                break
        out[new_key] = value
    return out, dropped


def key_mismatch_report(converted: Mapping[str, torch.Tensor],
                        expected: Mapping[str, torch.Tensor],
                        limit: int = 12) -> Optional[str]:
    """Describe missing / unexpected keys and shape mismatches, or ``None`` if they agree."""
    missing = [k for k in expected if k not in converted]
    unexpected = [k for k in converted if k not in expected]
    shapes = [f'{k}: checkpoint {tuple(converted[k].shape)} vs model {tuple(expected[k].shape)}'
              for k in expected if k in converted and converted[k].shape != expected[k].shape]
    if not (missing or unexpected or shapes):
        return None

    def fmt(title, items):
        if not items:
            return ''
        more = f' ... (+{len(items) - limit} more)' if len(items) > limit else ''
        return f'\n  {title} ({len(items)}): ' + ', '.join(items[:limit]) + more

    return (fmt('missing keys', missing) + fmt('unexpected keys', unexpected) +
            fmt('shape mismatches', shapes)).lstrip('\n')


def guess_family(state_dict: Mapping[str, torch.Tensor]) -> List[str]:
    """Families whose key signature the (unwrapped, official) state dict matches."""
    return [name for name, sig in SIGNATURES.items() if sig(state_dict)]
