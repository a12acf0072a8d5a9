"""Loading ``init_cfg=dict(type='Pretrained', ...)`` into a flatten_mm backbone, checked.

mmengine's ``PretrainedInit`` loads with ``strict=False`` and only *logs* missing /
unexpected keys and shape mismatches, so a checkpoint of the wrong family or variant (or
an official checkpoint that was never converted) leaves the backbone randomly
initialised after a warning buried in the log. ``load_pretrained`` reads the file the
same way (mmengine's ``CheckpointLoader``: local paths, URLs, ``prefix``), then refuses:

* an unreadable (truncated / corrupt) file -> ``CheckpointError`` naming the file;
* an official ImageNet file of the backbone's own family (official key layout) is
  converted in memory by the family's converter (``flatten_mm.checkpoints.converters``)
  and the log says so; the checks below then apply to the converted weights;
* by default, any missing or unexpected key or shape mismatch (parameters that only the
  dense backbone has, ``dense_only_prefixes``, are exempt) -> ``ValueError`` that lists
  them and names what the file looks like: an official family from
  ``flatten_mm.checkpoints.converters`` (convert it first), or the flatten_mm backbone whose key
  layout it has.

Positional tables are not a variant: a table stored for another grid -- an FLA
``positional_encoding`` or PVT v1 ``pos_embed`` of another ``pretrain_img_size``, a Swin
``relative_position_bias_table`` of another window (e.g. official FLatten-Swin-B-384
weights into arch ``b``, or 224 weights into ``b-384``) -- is resized to the model's
grid before the checks by the layer that owns it (its ``resize_loaded_tables``, the same
code its ``_load_from_state_dict`` runs), and the log names every resized key with its
old and new shape. Other widths, depths or heads are still refused.

A whole-model checkpoint -- an ImageNet classifier trained with ``configs/mmpretrain``
(``backbone.`` / ``neck.`` / ``head.`` keys) or a detector / segmentor -- given without
``prefix`` has its ``backbone.`` weights selected (logged), as ``prefix='backbone.'``
does; the checks below then apply to them.

A partial load is an explicit choice: ``init_cfg=dict(type='Pretrained', checkpoint=...,
strict=False)`` loads the matching part (e.g. a hybrid whose replaced attention stages
have other keys) and logs the rest as mmengine does; a file sharing no parameter at all
is still refused.
"""
import os.path as osp
import re
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from mmengine.logging import print_log
from mmengine.runner.checkpoint import CheckpointLoader, load_state_dict

from flatten_mm.checkpoints.converters import (BACKBONES, CONVERTERS, guess_family,
                                               key_mismatch_report, unwrap_checkpoint)

from ..checkpoints.io import CheckpointError
from ..registry import MODELS
from .zoo import SCHEME, missing_weights_message


def _normalise(key: str) -> str:
    return re.sub(r'\d+', '#', key)


_LAYOUTS: Dict[str, set] = {}


def _backbone_layouts() -> Dict[str, set]:
    """Key patterns (digits replaced by ``#``) of every registered backbone's default arch."""
    if not _LAYOUTS:
        MODELS.import_from_location()  # registers the backbones (flatten_mm.models)
        for name, cls in MODELS.module_dict.items():
            try:
                keys = cls().state_dict().keys()
            except Exception:  # a class without a buildable default: skip it
                continue
            _LAYOUTS[name] = {_normalise(k) for k in keys}
    return _LAYOUTS


def describe_state_dict(state_dict: Mapping[str, torch.Tensor]) -> str:
    """What a state dict looks like: the flatten_mm backbone whose key layout it has, or
    an official family (convert it first)."""
    patterns = {_normalise(k) for k in state_dict}
    if not patterns:
        return 'an empty state dict'
    scores: List[Tuple[float, str]] = sorted(
        ((len(patterns & layout) / len(patterns | layout), name)
         for name, layout in _backbone_layouts().items()), reverse=True)
    if scores and scores[0][0] >= 0.9:  # (nearly) the layout of one of our backbones
        return f'a flatten_mm {scores[0][1]} checkpoint (key layout match {scores[0][0]:.0%})'
    try:
        official = guess_family(unwrap_checkpoint(state_dict))
    except (ValueError, KeyError):
        official = []
    if official:
        return (f'an official {"/".join(official)} checkpoint that was not converted; convert '
                f'it first: python tools/convert_checkpoint.py SRC DST --family {official[0]} '
                '--arch ARCH')
    if not scores or scores[0][0] < 0.3:
        return 'no known family (neither an official checkpoint nor a flatten_mm backbone)'
    return f'a flatten_mm {scores[0][1]} checkpoint (key layout match {scores[0][0]:.0%})'


def check_pretrained(module: nn.Module, state_dict: Mapping[str, torch.Tensor],
                     source: str = 'checkpoint', strict: bool = True) -> None:
    """Raise ``ValueError`` if ``state_dict`` does not fit ``module`` (see module doc)."""
    expected = module.state_dict()
    dense_only = tuple(getattr(module, 'dense_only_prefixes', ()))
    core = {k: v for k, v in expected.items() if not k.startswith(dense_only)}
    provided = {k: v for k, v in state_dict.items() if not k.startswith(dense_only)}
    missing = [k for k in core if k not in provided]
    unexpected = [k for k in provided if k not in core]
    bad_shapes = [k for k in core
                  if k in provided and tuple(provided[k].shape) != tuple(core[k].shape)]
    matched = len(core) - len(missing) - len(bad_shapes)
    if not (missing or unexpected or bad_shapes) or (not strict and matched > 0):
        return
    name = type(module).__name__
    arch = getattr(module, 'arch_settings', None)
    if bad_shapes and not (missing or unexpected):
        reason = f'{len(bad_shapes)} parameters have other shapes (another variant?)'
    else:
        reason = (f'{len(missing)} of its {len(core)} parameters are missing and '
                  f'{len(unexpected)} checkpoint keys are unexpected')
    hint = ('' if not strict else
            " (to load only the matching part on purpose, e.g. into a hybrid, add strict=False "
            "to init_cfg)")
    report = key_mismatch_report(provided, core) or ''
    raise ValueError(
        f'{source} does not fit {name} (arch {arch}): {reason}. The checkpoint looks like '
        f'{describe_state_dict(state_dict)}{hint}.\n{report}')


def read_pretrained(init_cfg: Mapping) -> Dict[str, torch.Tensor]:
    """The state dict an ``init_cfg=dict(type='Pretrained', checkpoint, prefix=None,
    map_location='cpu')`` points at (``state_dict`` / ``model`` unwrapped, ``module.`` stripped,
    ``prefix`` selected and stripped).

    Raises:
        FileNotFoundError: the file does not exist.
        CheckpointError: the file cannot be read (truncated, corrupt, refused pickle).
    """
    path = init_cfg['checkpoint']
    prefix: Optional[str] = init_cfg.get('prefix', None)
    try:
        ckpt = CheckpointLoader.load_checkpoint(path, init_cfg.get('map_location', 'cpu'))
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 (unreadable / refused file: name it)
        if str(path).startswith(SCHEME):  # its errors name the file, URL and what to do
            raise
        first = str(err).splitlines()[0] if str(err) else ''
        if str(path) in first:  # flatten_mm's loader already names the file and the cause
            raise CheckpointError(f'init_cfg Pretrained: {first}') from None
        raise CheckpointError(
            f'cannot read the pretrained checkpoint {path} (truncated or corrupt file, or '
            f'pickled objects outside the allow-list): {type(err).__name__}: {first}') from None
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f'{path} holds a {type(ckpt).__name__}, not a state dict')
    state_dict = ckpt
    for wrapper in ('state_dict', 'model'):  # mmengine runners / official training scripts
        if isinstance(ckpt.get(wrapper), Mapping):
            state_dict = ckpt[wrapper]
            break
    state_dict = OrderedDict((k[7:] if k.startswith('module.') else k, v)
                             for k, v in state_dict.items() if isinstance(v, torch.Tensor))
    if prefix:
        prefix = prefix if prefix.endswith('.') else prefix + '.'
        selected = OrderedDict((k[len(prefix):], v) for k, v in state_dict.items()
                               if k.startswith(prefix))
        if not selected:
            raise ValueError(f'no key of {path} starts with prefix {prefix!r} (init_cfg); '
                             f'first keys: {list(state_dict)[:5]}')
        state_dict = selected
    return state_dict


def official_as_ours(module: nn.Module, state_dict: Dict[str, torch.Tensor]
                     ) -> Tuple[Dict[str, torch.Tensor], Optional[str]]:
    """``(state_dict, family)``: an official ImageNet state dict of ``module``'s family
    (keys in the official layout, recognised by ``guess_family``) converted in memory by
    that family's converter; anything else (already our layout, another family) returned
    unchanged with ``family=None``, for ``check_pretrained`` to judge."""
    expected = module.state_dict()
    if set(state_dict) <= set(expected) and state_dict:  # already our layout
        return state_dict, None
    try:
        families = guess_family(unwrap_checkpoint(state_dict))
    except (ValueError, KeyError):
        return state_dict, None
    mine = [f for f in families if BACKBONES.get(f) == type(module).__name__]
    if len(mine) != 1:
        return state_dict, None
    converted, _ = CONVERTERS[mine[0]](unwrap_checkpoint(state_dict))
    return OrderedDict(converted), mine[0]


def backbone_of_whole_model(module: nn.Module, state_dict: Dict[str, torch.Tensor]
                            ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """``(state_dict, parts)``: the ``backbone.`` weights of a whole-model checkpoint -- an
    mmpretrain classifier trained with ``configs/mmpretrain`` (``backbone.`` / ``neck.`` /
    ``head.``), or a detector / segmentor -- with the prefix stripped, and the top-level
    parts the file holds; anything else is returned unchanged with ``parts=[]``. (As
    ``init_cfg=dict(..., prefix='backbone.')`` selects it explicitly.)"""
    expected = module.state_dict()
    if set(state_dict) <= set(expected) or not any(k.startswith('backbone.') for k in state_dict):
        return state_dict, []
    parts = sorted({k.split('.', 1)[0] for k in state_dict})
    selected = OrderedDict((k[len('backbone.'):], v) for k, v in state_dict.items()
                           if k.startswith('backbone.'))
    return selected, parts


def resize_tables(module: nn.Module, state_dict: Dict[str, torch.Tensor]
                  ) -> List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]:
    """Let every submodule that owns grid-dependent tables (declared by a
    ``resize_loaded_tables(state_dict, prefix)`` method) resize, in ``state_dict``, the
    tables stored for another grid to its own. Returns ``(key, old shape, new shape)``
    of each resized table; tables that are not a resize (other channels / heads) are left
    for ``check_pretrained`` to refuse."""
    resized = []
    for name, sub in module.named_modules():
        resize = getattr(sub, 'resize_loaded_tables', None)
        if callable(resize):
            resized += resize(state_dict, f'{name}.' if name else '')
    return resized


def load_pretrained(module: nn.Module, init_cfg: Mapping) -> None:
    """Load ``init_cfg=dict(type='Pretrained', checkpoint, prefix=None, map_location='cpu',
    strict=True)`` into ``module``: positional tables of another grid are resized
    (``resize_tables``, logged), then ``check_pretrained``; with ``strict=False`` the
    tolerated missing / unexpected keys are logged as mmengine does.

    Raises:
        FileNotFoundError: a local ``checkpoint`` that does not exist; the message names
            the variant and either the command that downloads its official weights or
            that none were released, with the two ways on
            (``flatten_mm.models.zoo.missing_weights_message``).
    """
    path = init_cfg['checkpoint']
    if isinstance(path, str) and '://' not in path and not osp.isfile(path):
        # a local file that is not there: name the variant and whether official weights
        # exist (``flatten_mm.models.zoo``) instead of a bare missing-file error
        raise FileNotFoundError(missing_weights_message(path, module))
    state_dict = read_pretrained(init_cfg)
    if not init_cfg.get('prefix'):
        state_dict, parts = backbone_of_whole_model(module, state_dict)
        if parts:
            print_log(f'{type(module).__name__}: {path} holds a whole model ({", ".join(parts)}, '
                      'e.g. an ImageNet classifier of configs/mmpretrain); its backbone. weights '
                      "are loaded (as prefix='backbone.')", logger='current')
    state_dict, official = official_as_ours(module, state_dict)
    if official:
        print_log(f'{type(module).__name__}: {path} holds official {official} weights; '
                  'converted in memory to the layout of this backbone', logger='current')
    resized = resize_tables(module, state_dict)
    check_pretrained(module, state_dict, source=f'pretrained checkpoint {path}',
                     strict=init_cfg.get('strict', True))
    if resized:
        lines = '\n'.join(f'  {key}: {tuple(old)} -> {tuple(new)}' for key, old, new in resized)
        print_log(f'{type(module).__name__}: {len(resized)} positional tables of {path} were '
                  f"stored for another grid and are resized to this model's:\n{lines}",
                  logger='current')
    print_log(f'load {type(module).__name__} from: {path}', logger='current')
    load_state_dict(module, state_dict, strict=False, logger='current')
