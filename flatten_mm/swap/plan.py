"""Replace the backbone of an existing mmdet 3.x / mmseg 1.x config by a catalogue backbone.

``swap_backbone(src, name, out)`` writes a small config that inherits ``src`` and
overrides only what the new backbone changes:

* ``custom_imports``: ``flatten_mm.models`` added to the source's imports; a package the
  source imported only for the replaced backbone (``mmpretrain.models`` for
  ``type='mmpretrain.ConvNeXt'``) dropped, so it need not be installed;
* ``model.backbone`` (``_delete_=True``, the ``flatten_mm.`` type, ``arch``,
  ``out_indices`` selecting the strides the source backbone produced, and
  ``init_cfg`` when a checkpoint is given);
* the channels of whatever reads the backbone maps: the neck's ``in_channels``
  (FPN, PAFPN, ChannelMapper, YOLOX / RTMDet / YOLOv3 necks, SSD's two-map neck...
  including RetinaNet's ``start_level=1`` FPN); without a neck, the ``in_channels``
  (and ``strides``) of the MaskFormer / Mask2Former head whose pixel decoder reads every
  map (mmdet ``panoptic_head``, mmseg ``decode_head``), or mmseg decode / auxiliary
  heads' ``in_channels`` for their ``in_index``;
* ``optim_wrapper``: ``norm_decay_mult=0`` (no weight decay on any norm layer) and
  ``decay_mult=0`` for the backbone's positional tables and FLA ``scale`` parameters
  (keys derived from the backbone's parameter names; the source's ``backbone`` lr_mult
  kept on them); a layer-wise decay constructor, which groups parameters by the replaced
  backbone's names, is replaced by the default one;
* the data preprocessor's normalisation, when the source differs from the ImageNet RGB
  statistics the checkpoints were trained with; ``model.pretrained=None`` (mmseg).

Strides, not indices, connect the two backbones: a source ResNet with
``out_indices=(1, 2, 3)`` (strides 8, 16, 32) gets ``out_indices=(1, 2, 3)`` here too,
and the neck receives the channels of those strides. The source's strides are exact for
a few families and otherwise measured by building the source backbone without weights
and running one small forward (``swap_measure``). Structures that cannot be mapped
raise ``SwapError`` (a ``ValueError``) with the reason, before anything is written:
dilated backbones (several maps at stride 8), single-stride backbones (plain ViTs,
Hourglass, BEiT / MAE measured at their own ``img_size``), HRNet / recursive FPNs, C4
detectors, heads that read a real-time net's own branches (DDRNet, PIDNet), or a source
backbone that cannot be built here (its package is missing). A SimA backbone gets ``out_indices`` like the
others (its XCiT block choice, ``block_indices``, keeps its default).
"""
import copy
import math
import os
import os.path as osp
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from mmengine.config import Config
from mmengine.config.utils import MODULE2PACKAGE, _get_package_and_cfg_path
from mmengine.model import revert_sync_batchnorm
from mmengine.registry import init_default_scope
from mmengine.utils import get_installed_path, import_modules_from_strings

from ..apis.forward import _random_proposals, build_model, dense_forward, roi_head_dummy_forward
from ..models import zoo
from ..models.catalogue import BackboneSpec, _meta_parameters, get_backbone_spec
from ..models.layers import FocusedLinearAttention
from ..models.layers.focused_linear_attention import _FocusedLinearRegion
from .measure import (PROBE_HW, SourceGeometry, SwapError, _normalise_indices,
                      measure_source_backbone, scope_package_missing, type_name as _type_name,
                      type_scope)
from .smoke import mmsyncbn_as_bn

#: normalisation of the ImageNet checkpoints (RGB, 0-255 input)
IMAGENET_MEAN = [123.675, 116.28, 103.53]
IMAGENET_STD = [58.395, 57.12, 57.375]

#: parameter names (last component) that get no weight decay
NO_DECAY_TABLES = ('positional_encoding', 'pos_embed', 'absolute_pos_embed',
                   'relative_position_bias_table')

#: heads that read a source backbone's own structure instead of a pyramid (and why)
UNSUPPORTED_HEADS = {
    'DDRHead': "DDRHead reads DDRNet's own outputs (one map at inference, the (context, "
               'spatial) branch pair in training), not a pyramid of maps',
    'PIDHead': "PIDHead reads PIDNet's own P / I / D branch outputs (a tuple of three maps "
               'in training), not a pyramid of maps',
}

#: necks that cannot be adapted (and why)
UNSUPPORTED_NECKS = {
    'RFP': 'the recursive FPN feeds features back into a DetectoRS ResNet',
}


# ------------------------------------------------------------------------------ source
def resolve_config_path(src: str) -> str:
    """Absolute path of a config file or of a ``mmdet::...`` / ``mmseg::...`` name."""
    if '::' in src:
        scope, rel = src.split('::', 1)
        if scope not in MODULE2PACKAGE:
            raise SwapError(f'unknown config scope {scope!r} in {src!r} (use mmdet:: or mmseg::)')
        try:
            root = get_installed_path(MODULE2PACKAGE[scope])
        except Exception as exc:  # not installed
            raise SwapError(f'{src}: package {MODULE2PACKAGE[scope]} is not installed') from exc
        path = osp.join(root, '.mim', 'configs', rel)
    else:
        path = osp.abspath(osp.expanduser(src))
    if not osp.isfile(path):
        raise SwapError(f'config not found: {src} ({path})')
    return path


def load_source_config(src: str) -> Tuple[Config, str]:
    """Load ``src`` (file or scoped name). Returns the config and the reference to put
    in ``_base_`` (the scoped name as given, or the absolute file path)."""
    path = resolve_config_path(src)
    with open(path, encoding='utf-8') as f:
        if re.search(r'^\s*with\s+read_base\(\)', f.read(), flags=re.M):
            raise SwapError(f'{src} is a new-style (read_base) config; only the classic '
                            '`_base_` configs of mmdet 3.x / mmseg 1.x can be inherited')
    try:
        # custom_imports are not imported: a package needed only by the replaced
        # backbone (mmpretrain for mmpretrain.ConvNeXt) need not be installed
        cfg = Config.fromfile(path, import_custom_modules=False)
    except Exception as exc:  # noqa: BLE001
        missing = _missing_base_packages(path)
        if missing:
            raise SwapError(f'{src} cannot be read without {", ".join(missing)} (its _base_ '
                            'configs are in that package), which is not installed') from exc
        raise
    # mmengine parses a scoped _base_ name with a regex that stops at characters like
    # '+' (mmdet::gn+ws/...): inherit such a config by its file path
    return cfg, (src if '::' in src and _scoped_name_parses(src) else path)


def _scoped_name_parses(src: str) -> bool:
    try:
        _get_package_and_cfg_path(src)
    except ValueError:
        return False
    return True


def _missing_base_packages(path: str, seen=None) -> List[str]:
    """Packages named by ``scope::`` references in ``path`` and its file bases that are
    not installed."""
    seen = set() if seen is None else seen
    if path in seen or not osp.isfile(path):
        return []
    seen.add(path)
    with open(path, encoding='utf-8') as f:
        text = f.read()
    missing = []
    for scope in re.findall(r'[\'"]([A-Za-z_][A-Za-z0-9_]*)::', text):
        pkg = scope_package_missing(scope)
        if pkg and pkg not in missing:
            missing.append(pkg)
    for rel in re.findall(r'[\'"]([^\'":]+\.py)[\'"]', text):
        for m in _missing_base_packages(osp.join(osp.dirname(path), rel), seen):
            if m not in missing:
                missing.append(m)
    return missing


def config_scope(cfg: Config) -> str:
    scope = cfg.get('default_scope')
    if scope not in ('mmdet', 'mmseg'):
        raise SwapError(f"the config's default_scope is {scope!r}; mmdet 3.x and mmseg 1.x "
                        'configs are supported')
    return scope


# ------------------------------------------------------------------------------ strides
def _strip_scope(type_name: Any) -> str:
    return _type_name(type_name)


def source_strides(backbone: dict, scope: str = 'mmdet') -> Tuple[int, ...]:
    """Output strides of a source backbone config, in output order (exact for the
    families of ``swap_measure.exact_strides``, measured by a forward otherwise).

    Raises:
        SwapError: the backbone cannot be built / run (the message says why).
    """
    return measure_source_backbone(backbone, scope).strides


def _check_strides(geometry: SourceGeometry, spec: BackboneSpec) -> None:
    """Refuse geometries a four-stride pyramid cannot provide, with the true reason."""
    strides, name = geometry.strides, geometry.type
    ours = set(spec.out_strides)
    if len(strides) > 1 and len(set(strides)) == 1:
        where = ''
        if geometry.probe_hw is not None and geometry.probe_hw != PROBE_HW:
            where = (f' (measured at {geometry.probe_hw[0]}x{geometry.probe_hw[1]}, the size '
                     f'it is built for: it cannot run a {PROBE_HW[0]}x{PROBE_HW[1]} image, '
                     'e.g. position tables fixed to its training size)')
        raise SwapError(
            f'the source backbone ({name}) returns all its {len(strides)} maps at stride '
            f'{strides[0]}{where}: a single-stride backbone such as a plain ViT, whose neck '
            f'resamples them; {spec.name} returns one map at each of {spec.out_strides}, '
            'so there is nothing to map the readers to')
    if len(set(strides)) != len(strides):
        raise SwapError(
            f'the source backbone ({name}) returns maps at strides {strides}: several maps at '
            'the same stride (a dilated backbone, output stride '
            f'{max(strides)}); {spec.name} returns one map at each of {spec.out_strides}. '
            'Dilated (output stride 8/16) or single-stride backbones cannot be swapped for '
            'a pyramid backbone.')
    bad = [s for s in strides if s not in ours]
    if bad:
        raise SwapError(
            f'the source backbone ({name}) returns maps at strides {strides}; {spec.name} '
            f'returns one map at each of {spec.out_strides} and has none at stride '
            f'{", ".join(map(str, bad))}')


# ------------------------------------------------------------------------------ plan
@dataclass
class SwapPlan:
    """What the generated config overrides.

    Attributes:
        base: the ``_base_`` reference (scoped name or absolute path).
        spec: the new backbone.
        model: overrides of ``model`` (merged into the source by mmengine).
        optim_wrapper: overrides of ``optim_wrapper``.
        custom_imports: the full ``custom_imports``.
        notes: comment lines for the header (what was adapted and how).
    """

    base: str
    spec: BackboneSpec
    model: dict
    optim_wrapper: dict
    custom_imports: dict
    notes: List[str] = field(default_factory=list)


def no_decay_keys(spec: BackboneSpec) -> List[str]:
    """``paramwise_cfg.custom_keys`` names of the backbone's positional tables and FLA
    ``scale`` parameters (norms are covered by ``norm_decay_mult``)."""
    with _meta_parameters():
        model = spec.build()
    fla_types = (FocusedLinearAttention, _FocusedLinearRegion)
    keys = []
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        owner, _, leaf = name.rpartition('.')
        if leaf in NO_DECAY_TABLES:
            key = leaf
        elif leaf == 'scale' and isinstance(modules.get(owner), fla_types):
            # 'attn.scale' (PVT, Swin), 'branches.0.scale' (CSwin): back to a named module
            parts = name.split('.')
            j = len(parts) - 2
            while j > 0 and parts[j].isdigit():
                j -= 1
            key = '.'.join(parts[j:])
        else:
            continue
        if key not in keys:
            keys.append(key)
    return keys


def _map_channels(values, indices: Sequence[int], channels: Sequence[int], what: str):
    """New ``in_channels`` for a reader of backbone maps ``indices``."""
    if isinstance(values, int):
        if len(indices) != 1:
            raise SwapError(f'{what} has a single in_channels ({values}) but reads '
                            f'{len(indices)} backbone maps')
        return channels[indices[0]]
    as_tuple = isinstance(values, tuple)  # some necks assert a tuple (mmseg JPU)
    values = list(values)
    if len(values) != len(indices):
        raise SwapError(f'{what} has {len(values)} in_channels {values} but reads '
                        f'{len(indices)} backbone maps')
    new = [channels[i] for i in indices]
    return tuple(new) if as_tuple else new


#: heads of mmdet detectors without a neck that read every backbone map through
#: ``in_channels`` (and ``strides`` where they have them): MaskFormer / Mask2Former
#: (``panoptic_head``) and Mask2Former VIS (``Mask2FormerVideo.track_head``, a
#: Mask2Former head over the frames of a clip)
_QUERY_HEAD_KEYS = ('panoptic_head', 'track_head')


def _uses_in_index(head_type: Any) -> bool:
    """Whether an mmseg head selects maps with ``in_index`` (a ``BaseDecodeHead``); the
    MaskFormer-style heads (mmdet subclasses) read every map through ``in_channels``."""
    try:
        import mmseg.models  # noqa: F401
        from mmseg.models.decode_heads.decode_head import BaseDecodeHead
        from mmseg.registry import MODELS
        cls = head_type if isinstance(head_type, type) else MODELS.get(head_type)
    except Exception:  # noqa: BLE001 -- unknown type: keep mmseg's default behaviour
        return True
    return cls is None or issubclass(cls, BaseDecodeHead)


def _adapt_all_maps_head(head: dict, what: str, strides, channels, notes) -> dict:
    """``in_channels`` (and ``strides``) of a head reading every backbone map (MaskFormer /
    Mask2Former): the pixel decoder gets them from the head, or its own keys."""
    htype = _strip_scope(head.get('type'))
    all_maps = list(range(len(strides)))
    if 'in_channels' not in head:
        raise SwapError(f'{what} ({htype}) has no in_channels to adapt')
    new = dict(in_channels=_map_channels(head['in_channels'], all_maps, channels,
                                         f'{what} ({htype}), which reads every backbone map,'))
    notes.append(f'{what} {htype}: in_channels {list(_as_list(head["in_channels"]))} -> '
                 f'{list(_as_list(new["in_channels"]))}')
    for holder, key in ((head, 'strides'), (head.get('pixel_decoder') or {}, 'strides')):
        if key in holder and list(holder[key]) != list(strides):
            raise SwapError(f'{what} ({htype}) declares strides {list(holder[key])} but the '
                            f'source backbone returns maps at strides {list(strides)}')
    if 'strides' in head:
        new['strides'] = list(strides)
    decoder = head.get('pixel_decoder')
    if isinstance(decoder, dict) and 'in_channels' in decoder:
        new['pixel_decoder'] = dict(in_channels=list(_as_list(new['in_channels'])))
    return new


def _neckless_mmdet(model: dict, strides, channels, overrides: dict, notes: List[str]) -> None:
    for key in _QUERY_HEAD_KEYS:
        head = model.get(key)
        if isinstance(head, dict):
            overrides[key] = _adapt_all_maps_head(head, f'{key}', strides, channels, notes)
            return
    roi = model.get('roi_head')
    if isinstance(roi, dict) and roi.get('shared_head') is not None:
        shared = _strip_scope(roi['shared_head'].get('type'))
        raise SwapError(
            f'the detector has no neck and its RoI head runs a {shared} shared head (the '
            "backbone's last stage, applied to every RoI: a C4 model), which a transformer "
            'backbone cannot provide')
    heads = [k for k, v in model.items() if k.endswith('head') and isinstance(v, dict)]
    if len(strides) == 1:
        raise SwapError(
            f'the detector ({_strip_scope(model.get("type"))}) has no neck and its heads '
            f'({", ".join(heads) or "none"}) read the single map of the source backbone, at '
            f'stride {strides[0]} (a C4 / DC5 model, its last stage dilated or cut); '
            'detectors are adapted through their neck or MaskFormer-style heads, not '
            'through RPN / RoI heads reading one backbone map')
    raise SwapError(
        f'the detector ({_strip_scope(model.get("type"))}) has no neck and its heads '
        f'({", ".join(heads) or "none"}) do not declare the channels of each backbone map '
        f'they read; only MaskFormer-style heads ({", ".join(_QUERY_HEAD_KEYS)}) are adapted '
        'without a neck')


def _adapt_mmseg_head(head: dict, what: str, strides, channels, notes: List[str]) -> dict:
    """The overrides of one mmseg decode / auxiliary head: ``in_channels`` for the maps its
    ``in_index`` selects (MaskFormer-style heads: every map; K-Net's
    ``IterativeDecodeHead``: those of its ``kernel_generate_head``)."""
    htype = _strip_scope(head.get('type'))
    if not _uses_in_index(head.get('type')):
        return _adapt_all_maps_head(head, what, strides, channels, notes)
    if 'in_channels' not in head and isinstance(head.get('kernel_generate_head'), dict):
        # K-Net: the kernel update heads refine what the kernel generator reads
        return dict(kernel_generate_head=_adapt_mmseg_head(
            head['kernel_generate_head'], f'{what}.kernel_generate_head', strides,
            channels, notes))
    in_index = head.get('in_index', -1)
    idx = _normalise_indices(in_index, len(strides))
    if any(not 0 <= i < len(strides) for i in idx):
        raise SwapError(f'{what} ({htype}) reads in_index {in_index} but the '
                        f'backbone returns {len(strides)} maps')
    if 'in_channels' not in head:
        raise SwapError(f'{what} ({htype}) has no in_channels to adapt')
    new = _map_channels(head['in_channels'], idx, channels, f'{what} ({htype})')
    update = dict(in_channels=new)
    notes.append(f'{what} {htype}: in_channels {head["in_channels"]} -> {new} '
                 f'(in_index {in_index})')
    if htype == 'FCNHead' and head.get('num_convs', 2) == 0 and isinstance(new, int):
        # no convs (Segmenter's linear head): FCNHead asserts channels == in_channels
        update['channels'] = new
        notes.append(f'{what} {htype}: channels {head.get("channels")} -> {new} '
                     '(num_convs=0: the classifier reads the map itself)')
    return update


def _mmseg_heads(model: dict, strides, channels, overrides: dict, notes: List[str]) -> None:
    for key in ('decode_head', 'auxiliary_head'):
        heads = model.get(key)
        if heads is None:
            continue
        is_list = isinstance(heads, (list, tuple))
        new_heads = []
        for k, head in enumerate(heads if is_list else [heads]):
            what = f'{key}[{k}]' if is_list else key
            new_heads.append(_adapt_mmseg_head(head, what, strides, channels, notes))
        if is_list:  # lists are replaced, not merged
            full = [copy.deepcopy(dict(h)) for h in heads]
            for h, n in zip(full, new_heads):
                h.update(n)
            overrides[key] = full
        else:
            overrides[key] = new_heads[0]


#: necks whose ``in_channels`` list the maps from the deepest one (YOLOv3)
_REVERSED_NECKS = ('YOLOV3Neck', )
#: necks that return their inputs first (``out_channels`` starts with ``in_channels``)
_PASSTHROUGH_NECKS = ('SSDNeck', )
#: necks with one ``in_channels`` that read the last of the maps they are given
#: (CenterNet's ``CTResNetNeck``: ``inputs[-1]``, upsampled by deconvolutions)
_LAST_MAP_NECKS = ('CTResNetNeck', )


def _adapt_neck(model: dict, neck, strides, channels, overrides: dict, notes: List[str],
                skip: int = 0) -> None:
    first = neck[0] if isinstance(neck, (list, tuple)) else neck
    ntype = _strip_scope(first.get('type'))
    if 'in_channels' not in first:
        raise SwapError(f'neck {ntype} has no in_channels to adapt')
    all_maps = list(range(len(strides)))
    if ntype in _REVERSED_NECKS:
        all_maps = all_maps[::-1]
    old = first['in_channels']
    old = old[skip:] if skip else old
    if ntype in _LAST_MAP_NECKS and isinstance(old, int):
        all_maps = all_maps[-1:]
    new_first = dict(in_channels=_map_channels(old, all_maps, channels, f'neck {ntype}'))
    if ntype in _PASSTHROUGH_NECKS:
        # SSDNeck returns its inputs first: out_channels (and the head's in_channels)
        # start with the in_channels
        old_in = list(_as_list(first['in_channels']))
        new_in = list(_as_list(new_first['in_channels']))
        outs = list(first['out_channels'])
        new_out = new_in + outs[len(old_in):]
        # SSDNeck asserts in_channels == out_channels[:len(in_channels)]: same container
        new_first['out_channels'] = (tuple(new_out) if isinstance(new_first['in_channels'],
                                                                  tuple) else new_out)
        head = model.get('bbox_head')
        if isinstance(head, dict) and list(_as_list(head.get('in_channels', []))) == outs:
            overrides['bbox_head'] = dict(in_channels=list(new_first['out_channels']))
            notes.append(f'bbox_head: in_channels {outs} -> {new_first["out_channels"]}')
    if ntype == 'JPU':
        _jpu_passthrough_heads(model, first, list(_as_list(new_first['in_channels'])),
                               overrides, notes)
    if isinstance(neck, (list, tuple)):  # lists are replaced, not merged
        necks = [copy.deepcopy(dict(n)) for n in neck]
        necks[0].update(new_first)
        overrides['neck'] = necks
    else:
        overrides['neck'] = new_first
    notes.append(f'neck {ntype}: in_channels {list(_as_list(first["in_channels"]))} -> '
                 f'{list(_as_list(new_first["in_channels"]))}'
                 + (' (deepest map first)' if ntype in _REVERSED_NECKS else ''))


def _jpu_passthrough_heads(model: dict, jpu: dict, new_in: List[int], overrides: dict,
                           notes: List[str]) -> None:
    """mmseg's JPU returns its inputs ``start_level .. end_level - 1`` unchanged before
    its fused map: heads whose ``in_index`` picks one of them (FastFCN's auxiliary FCN
    head) read a backbone map, whose channels change."""
    start = jpu.get('start_level', 0)
    end = jpu.get('end_level', -1)
    end = len(new_in) if end == -1 else end
    passed = new_in[start:end - 1]
    for key in ('decode_head', 'auxiliary_head'):
        heads = model.get(key)
        if not isinstance(heads, dict):  # FastFCN configs use one head per key
            continue
        idx = heads.get('in_index', -1)
        if isinstance(idx, int) and 0 <= idx < len(passed):
            overrides[key] = dict(in_channels=passed[idx])
            notes.append(f'{key} {_strip_scope(heads.get("type"))}: in_channels '
                         f'{heads.get("in_channels")} -> {passed[idx]} (a backbone map '
                         'the JPU passes through)')


#: necks with ``start_level`` whose structure is fixed to the level count (NAS-FCOS's
#: searched cells index levels): given every map, their start_level kept
_FIXED_LEVEL_NECKS = ('NASFCOS_FPN', )


def _unread_leading_maps(neck, num_maps: int) -> int:
    """How many leading backbone maps an FPN-like neck with ``start_level > 0`` (and
    ``end_level=-1``) receives but never reads (RetinaNet's FPN: 1)."""
    if neck is None or isinstance(neck, (list, tuple)):
        return 0
    if _strip_scope(neck.get('type')) in _FIXED_LEVEL_NECKS:
        return 0
    start = neck.get('start_level', 0)
    chans = neck.get('in_channels')
    if (start > 0 and neck.get('end_level', -1) == -1 and isinstance(chans, (list, tuple))
            and len(chans) == num_maps and start < num_maps):
        return start
    return 0


def _types_in(obj: Any, skip: Any = None) -> List[str]:
    """Every string ``type`` in a config tree (``skip``: a subtree left out)."""
    found = []
    if obj is skip:
        return found
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == 'type' and isinstance(v, str):
                found.append(v)
            else:
                found += _types_in(v, skip)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found += _types_in(v, skip)
    return found


def _custom_imports(cfg: Config, src_backbone: dict, notes: List[str]) -> dict:
    """The source's imports plus ``flatten_mm.models``; a package imported only for the
    swapped-out backbone (``mmpretrain.models`` for ``mmpretrain.ConvNeXt``) is dropped."""
    imports = cfg.get('custom_imports', {}).get('imports', [])
    imports = [imports] if isinstance(imports, str) else list(imports)
    scope = type_scope(src_backbone.get('type'))
    if scope not in (None, 'mmdet', 'mmseg', 'flatten_mm'):
        rest = _types_in(cfg._cfg_dict.to_dict(), skip=None)
        backbone_types = _types_in(src_backbone.to_dict() if hasattr(src_backbone, 'to_dict')
                                   else dict(src_backbone))
        others = list(rest)
        for t in backbone_types:  # remove the backbone's own occurrences once each
            if t in others:
                others.remove(t)
        if not any(t.startswith(f'{scope}.') for t in others):
            dropped = [m for m in imports if m == scope or m.startswith(f'{scope}.')]
            if dropped:
                imports = [m for m in imports if m not in dropped]
                notes.append(f'custom_imports: {", ".join(dropped)} dropped (only the '
                             f'replaced {src_backbone.get("type")} needed it)')
    if 'flatten_mm.models' not in imports:
        imports.append('flatten_mm.models')
    return dict(imports=imports, allow_failed_imports=False)


def _optim_wrapper(cfg: Config, spec: BackboneSpec, notes: List[str]) -> dict:
    custom_keys = {k: dict(decay_mult=0.) for k in no_decay_keys(spec)}
    src_wrapper = cfg.get('optim_wrapper') or {}
    src_paramwise = src_wrapper.get('paramwise_cfg') or {}
    lr_mult = (src_paramwise.get('custom_keys') or {}).get('backbone', {}).get('lr_mult')
    if lr_mult is not None:  # keep the source's backbone lr_mult on the keys we add
        for v in custom_keys.values():
            v['lr_mult'] = lr_mult
    paramwise = dict(norm_decay_mult=0.)
    if custom_keys:
        paramwise['custom_keys'] = custom_keys
    wrapper = dict(paramwise_cfg=paramwise)
    constructor = src_wrapper.get('constructor')
    if constructor is not None and _strip_scope(constructor) != 'DefaultOptimWrapperConstructor':
        # layer-wise decay constructors group parameters by the replaced backbone's names
        # (backbone.stages.N / backbone.layers.N) and ignore custom_keys
        wrapper['constructor'] = 'DefaultOptimWrapperConstructor'
        wrapper['paramwise_cfg'] = dict(_delete_=True, **paramwise)
        notes.append(f'optim_wrapper: constructor {constructor} (tied to the replaced '
                     "backbone's parameter names) -> DefaultOptimWrapperConstructor")
    return wrapper


def plan_swap(cfg: Config, base: str, spec: BackboneSpec,
              checkpoint: Optional[str] = None) -> SwapPlan:
    """Work out the overrides that put ``spec`` into the model of ``cfg``.

    Raises:
        SwapError: the structure cannot be adapted (see the module docstring).
    """
    scope = config_scope(cfg)
    model = cfg.get('model')
    if not isinstance(model, dict) or not isinstance(model.get('backbone'), dict):
        raise SwapError('the config has no model.backbone dict')
    src_backbone = model['backbone']
    in_ch = src_backbone.get('in_channels', src_backbone.get('in_chans', 3))
    if isinstance(in_ch, int) and in_ch != 3:
        raise SwapError(
            f'the source backbone ({_strip_scope(src_backbone.get("type"))}) takes '
            f'{in_ch}-channel images (in_channels={in_ch}, e.g. the two images of a change-'
            f'detection pair stacked); {spec.name} takes 3-channel RGB images')
    neck = model.get('neck')
    if neck is not None:
        first = neck[0] if isinstance(neck, (list, tuple)) else neck
        ntype = _strip_scope(first.get('type'))
        if ntype in UNSUPPORTED_NECKS:
            raise SwapError(f'neck {ntype} cannot be adapted: {UNSUPPORTED_NECKS[ntype]}')
    for key in ('decode_head', 'auxiliary_head', 'bbox_head'):
        heads = model.get(key)
        for head in heads if isinstance(heads, (list, tuple)) else [heads] if heads else []:
            htype = _strip_scope(head.get('type')) if isinstance(head, dict) else None
            if htype in UNSUPPORTED_HEADS:
                raise SwapError(f'{key} {htype} cannot be adapted: {UNSUPPORTED_HEADS[htype]}')
    geometry = measure_source_backbone(src_backbone, scope, cfg.get('crop_size'))
    _check_strides(geometry, spec)
    strides = geometry.strides
    skip = _unread_leading_maps(neck, len(strides))
    if skip:  # an FPN with start_level > 0 never reads the first maps: not requested
        strides = strides[skip:]
    ours = dict(zip(spec.out_strides, spec.out_channels))
    channels = [ours[s] for s in strides]  # channels of the new backbone's outputs
    how = {'config': 'from its config', 'meta': 'measured on the meta device',
           'cpu': 'measured on CPU'}[geometry.how]
    if geometry.probe_hw is not None and geometry.probe_hw != PROBE_HW:
        how += f' at {geometry.probe_hw[0]}x{geometry.probe_hw[1]}'
    notes = [f'source backbone {geometry.type}: maps at strides '
             f'{", ".join(map(str, strides))} ({how})']

    backbone = dict(_delete_=True, **spec.config())
    backbone['out_indices'] = tuple(int(math.log2(s // 4)) for s in strides)
    if checkpoint:
        backbone['init_cfg'] = dict(type='Pretrained', checkpoint=checkpoint)
    overrides: Dict[str, Any] = dict(backbone=backbone)

    if neck is not None:
        _adapt_neck(model, neck, strides, channels, overrides, notes, skip)
        if skip:
            first = overrides['neck'][0] if isinstance(overrides['neck'], list) \
                else overrides['neck']
            first['start_level'] = 0
            notes.append(f'neck start_level {skip} -> 0: the {skip} map(s) it never read '
                         f'(stride {", ".join(map(str, geometry.strides[:skip]))}) are not '
                         'requested from the backbone (no parameters without a gradient)')
    elif scope == 'mmseg':
        _mmseg_heads(model, strides, channels, overrides, notes)
    else:
        _neckless_mmdet(model, strides, channels, overrides, notes)

    if scope == 'mmseg' and model.get('pretrained') is not None:
        overrides['pretrained'] = None
        notes.append(f"model.pretrained ({model['pretrained']}) removed")
    prep = model.get('data_preprocessor')
    if isinstance(prep, dict) and 'mean' in prep:
        if (list(prep.get('mean')) != IMAGENET_MEAN or list(prep.get('std', [])) != IMAGENET_STD
                or not prep.get('bgr_to_rgb', False)):
            overrides['data_preprocessor'] = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD,
                                                  bgr_to_rgb=True)
            notes.append('data preprocessor switched to ImageNet RGB mean/std (the '
                         'checkpoints were trained with them)')

    optim_wrapper = _optim_wrapper(cfg, spec, notes)
    custom_imports = _custom_imports(cfg, src_backbone, notes)
    return SwapPlan(base, spec, overrides, optim_wrapper, custom_imports, notes)


def _as_list(x):
    return [x] if isinstance(x, int) else list(x)


# ------------------------------------------------------------------------------ render
_IDENT = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')


def _fmt(obj: Any, indent: int = 0) -> str:
    pad = ' ' * (indent + 4)
    if isinstance(obj, dict):
        if not obj:
            return 'dict()'
        if all(isinstance(k, str) and _IDENT.match(k) for k in obj):
            items = [f'{k}={_fmt(v, indent + 4)}' for k, v in obj.items()]
            one = f'dict({", ".join(items)})'
            if len(one) + indent <= 88 and '\n' not in one:
                return one
            return 'dict(\n' + ',\n'.join(pad + i for i in items) + ')'
        items = [f'{k!r}: {_fmt(v, indent + 4)}' for k, v in obj.items()]
        return '{\n' + ',\n'.join(pad + i for i in items) + '\n' + ' ' * indent + '}'
    if isinstance(obj, (list, tuple)):
        items = [_fmt(v, indent + 4) for v in obj]
        open_, close = ('[', ']') if isinstance(obj, list) else ('(', ')')
        if isinstance(obj, tuple) and len(obj) == 1:
            close = ',)'
        one = open_ + ', '.join(items) + close
        if len(one) + indent <= 88 and '\n' not in one:
            return one
        return open_ + '\n' + ',\n'.join(pad + i for i in items) + close
    return repr(obj)


def random_weights_warning(name: str) -> str:
    """What a config swapped to ``name`` without ``--checkpoint`` means: the backbone
    trains from random weights; and how to start from ImageNet weights instead."""
    if name in zoo.imagenet_names():
        how = (f'official ImageNet weights exist: pass --checkpoint {zoo.official_weights()[name].uri}\n'
               '(downloaded and converted on first use)')
    else:
        how = (f'no official ImageNet weights exist for {name}; pass --checkpoint with\n'
               'your own ImageNet training, converted (tools/convert_checkpoint.py)')
    return f'No checkpoint given: the backbone trains from random weights;\n{how}.'


def render_config(plan: SwapPlan) -> str:
    """The text of the generated config."""
    spec = plan.spec
    header = [
        f'# Generated by tools/swap_backbone.py: {plan.base}',
        f'# with its backbone replaced by {spec.name} ({spec.type}, '
        f'{spec.num_params / 1e6:.2f}M parameters).',
    ]
    header += [f'#   {n}' for n in plan.notes]
    if not any(k == 'init_cfg' for k in plan.model['backbone']):
        header += [f'# {line}' for line in random_weights_warning(spec.name).split('\n')]
    header.append('# The optimizer and schedule are inherited; transformer backbones are '
                  'usually trained')
    header.append('# with AdamW (see the recipes under configs/).')
    body = [
        f'_base_ = [{plan.base!r}]',
        '',
        f'custom_imports = {_fmt(plan.custom_imports)}',
        '',
        f'model = {_fmt(plan.model)}',
        '',
        f'optim_wrapper = {_fmt(plan.optim_wrapper)}',
    ]
    return '\n'.join(header + [''] + body) + '\n'


# ------------------------------------------------------------------------------ API
def check_rendered(text: str, plan: SwapPlan) -> Config:
    """Parse ``text`` as a config (inheriting the source) and check the merged result."""
    with tempfile.TemporaryDirectory() as tmp:
        path = osp.join(tmp, 'swapped.py')
        with open(path, 'w', encoding='utf-8') as f:
            f.write(text)
        cfg = Config.fromfile(path, import_custom_modules=False)
    bb = cfg.model.backbone
    if bb.type != plan.spec.type or bb.get('arch') != plan.spec.arch:
        raise SwapError(f'internal error: merged backbone is {bb.type} / {bb.get("arch")}')
    if 'neck' in plan.model:
        want = plan.model['neck']
        got = cfg.model.neck
        if isinstance(want, dict) and _as_list(got.in_channels) != _as_list(want['in_channels']):
            raise SwapError('internal error: merged neck in_channels differ')
    return cfg


def check_neck_builds(cfg: Config, source: Optional[Config] = None) -> None:
    """Build the merged config's neck: widths some necks derive from ``in_channels``
    (e.g. CSPNeXtPAFPN's halved channels) must still suit its ``norm_cfg``.

    Raises:
        SwapError: the neck does not build with the new channels (the message quotes
            the neck's own error, and says so when the ``source`` config's neck does not
            build here either).
    """
    neck = cfg.model.get('neck')
    if neck is None:
        return
    scope = cfg.get('default_scope')
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg.custom_imports)
    init_default_scope(scope)
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    src_neck = (source.model.get('neck') if source is not None else None) or []
    src_necks = src_neck if isinstance(src_neck, (list, tuple)) else [src_neck]
    for i, n in enumerate(neck if isinstance(neck, (list, tuple)) else [neck]):
        try:
            MODELS.build(copy.deepcopy(n))
        except Exception as exc:  # noqa: BLE001 -- reported as the reason
            if i < len(src_necks):
                try:
                    MODELS.build(copy.deepcopy(src_necks[i]))
                except Exception as src_exc:  # noqa: BLE001
                    raise SwapError(
                        f'neck {_strip_scope(n.get("type"))} does not build here, not even '
                        f"as the source config writes it: {type(src_exc).__name__}: "
                        f'{src_exc} (the source needs code that is not installed here)'
                    ) from src_exc
            raise SwapError(
                f'neck {_strip_scope(n.get("type"))} does not build with in_channels '
                f'{list(_as_list(n.get("in_channels", [])))} of the new backbone: '
                f'{type(exc).__name__}: {exc} (widths it derives from in_channels do not '
                f'suit its norm_cfg {dict(n.get("norm_cfg") or {})}; choose a backbone '
                'whose channels fit, or change the neck\'s norm_cfg)') from exc


def swap_backbone(src: str, backbone: str, out: Optional[str] = None,
                  checkpoint: Optional[str] = None, force: bool = False) -> str:
    """Generate (and with ``out`` write) the config; returns its text.

    Raises:
        SwapError / ValueError: unknown backbone, unadaptable config, or ``out`` exists
            and ``force`` is False. Nothing is written in these cases.
    """
    spec = get_backbone_spec(backbone)
    if out is not None and osp.exists(out) and not force:
        raise SwapError(f'{out} exists; pass --force to overwrite it')
    cfg, base = load_source_config(src)
    plan = plan_swap(cfg, base, spec, checkpoint)
    text = render_config(plan)
    merged = check_rendered(text, plan)
    check_neck_builds(merged, cfg)
    if out is not None:
        os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
        tmp = f'{out}.tmp{os.getpid()}'
        with open(tmp, 'w', encoding='utf-8') as f:
            f.write(text)
        os.replace(tmp, out)
    return text


def _needs_predict(model) -> bool:
    """mmdet models whose inference graph ``dense_forward`` cannot run with tensors
    only: single-stage instance segmentors with a bbox head (CondInst, BoxInst: their
    ``_forward`` computes the bbox head's loss), query-based and cascade RPNs
    (EmbeddingRPNHead: Sparse R-CNN, QueryInst; CascadeRPNHead, which has no tensor
    forward), SCNet's RoI head and HTC's with a semantic head (its tensor forward passes
    no semantic features to the mask branch)."""
    if not type(model).__module__.startswith('mmdet.'):
        return False
    from mmdet.models.dense_heads import CascadeRPNHead, EmbeddingRPNHead
    from mmdet.models.detectors.single_stage_instance_seg import SingleStageInstanceSegmentor
    from mmdet.models.roi_heads import HybridTaskCascadeRoIHead, SCNetRoIHead
    roi = getattr(model, 'roi_head', None)
    return ((isinstance(model, SingleStageInstanceSegmentor)
             and getattr(model, 'with_bbox', False))
            or isinstance(getattr(model, 'rpn_head', None), (EmbeddingRPNHead, CascadeRPNHead))
            or isinstance(roi, SCNetRoIHead)
            or (isinstance(roi, HybridTaskCascadeRoIHead) and roi.with_semantic))


def _predict(model, x) -> None:
    from mmdet.structures import DetDataSample
    hw = tuple(x.shape[-2:])
    model.predict(x, [DetDataSample(metainfo=dict(
        img_shape=hw, pad_shape=hw, ori_shape=hw, batch_input_shape=hw,
        scale_factor=(1., 1.))) for _ in range(x.shape[0])], rescale=False)


def verify_config(path_or_cfg, input_hw: Optional[Tuple[int, int]] = None,
                  num_proposals: int = 20) -> tuple:
    """Build the model of a (generated) config on CPU and run its inference graph once
    (``forward.dense_forward``; mmseg MaskFormer-style heads: ``encode_decode``) on a
    random ``(1, 3, *input_hw)`` image (default 224x256, or ``input_size`` squared for
    configs that define one, e.g. SSD300, whose extra layers need it); a Fast R-CNN
    without RPN runs its RoI head on random proposals. Returns the backbone's output
    shapes."""
    cfg = path_or_cfg if isinstance(path_or_cfg, Config) else Config.fromfile(path_or_cfg)
    if input_hw is None:
        size = cfg.get('input_size')
        input_hw = (size, size) if isinstance(size, int) else (224, 256)
    cfg = copy.deepcopy(cfg)
    mmsyncbn_as_bn(cfg.model)  # SyncBN / MMSyncBN need a process group
    model = revert_sync_batchnorm(build_model(cfg, init_weights=True))
    x = torch.randn(1, 3, *input_hw)
    with torch.no_grad():
        feats = model.backbone(x)
        head = getattr(model, 'decode_head', None)
        if getattr(model, 'roi_head', None) is not None and not getattr(model, 'with_rpn',
                                                                          True):
            # Fast R-CNN (precomputed proposals, no RPN): the RoI head on random boxes
            from mmdet.structures.bbox import bbox2roi
            gen = torch.Generator().manual_seed(0)
            rois = bbox2roi([_random_proposals(num_proposals, tuple(input_hw), x.device, gen)])
            roi_head_dummy_forward(model.roi_head, model.extract_feat(x), rois)
        elif _needs_predict(model):
            # CondInst / BoxInst: mmdet's _forward runs the bbox head's loss (needs ground
            # truth); Sparse R-CNN / QueryInst (EmbeddingRPNHead) and SCNet have no
            # tensor-only RPN / RoI forward: the predict graph runs the same modules
            _predict(model, x)
        elif getattr(model, 'track_head', None) is not None:
            # Mask2Former VIS: the backbone runs on the frames of a clip, the track head
            # over all of them (one video in eval mode)
            frames = getattr(model.track_head, 'num_frames', 2)
            model.track_head(model.backbone(x.expand(frames, -1, -1, -1)), [])
        elif head is not None and not _uses_in_index(type(head)):
            # mmseg MaskFormer-style heads need the image metas: run the predict graph
            hw = tuple(input_hw)
            model.encode_decode(x, [dict(img_shape=hw, pad_shape=hw, ori_shape=hw)])
        else:
            dense_forward(model, x, num_proposals=num_proposals)
    return tuple(tuple(f.shape) for f in feats)


__all__ = ['SwapError', 'SwapPlan', 'check_neck_builds', 'check_rendered', 'load_source_config', 'no_decay_keys',
           'plan_swap', 'render_config', 'resolve_config_path', 'source_strides',
           'swap_backbone', 'verify_config']
