"""Output strides and channels of the backbone a config swaps out.

A few families have a geometry that follows exactly from their config (ResNet-likes with
their ``strides`` / ``dilations``, RegNet, flatten_mm's own backbones, and the two
mmpretrain backbones mmdet / mmseg configs use, ConvNeXt and PoolFormer, which can then be
swapped out without mmpretrain installed). Every other backbone is built from its config
(no weights, ``init_cfg`` dropped) and run once on a ``(1, 3, 128, 160)`` image: first
on the meta device (shapes only, no memory; or with only the parameters created there,
for modules whose construction computes on tensors), on CPU when a module cannot run
there. A
backbone that fails at that size but declares the size it was built for (``img_size``,
e.g. BEiT / MAE, whose position tables are fixed to it; else the config's
``crop_size``) is measured again at that size, so that its real structure (a plain
single-stride ViT) is what a refusal reports, not the failed probe.

``measure_source_backbone`` raises ``SwapError`` when this cannot be done, naming why
(the scope's package is missing, the type is not registered, the forward failed).
"""
import contextlib
import copy
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from mmengine.config.utils import MODULE2PACKAGE
from mmengine.registry import init_default_scope

from ..models.catalogue import _meta_parameters, backbone_catalogue

#: input used to measure strides (non-square: a transposed output would show)
PROBE_HW = (128, 160)

_RESNET_LIKE = ('ResNet', 'ResNetV1c', 'ResNetV1d', 'ResNeXt', 'Res2Net', 'ResNeSt',
                'SEResNet', 'SEResNeXt', 'ResNet_IBN')


class SwapError(ValueError):
    """The source config cannot be adapted (the message says why)."""


@dataclass(frozen=True)
class SourceGeometry:
    """What the source backbone feeds its readers.

    Attributes:
        type: the backbone's ``type`` as written in the config (``mmpretrain.ConvNeXt``).
        strides: output stride of each returned map, in output order.
        channels: channels of each map (``None`` when known from the config only).
        how: ``'config'`` (exact geometry of a known family) or ``'meta'`` / ``'cpu'``
            (measured by a forward on that device).
        probe_hw: the input size of the measuring forward (``None`` from the config);
            the backbone's own ``img_size`` / the config's crop size when the backbone
            cannot run the small probe (position tables fixed to the training size).
    """

    type: str
    strides: Tuple[int, ...]
    channels: Optional[Tuple[int, ...]]
    how: str
    probe_hw: Optional[Tuple[int, int]] = None


def type_name(type_: Any) -> str:
    """``'mmpretrain.ConvNeXt'`` -> ``'ConvNeXt'``; classes give their ``__name__``."""
    if not isinstance(type_, str):
        return getattr(type_, '__name__', str(type_))
    return type_.rsplit('.', 1)[-1]


def type_scope(type_: Any) -> Optional[str]:
    """``'mmpretrain.ConvNeXt'`` -> ``'mmpretrain'``; ``None`` for unscoped types."""
    if isinstance(type_, str) and '.' in type_:
        return type_.split('.', 1)[0]
    return None


def scope_package_missing(scope: Optional[str]) -> Optional[str]:
    """Name of the package behind ``scope`` when it is not installed, else ``None``."""
    if scope is None:
        return None
    package = MODULE2PACKAGE.get(scope, scope)
    try:
        found = importlib.util.find_spec(scope) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else package


def _normalise_indices(indices, num: int) -> List[int]:
    if isinstance(indices, int):
        indices = [indices]
    return [i + num if i < 0 else i for i in indices]


def exact_strides(backbone: dict) -> Optional[Tuple[int, ...]]:
    """Strides of the families whose geometry follows from the config, else ``None``."""
    type_ = backbone.get('type')
    name, scope = type_name(type_), type_scope(type_)
    if scope == 'flatten_mm':
        if any(spec.cls_name == name for spec in backbone_catalogue().values()):
            idx = _normalise_indices(backbone.get('out_indices', (0, 1, 2, 3)), 4)
            return tuple(4 * 2**i for i in idx)
        return None
    if scope in ('mmpretrain', 'mmcls'):
        if name == 'ConvNeXt':  # stem /4, a /2 downsample before each later stage
            idx = _normalise_indices(backbone.get('out_indices', -1), 4)
            return tuple(4 * 2**i for i in idx)
        if name == 'PoolFormer':
            # out_indices index the 7 entries of `network`: stages at 0, 2, 4, 6 (strides
            # 4, 8, 16, 32) and the patch embeddings between them at 1, 3, 5
            idx = _normalise_indices(backbone.get('out_indices', -1), 7)
            return tuple(4 * 2**((i + 1) // 2) for i in idx)
        return None
    if scope not in (None, 'mmdet', 'mmseg'):
        return None
    if name in _RESNET_LIKE or name == 'RegNet':
        num_stages = backbone.get('num_stages', 4)
        default = (2, 2, 2, 2) if name == 'RegNet' else (1, 2, 2, 2)
        strides = backbone.get('strides', default[:num_stages])
        stem = 2 if name == 'RegNet' else 4
        idx = _normalise_indices(backbone.get('out_indices', tuple(range(num_stages))),
                                 num_stages)
        return tuple(stem * math.prod(strides[:i + 1]) for i in idx)
    return None


def _clean_backbone_cfg(backbone: dict) -> dict:
    cfg = copy.deepcopy(dict(backbone))
    cfg.pop('init_cfg', None)
    if 'pretrained' in cfg:
        cfg['pretrained'] = None
    return cfg


def _registry(scope: str):
    init_default_scope(scope)
    if scope == 'mmdet':
        import mmdet.models  # noqa: F401  (registration)
        from mmdet.registry import MODELS
    else:
        import mmseg.models  # noqa: F401
        from mmseg.registry import MODELS
    return MODELS


def _maps(out) -> List:
    if isinstance(out, torch.Tensor):
        out = [out]
    if isinstance(out, (list, tuple)) and out and all(
            isinstance(o, (list, tuple)) and o and isinstance(o[0], torch.Tensor)
            for o in out):
        # ViTs with output_cls_token (DPT): (map, class token) per output; the map counts
        out = [o[0] for o in out]
    if not isinstance(out, (list, tuple)) or not all(
            isinstance(o, torch.Tensor) and o.dim() == 4 for o in out):
        raise SwapError('its forward does not return a tuple of (B, C, H, W) maps')
    return list(out)


def _run(backbone_cfg: dict, scope: str, device: str, hw: Tuple[int, int]) -> List:
    """Build the backbone and run a zero image of ``hw``. ``device``: ``'meta'`` (built
    under the meta device), ``'meta-params'`` (parameters created on the meta device,
    everything else built on CPU, then moved: for modules whose ``__init__`` computes on
    tensors, e.g. BEiT's ``linspace(...).item()`` drop-path rates) or ``'cpu'``."""
    MODELS = _registry(scope)
    ctx = {'meta': lambda: torch.device('meta'), 'meta-params': _meta_parameters,
           'cpu': contextlib.nullcontext}[device]
    with ctx(), torch.no_grad():
        model = MODELS.build(_clean_backbone_cfg(backbone_cfg))
    run_on = 'cpu' if device == 'cpu' else 'meta'
    model.to(run_on).eval()
    with torch.no_grad():
        x = torch.zeros(1, 3, *hw, device=run_on)
        return _maps(model(x))


def _strides_of(shapes: Sequence[Tuple[int, ...]], hw: Tuple[int, int]) -> Tuple[int, ...]:
    strides = []
    for s in shapes:
        h, w = s[2:]
        stride = round(hw[0] / h)
        if stride < 1 or -(-hw[0] // stride) != h or -(-hw[1] // stride) != w:
            raise SwapError(f'a map of {h}x{w} from a {hw[0]}x{hw[1]} input has no '
                            'single stride')
        strides.append(stride)
    return tuple(strides)


def _hw(size: Any) -> Optional[Tuple[int, int]]:
    if isinstance(size, int):
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(
            isinstance(v, int) for v in size):
        return (int(size[0]), int(size[1]))
    return None


def measure_source_backbone(backbone: dict, scope: str,
                            crop_size: Any = None) -> SourceGeometry:
    """Strides (and, when measured, channels) of the maps ``backbone`` returns.

    Args:
        backbone: the source ``model.backbone`` config.
        scope: ``'mmdet'`` or ``'mmseg'`` (the config's default scope).
        crop_size: the config's training size ``(H, W)`` (or an int), the second probe
            size when the backbone declares no ``img_size``.

    Raises:
        SwapError: the backbone cannot be built or run; the message says why.
    """
    type_ = backbone.get('type')
    name = type_ if isinstance(type_, str) else type_name(type_)
    strides = exact_strides(backbone)
    if strides is not None:
        return SourceGeometry(name, strides, None, 'config')
    missing = scope_package_missing(type_scope(type_))
    if missing:
        raise SwapError(f'cannot measure the output strides of backbone {name!r}: it is '
                        f'registered by {missing}, which is not installed (pip install '
                        f'{missing}, or start from a config whose backbone is built in)')
    errors = []
    probes = [PROBE_HW]
    fixed = _hw(backbone.get('img_size')) or _hw(crop_size)
    if fixed is not None and fixed != PROBE_HW:
        probes.append(fixed)  # built for one size (fixed position tables): measure there
    for hw in probes:
        for device in ('meta', 'meta-params', 'cpu'):
            try:
                shapes = [tuple(m.shape) for m in _run(backbone, scope, device, hw)]
            except SwapError as exc:
                raise SwapError(f'cannot measure the output strides of backbone {name!r}: '
                                f'{exc}') from exc
            except KeyError as exc:  # not registered
                raise SwapError(f'backbone type {name!r} is not registered in {scope} (is '
                                f'the module that defines it in custom_imports?): {exc}'
                                ) from exc
            except Exception as exc:  # noqa: BLE001 -- reported if every probe fails
                msg = str(exc).splitlines()[0][:200] if str(exc) else ''
                errors.append(f'{hw[0]}x{hw[1]} {device}: {type(exc).__name__}'
                              + (f': {msg}' if msg else ''))
                continue
            try:
                strides = _strides_of(shapes, hw)
            except SwapError as exc:
                raise SwapError(f'backbone {name!r}: {exc}') from exc
            return SourceGeometry(name, strides, tuple(s[1] for s in shapes),
                                  'cpu' if device == 'cpu' else 'meta', hw)
    sizes = ' or '.join(f'{h}x{w}' for h, w in probes)
    raise SwapError(f'cannot measure the output strides of backbone {name!r}: building it '
                    f'and running a {sizes} image failed ({"; ".join(errors)})')
