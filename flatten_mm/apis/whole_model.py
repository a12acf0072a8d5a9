"""Whole-model conversion workflow: official mmdet 2.x / mmseg 0.x checkpoint -> a checked
mmdet 3.x / mmseg 1.x checkpoint of one of our configs (``tools/convert_checkpoint.py
--config``, ``tools/download_weights.py``).

The pure renaming is ``flatten_mm.checkpoints.converters.whole_model``; this module builds the
config's model and holds the converted keys to it: every key of the built model present,
none left over, equal shapes. ``tools/test.py CONFIG converted.pth`` then evaluates it.
"""
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from mmengine.config import Config

from ..checkpoints.convert import ConversionError
from ..checkpoints.converters import key_mismatch_report
from ..checkpoints.converters.whole_model import convert_meta, convert_whole_model, is_whole_model
from .forward import build_model


def model_state_dict(ckpt: Mapping) -> Dict[str, torch.Tensor]:
    """The tensors of a runner checkpoint (``state_dict`` unwrapped, ``module.`` stripped),
    every key kept (unlike ``unwrap_checkpoint``, which keeps only the backbone)."""
    sd = ckpt.get('state_dict', ckpt) if isinstance(ckpt, Mapping) else ckpt
    if not isinstance(sd, Mapping):
        raise ConversionError(f'the checkpoint holds a {type(sd).__name__}, not a state dict')
    return OrderedDict((k[7:] if k.startswith('module.') else k, v) for k, v in sd.items()
                       if isinstance(v, torch.Tensor))


def checkpoint_is_whole_model(ckpt: Any) -> bool:
    """Whether a loaded checkpoint holds a whole detector / segmentor."""
    try:
        return is_whole_model(model_state_dict(ckpt))
    except ConversionError:
        return False


def build_config_model(config: str, cfg_options: Optional[Mapping] = None) -> torch.nn.Module:
    """The (un-initialised) model of an mmdet 3.x / mmseg 1.x config, built on CPU
    (``flatten_mm.apis.forward.build_model``: the config's scope and imports)."""

    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(dict(cfg_options))
    return build_model(cfg)


def convert_whole_checkpoint(ckpt: Mapping, config: str,
                             cfg_options: Optional[Mapping] = None,
                             family: Optional[str] = None, source: str = ''
                             ) -> Tuple[Dict[str, Any], List[str], str]:
    """Convert a whole official checkpoint for ``config`` and check it against the
    config's model.

    Args:
        ckpt: the loaded official checkpoint (``{'state_dict', 'meta', 'optimizer'}``).
        config: the mmdet 3.x / mmseg 1.x config the result is for.
        cfg_options: overrides of ``config`` (``--cfg-options``).
        family: backbone converter family; detected from the keys when ``None``.
        source: where the checkpoint came from (recorded in ``meta``).

    Returns:
        ``(checkpoint, dropped_keys, family)``; ``checkpoint`` is
        ``{'state_dict': ..., 'meta': {'dataset_meta', 'source_meta', 'converted_from',
        'config', 'family'}}``.

    Raises:
        ConversionError: not a whole-model checkpoint, unknown backbone family, or keys /
            shapes that do not fit the config's model (the message lists the missing and
            unexpected keys and the shape mismatches).
    """
    state_dict = model_state_dict(ckpt)
    if not is_whole_model(state_dict):
        raise ConversionError(
            'not a whole detector / segmentor checkpoint (it needs backbone. keys and a neck '
            f'or *_head.); first keys: {list(state_dict)[:5]}. Convert ImageNet weights '
            'without --config.')
    try:
        converted, dropped, family = convert_whole_model(state_dict, family)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    model = build_config_model(config, cfg_options)
    expected = model.state_dict()
    problem = key_mismatch_report(converted, expected)
    if problem:
        raise ConversionError(
            f'the converted checkpoint ({family} backbone) does not match the model of '
            f'{config} ({type(model).__name__}, backbone {type(model.backbone).__name__}'
            f' arch {getattr(model.backbone, "arch_settings", "?")}):\n{problem}')
    meta = convert_meta(ckpt.get('meta') if isinstance(ckpt, Mapping) else None)
    meta.update(converted_from=str(source), config=str(config), family=family)
    return dict(state_dict=converted, meta=meta), dropped, family


def summarize_dropped(dropped: Sequence[str]) -> str:
    """``'backbone.head.* (2), ...'`` for the report of a conversion."""
    groups = Counter('.'.join(k.split('.')[:2]) if k.startswith('backbone.') else k.split('.')[0]
                     for k in dropped)
    return ', '.join(f'{g}.* ({n})' for g, n in sorted(groups.items()))
