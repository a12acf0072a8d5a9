"""Catalogue of every backbone variant under a user-facing name.

Names are derived from the registered classes and their ``arch_zoo`` (aliases collapse
to one name per distinct variant), e.g. ``flatten-pvt-v2-b1``, ``flatten-pvt-t``,
``flatten-swin-t``, ``flatten-cswin-b-384``, ``quadtree-b-pvt-v2-b2``,
``quadtree-a-pvt-v2-b0``, ``sima-xcit-s12-p16``, ``pvt-v2-b1`` (plain PVTv2 with
softmax spatial-reduction attention). Each entry knows its registered type, its ``arch``
(and other constructor arguments), the channels and strides of its four output maps
and its parameter count (counted without allocating the weights).
"""
import contextlib
import difflib
import functools
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Tuple, Type

import torch.nn as nn

from ..registry import MODELS


@dataclass(frozen=True)
class BackboneSpec:
    """One catalogue entry.

    Attributes:
        name: catalogue name (``flatten-pvt-v2-b1``).
        family: short family name (``flatten_pvt_v2``), as in ``configs/*/<family>``.
        cls_name: registered class name (``FLattenPVTv2``).
        kwargs: constructor arguments besides the output selection (``arch``, and
            ``patch_size`` for SimA).
    """

    name: str
    family: str
    cls_name: str
    kwargs: Tuple[Tuple[str, object], ...] = field(default_factory=tuple)

    @property
    def type(self) -> str:
        """Scoped type for configs (``flatten_mm.FLattenPVTv2``)."""
        return f'flatten_mm.{self.cls_name}'

    @property
    def arch(self) -> str:
        return dict(self.kwargs)['arch']

    def config(self, **extra) -> dict:
        """``dict(type=..., arch=..., **extra)`` ready for a config."""
        return dict(type=self.type, **dict(self.kwargs), **extra)

    def backbone_class(self) -> Type[nn.Module]:
        return MODELS.get(self.cls_name)  # imports flatten_mm.models (registry locations)

    def build(self, **extra) -> nn.Module:
        """Instantiate the backbone (random weights)."""
        return self.backbone_class()(**dict(self.kwargs), **extra)

    @property
    def out_channels(self) -> Tuple[int, ...]:
        """Channels of the four maps (strides 4, 8, 16, 32)."""
        return _static_info(self)[0]

    @property
    def out_strides(self) -> Tuple[int, ...]:
        return _static_info(self)[1]

    @property
    def num_params(self) -> int:
        """Parameters of the dense backbone (incl. its output norms / pyramid adapters)."""
        return _static_info(self)[2]


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    """Create every parameter on the meta device: shapes without memory or init cost."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != 'meta':
            param = nn.Parameter(param.to('meta'), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@functools.lru_cache(maxsize=None)
def _static_info(spec: BackboneSpec) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    with _meta_parameters():
        model = spec.build()
    return (tuple(model.out_channels), tuple(model.out_strides),
            sum(p.numel() for p in model.parameters()))


# family -> (registered class, name prefix); the name is f'{prefix}-{arch}'
_FAMILIES = (
    ('flatten_pvt_v2', 'FLattenPVTv2', 'flatten-pvt-v2'),
    ('flatten_pvt', 'FLattenPVT', 'flatten-pvt'),
    ('flatten_swin', 'FLattenSwin', 'flatten-swin'),
    ('flatten_cswin', 'FLattenCSWin', 'flatten-cswin'),
    ('quadtree_pvt_v2', 'QuadTreePVTv2', 'quadtree'),
    ('sima_xcit', 'SimAXCiT', 'sima-xcit'),
    ('pvt_v2', 'PVTv2', 'pvt-v2'),
)


def _canonical_archs(arch_zoo: Dict[str, dict]) -> List[str]:
    """One key per distinct variant: the shortest alias (first on ties), zoo order."""
    groups: List[Tuple[dict, List[str]]] = []
    for key, value in arch_zoo.items():
        for settings, keys in groups:
            if settings == value:
                keys.append(key)
                break
        else:
            groups.append((value, [key]))
    return [min(keys, key=len) for _, keys in groups]


def _quadtree_name(arch: str) -> str:
    # 'b0' -> quadtree-b-pvt-v2-b0 (variant B); 'a-b0' -> quadtree-a-pvt-v2-b0
    variant, size = arch.split('-', 1) if '-' in arch else ('b', arch)
    return f'quadtree-{variant}-pvt-v2-{size}'


@functools.lru_cache(maxsize=None)
def _catalogue() -> Tuple[BackboneSpec, ...]:
    specs = []
    for family, cls_name, prefix in _FAMILIES:
        cls = MODELS.get(cls_name)
        for arch in _canonical_archs(cls.arch_zoo):
            if cls_name == 'QuadTreePVTv2':
                specs.append(BackboneSpec(_quadtree_name(arch), family, cls_name,
                                          (('arch', arch), )))
            elif cls_name == 'SimAXCiT':
                for patch in (16, 8):
                    specs.append(BackboneSpec(f'{prefix}-{arch}-p{patch}', family, cls_name,
                                              (('arch', arch), ('patch_size', patch))))
            else:
                specs.append(BackboneSpec(f'{prefix}-{arch}', family, cls_name,
                                          (('arch', arch), )))
    return tuple(specs)


def backbone_catalogue() -> Dict[str, BackboneSpec]:
    """All catalogue entries by name (family order, then the ``arch_zoo`` order)."""
    return {spec.name: spec for spec in _catalogue()}


def get_backbone_spec(name: str) -> BackboneSpec:
    """The entry called ``name``.

    Raises:
        ValueError: unknown name; the message suggests close names and says how to
            list them all.
    """
    catalogue = backbone_catalogue()
    key = name.strip().lower()
    if key in catalogue:
        return catalogue[key]
    close = difflib.get_close_matches(key, list(catalogue), n=4, cutoff=0.6)
    hint = f' Did you mean: {", ".join(close)}?' if close else ''
    raise ValueError(f'unknown backbone {name!r}.{hint} `python tools/swap_backbone.py --list` '
                     f'prints all {len(catalogue)} names.')


def format_catalogue(specs: List[BackboneSpec] = None) -> str:
    """A plain-text table: name, type, arch, params, channels, strides."""
    specs = list(backbone_catalogue().values()) if specs is None else specs
    rows = [('name', 'type', 'arch', 'params', 'out_channels', 'strides')]
    for s in specs:
        extra = dict(s.kwargs)
        arch = extra.pop('arch')
        arch += ''.join(f' {k}={v}' for k, v in extra.items())
        rows.append((s.name, s.type, arch, f'{s.num_params / 1e6:.2f}M',
                     ','.join(map(str, s.out_channels)), ','.join(map(str, s.out_strides))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
