"""Tiny test configurations of every registered backbone, for the reliability matrix.

Every class registered in ``flatten_mm.registry.MODELS`` is parametrised automatically;
a class without an entry in ``TINY_ARCHS`` makes the matrix fail with a message saying
what to add, so a new backbone cannot silently escape these checks.
"""
from typing import Dict, List

import pytest

import flatten_mm.models  # noqa: F401  (registers the backbones)
from flatten_mm.registry import MODELS

_PVT = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
            mlp_ratios=(2, 2, 2, 2))
_PVT_WIDE = dict(_PVT, embed_dims=(16, 16, 24, 32))

#: class name -> ``kwargs`` (a tiny model, seconds on CPU) and ``variant`` (constructor
#: kwargs of another variant of the same class: other widths, same key layout)
TINY_ARCHS: Dict[str, Dict[str, dict]] = {
    'FLattenPVTv2': dict(kwargs=dict(arch=_PVT), variant=dict(arch=_PVT_WIDE)),
    'FLattenPVT': dict(kwargs=dict(arch=_PVT), variant=dict(arch=_PVT_WIDE)),
    'PVTv2': dict(kwargs=dict(arch=_PVT), variant=dict(arch=_PVT_WIDE)),
    'QuadTreePVTv2': dict(kwargs=dict(arch=_PVT, attn_cfg=dict(topk=4)),
                          variant=dict(arch=_PVT_WIDE, attn_cfg=dict(topk=4))),
    'FLattenSwin': dict(kwargs=dict(arch=dict(embed_dims=8, depths=(2, 2, 2, 2),
                                              num_heads=(1, 2, 2, 4))),
                        variant=dict(arch=dict(embed_dims=16, depths=(2, 2, 2, 2),
                                               num_heads=(1, 2, 2, 4)))),
    'FLattenCSWin': dict(kwargs=dict(arch=dict(embed_dims=8, depths=(1, 2, 2, 1),
                                               num_heads=(2, 2, 4, 4))),
                         variant=dict(arch=dict(embed_dims=16, depths=(1, 2, 2, 1),
                                                num_heads=(2, 2, 4, 4)))),
    'SimAXCiT': dict(kwargs=dict(arch=dict(embed_dims=32, depth=3, num_heads=2),
                                 block_indices=(0, 1, 1, 2)),
                     variant=dict(arch=dict(embed_dims=48, depth=3, num_heads=2),
                                  block_indices=(0, 1, 1, 2))),
}


def registered_backbones() -> List[str]:
    """Names of every backbone registered in the ``flatten_mm`` scope (the scope also holds
    the classification neck of SimA, which is not a backbone)."""
    return sorted(n for n, cls in MODELS.module_dict.items()
                  if cls.__module__.startswith('flatten_mm.models.backbones.'))


def spec(name: str) -> Dict[str, dict]:
    if name not in TINY_ARCHS:
        pytest.fail(f'{name} is registered in flatten_mm.registry.MODELS but has no tiny test '
                    f'configuration: add TINY_ARCHS[{name!r}] = dict(kwargs=..., variant=...) to '
                    'tests/test_reliability/backbone_specs.py (a few channels, 1-2 blocks per '
                    'stage) so the reliability matrix covers it')
    return TINY_ARCHS[name]


def build(name: str, **overrides):
    """The tiny model of ``name`` (``overrides`` update its kwargs), eval mode."""
    kwargs = dict(spec(name)['kwargs'])
    kwargs.update(overrides)
    return MODELS.build(dict(type=f'flatten_mm.{name}', **kwargs)).eval()


def build_variant(name: str):
    return MODELS.build(dict(type=f'flatten_mm.{name}', **spec(name)['variant'])).eval()


def num_stages(model) -> int:
    return len(model.stages) if hasattr(model, 'stages') else len(model.blocks)
