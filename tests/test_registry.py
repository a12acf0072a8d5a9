"""Every registered backbone builds as ``flatten_mm.<Name>`` under mmdet and mmseg scopes."""
import subprocess
import sys

import pytest
import torch
from mmengine.registry import DefaultScope

import flatten_mm.models  # noqa: F401
from flatten_mm.registry import MODELS

# the backbones (the scope also holds the classification neck of SimA, tested with the
# classifiers: tests/test_pretrain_configs.py)
BACKBONES = sorted(n for n, cls in MODELS.module_dict.items()
                   if cls.__module__.startswith('flatten_mm.models.backbones.'))
SCOPES = ['mmdet', 'mmseg']


def downstream_registry(scope):
    pytest.importorskip(scope)
    if scope == 'mmdet':
        from mmdet.registry import MODELS as REG
    else:
        from mmseg.registry import MODELS as REG
    return REG


@pytest.mark.parametrize('scope', SCOPES)
@pytest.mark.parametrize('name', BACKBONES)
def test_build_under_foreign_scope(scope, name):
    registry = downstream_registry(scope)
    with DefaultScope.overwrite_default_scope(scope):
        model = registry.build(dict(type=f'flatten_mm.{name}'))
    assert type(model) is MODELS.get(name)
    assert len(model.out_channels) == len(model.out_strides) == len(model.out_indices)
    assert list(model.out_strides) == sorted(model.out_strides)


@pytest.mark.parametrize('scope', SCOPES)
def test_nested_attention_configs_under_foreign_scope(scope):
    """The STYLE.md §3.1 gotcha: inner builds must not go through the mmdet/mmseg registry."""
    registry = downstream_registry(scope)
    tiny = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                mlp_ratios=(2, 2, 2, 2))
    cfg = dict(type='flatten_mm.FLattenPVTv2', arch=tiny,
               attn_cfg=[dict(type='flatten_mm.FocusedLinearAttention'),
                         dict(type='SpatialReductionAttention', sr_ratio=2), dict(), dict()])
    with DefaultScope.overwrite_default_scope(scope):
        model = registry.build(cfg)
    outs = model(torch.randn(1, 3, 64, 64))
    assert len(outs) == 4


@pytest.mark.parametrize('scope', SCOPES)
def test_scope_prefix_imports_plugin_without_explicit_import(scope):
    """``type='flatten_mm.X'`` alone must find the plugin (registry ``locations``)."""
    pytest.importorskip(scope)
    code = (f'from {scope}.registry import MODELS\n'
            'from mmengine.registry import init_default_scope\n'
            f'init_default_scope({scope!r})\n'
            "m = MODELS.build(dict(type='flatten_mm.FLattenPVTv2', arch='b0'))\n"
            'print(type(m).__module__)\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert 'flatten_mm.models.backbones' in out.stdout
