"""Replace the backbone of an existing mmdet 3.x / mmseg 1.x config by a catalogue backbone.

``swap_backbone(src, name, out)`` writes a small config that inherits ``src`` and
overrides only what the new backbone changes:

* ``custom_imports`` (``flatten_mm.models`` added to the source's imports);
* ``model.backbone`` (``_delete_=True``, the ``flatten_mm.`` type, ``arch``,
  ``out_indices`` selecting the strides the source backbone produced, and
  ``init_cfg`` when a checkpoint is given);
* the channels of whatever reads the backbone maps: the neck's ``in_channels``
  (FPN, PAFPN, ChannelMapper... including RetinaNet's ``start_level=1`` FPN), or --
  for mmseg models without a neck (UperNet) -- every decode / auxiliary head's
  ``in_channels`` for its ``in_index``;
* ``optim_wrapper.paramwise_cfg``: ``norm_decay_mult=0`` (no weight decay on any norm
  layer) and ``decay_mult=0`` for the backbone's positional tables and FLA ``scale``
  parameters (keys derived from the backbone's parameter names);
* the data preprocessor's normalisation, when the source differs from the ImageNet RGB
  statistics the checkpoints were trained with; ``model.pretrained=None`` (mmseg).

Strides, not indices, connect the two backbones: a source ResNet with
``out_indices=(1, 2, 3)`` (strides 8, 16, 32) gets ``out_indices=(1, 2, 3)`` here too,
and the neck receives the channels of those strides. Structures that cannot be mapped
this way raise ``SwapError`` (a ``ValueError``) with the reason, before anything is
written: dilated backbones (several maps at stride 8), single-stride ViTs, HRNet /
recursive FPNs, or detectors whose heads read the backbone without a neck. A SimA
backbone gets ``out_indices`` like the others (its XCiT block choice, ``block_indices``,
keeps its default).
"""
import copy
import math
import os
import os.path as osp
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mmengine.config import Config

from .catalogue import BackboneSpec, get_backbone_spec

#: normalisation of the ImageNet checkpoints (RGB, 0-255 input)
IMAGENET_MEAN = [123.675, 116.28, 103.53]
IMAGENET_STD = [58.395, 57.12, 57.375]

#: parameter names (last component) that get no weight decay
NO_DECAY_TABLES = ('positional_encoding', 'pos_embed', 'absolute_pos_embed',
                   'relative_position_bias_table')

#: necks that cannot be adapted (and why)
UNSUPPORTED_NECKS = {
    'RFP': 'the recursive FPN feeds features back into a DetectoRS ResNet',
    'HRFPN': 'HRFPN expects HRNet branches',
}


class SwapError(ValueError):
    """The source config cannot be adapted (the message says why)."""


# ------------------------------------------------------------------------------ source
def resolve_config_path(src: str) -> str:
    """Absolute path of a config file or of a ``mmdet::...`` / ``mmseg::...`` name."""
    if '::' in src:
        from mmengine.config.utils import MODULE2PACKAGE
        from mmengine.utils import get_installed_path
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
    cfg = Config.fromfile(path, import_custom_modules=False)
    return cfg, (src if '::' in src else path)


def config_scope(cfg: Config) -> str:
    scope = cfg.get('default_scope')
    if scope not in ('mmdet', 'mmseg'):
        raise SwapError(f"the config's default_scope is {scope!r}; mmdet 3.x and mmseg 1.x "
                        'configs are supported')
    return scope


# ------------------------------------------------------------------------------ strides
def _strip_scope(type_name: Any) -> str:
    if not isinstance(type_name, str):
        return getattr(type_name, '__name__', str(type_name))
    return type_name.rsplit('.', 1)[-1]


_RESNET_LIKE = ('ResNet', 'ResNetV1c', 'ResNetV1d', 'ResNeXt', 'Res2Net', 'ResNeSt',
                'SEResNet', 'SEResNeXt', 'ResNet_IBN')
_PATCH_STRIDED = ('SwinTransformer', 'PyramidVisionTransformer', 'PyramidVisionTransformerV2',
                  'MixVisionTransformer', 'PCPVT', 'SVT')
_POW2_FROM_4 = ('ConvNeXt', 'MSCAN', 'VAN', 'EfficientFormer', 'PoolFormer')
_SUPPORTED_SOURCES = (_RESNET_LIKE + ('RegNet', ) + _PATCH_STRIDED + _POW2_FROM_4 +
                      ('CSPDarknet', 'CSPNeXt', 'Darknet') + ('flatten_mm backbones', ))


def _normalise_indices(indices, num_stages: int) -> List[int]:
    if isinstance(indices, int):
        indices = [indices]
    return [i + num_stages if i < 0 else i for i in indices]


def source_strides(backbone: dict) -> Tuple[int, ...]:
    """Output strides of a source backbone config, in output order.

    Raises:
        SwapError: unknown backbone type (the message lists the supported ones).
    """
    name = _strip_scope(backbone.get('type'))
    if isinstance(backbone.get('type'), str) and backbone['type'].startswith('flatten_mm.'):
        from .catalogue import backbone_catalogue
        for spec in backbone_catalogue().values():
            if spec.cls_name == name:
                idx = _normalise_indices(backbone.get('out_indices', (0, 1, 2, 3)), 4)
                return tuple(4 * 2**i for i in idx)
    if name in _RESNET_LIKE or name == 'RegNet':
        num_stages = backbone.get('num_stages', 4)
        default = (2, 2, 2, 2) if name == 'RegNet' else (1, 2, 2, 2)
        strides = backbone.get('strides', default[:num_stages])
        stem = 2 if name == 'RegNet' else 4
        idx = _normalise_indices(backbone.get('out_indices', tuple(range(num_stages))),
                                 num_stages)
        return tuple(stem * math.prod(strides[:i + 1]) for i in idx)
    if name in _PATCH_STRIDED:
        strides = backbone.get('strides', (4, 2, 2, 2))
        num_stages = backbone.get('num_stages', len(strides))
        idx = _normalise_indices(backbone.get('out_indices', tuple(range(num_stages))),
                                 num_stages)
        return tuple(math.prod(strides[:i + 1]) for i in idx)
    if name in _POW2_FROM_4:
        idx = _normalise_indices(backbone.get('out_indices', (0, 1, 2, 3)), 4)
        return tuple(4 * 2**i for i in idx)
    if name in ('CSPDarknet', 'CSPNeXt'):
        idx = _normalise_indices(backbone.get('out_indices', (2, 3, 4)), 5)
        return tuple(2**(i + 1) for i in idx)
    if name == 'Darknet':
        idx = _normalise_indices(backbone.get('out_indices', (3, 4, 5)), 6)
        return tuple(2**i for i in idx)
    raise SwapError(f'cannot tell the output strides of backbone type {name!r}; supported '
                    f'source backbones: {", ".join(_SUPPORTED_SOURCES)}')


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
    from ..models.layers import FocusedLinearAttention
    from ..models.layers.focused_linear_attention import _FocusedLinearRegion
    from .catalogue import _meta_parameters
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
    values = list(values)
    if len(values) != len(indices):
        raise SwapError(f'{what} has {len(values)} in_channels {values} but reads '
                        f'{len(indices)} backbone maps')
    return [channels[i] for i in indices]


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
    strides = source_strides(src_backbone)
    ours = dict(zip(spec.out_strides, spec.out_channels))
    bad = [s for s in strides if s not in ours]
    if bad or len(set(strides)) != len(strides):
        raise SwapError(
            f'the source backbone ({_strip_scope(src_backbone.get("type"))}) returns maps at '
            f'strides {strides}; {spec.name} returns one map at each of '
            f'{spec.out_strides}. Dilated (output stride 8/16) or single-stride backbones '
            'cannot be swapped for a pyramid backbone.')
    channels = [ours[s] for s in strides]  # channels of the new backbone's outputs
    notes = [f'source backbone {_strip_scope(src_backbone.get("type"))}: maps at strides '
             f'{", ".join(map(str, strides))}']

    backbone = dict(_delete_=True, **spec.config())
    backbone['out_indices'] = tuple(int(math.log2(s // 4)) for s in strides)
    if checkpoint:
        backbone['init_cfg'] = dict(type='Pretrained', checkpoint=checkpoint)
    overrides: Dict[str, Any] = dict(backbone=backbone)
    all_maps = list(range(len(strides)))

    neck = model.get('neck')
    if neck is not None:
        first = neck[0] if isinstance(neck, (list, tuple)) else neck
        ntype = _strip_scope(first.get('type'))
        if ntype in UNSUPPORTED_NECKS:
            raise SwapError(f'neck {ntype} cannot be adapted: {UNSUPPORTED_NECKS[ntype]}')
        if 'in_channels' not in first:
            raise SwapError(f'neck {ntype} has no in_channels to adapt')
        new_first = dict(in_channels=_map_channels(first['in_channels'], all_maps, channels,
                                                   f'neck {ntype}'))
        if isinstance(neck, (list, tuple)):  # lists are replaced, not merged
            necks = [copy.deepcopy(dict(n)) for n in neck]
            necks[0].update(new_first)
            overrides['neck'] = necks
        else:
            overrides['neck'] = new_first
        notes.append(f'neck {ntype}: in_channels {list(_as_list(first["in_channels"]))} -> '
                     f'{list(_as_list(new_first["in_channels"]))}')
    elif scope == 'mmseg':
        for key in ('decode_head', 'auxiliary_head'):
            heads = model.get(key)
            if heads is None:
                continue
            is_list = isinstance(heads, (list, tuple))
            new_heads = []
            for k, head in enumerate(heads if is_list else [heads]):
                what = f'{key}[{k}]' if is_list else key
                htype = _strip_scope(head.get('type'))
                in_index = head.get('in_index', -1)
                idx = _normalise_indices(in_index, len(strides))
                if any(not 0 <= i < len(strides) for i in idx):
                    raise SwapError(f'{what} ({htype}) reads in_index {in_index} but the '
                                    f'backbone returns {len(strides)} maps')
                if 'in_channels' not in head:
                    raise SwapError(f'{what} ({htype}) has no in_channels to adapt')
                new = _map_channels(head['in_channels'], idx, channels, f'{what} ({htype})')
                new_heads.append(dict(in_channels=new))
                notes.append(f'{what} {htype}: in_channels {head["in_channels"]} -> {new} '
                             f'(in_index {in_index})')
            if is_list:  # lists are replaced, not merged
                full = [copy.deepcopy(dict(h)) for h in heads]
                for h, n in zip(full, new_heads):
                    h.update(n)
                overrides[key] = full
            else:
                overrides[key] = new_heads[0]
    else:
        raise SwapError('the detector has no neck: its heads read the backbone directly '
                        '(e.g. a C4 model with a ResNet shared head), which a transformer '
                        'backbone cannot replace')

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

    custom_keys = {k: dict(decay_mult=0.) for k in no_decay_keys(spec)}
    paramwise = dict(norm_decay_mult=0.)
    if custom_keys:
        paramwise['custom_keys'] = custom_keys
    optim_wrapper = dict(paramwise_cfg=paramwise)

    imports = list(cfg.get('custom_imports', {}).get('imports', []))
    if isinstance(imports, str):
        imports = [imports]
    if 'flatten_mm.models' not in imports:
        imports.append('flatten_mm.models')
    custom_imports = dict(imports=imports, allow_failed_imports=False)
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
        header.append('# No checkpoint given: the backbone starts from random weights (pass '
                      '--checkpoint with a file from tools/convert_checkpoint.py).')
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
    check_rendered(text, plan)
    if out is not None:
        os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
        tmp = f'{out}.tmp{os.getpid()}'
        with open(tmp, 'w', encoding='utf-8') as f:
            f.write(text)
        os.replace(tmp, out)
    return text


def verify_config(path_or_cfg, input_hw: Tuple[int, int] = (224, 256),
                  num_proposals: int = 20) -> tuple:
    """Build the model of a (generated) config on CPU and run its inference graph once
    (``forward.dense_forward``) on a random ``(1, 3, *input_hw)`` image. Returns the
    backbone's output shapes."""
    import torch
    from .forward import build_model, dense_forward
    cfg = path_or_cfg if isinstance(path_or_cfg, Config) else Config.fromfile(path_or_cfg)
    model = build_model(cfg)
    x = torch.randn(1, 3, *input_hw)
    with torch.no_grad():
        feats = model.backbone(x)
        dense_forward(model, x, num_proposals=num_proposals)
    return tuple(tuple(f.shape) for f in feats)


__all__ = ['SwapError', 'SwapPlan', 'check_rendered', 'load_source_config', 'no_decay_keys',
           'plan_swap', 'render_config', 'resolve_config_path', 'source_strides',
           'swap_backbone', 'verify_config']
