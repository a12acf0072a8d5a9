"""Every config in configs/ parses, builds its model on CPU and runs one forward of the
backbone (+ neck) at a small size; the neck / decode head reads exactly the channels the
backbone declares."""
import glob
import os.path as osp

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope

from conftest import REPO_ROOT

CONFIGS = sorted(p for p in glob.glob(osp.join(REPO_ROOT, 'configs', '**', '*.py'), recursive=True)
                 if '_base_' not in p.split(osp.sep))  # _base_/: fragments, not models


def test_configs_exist():
    assert len(CONFIGS) >= 9


@pytest.mark.parametrize('path', CONFIGS, ids=[osp.relpath(p, osp.join(REPO_ROOT, 'configs'))
                                              for p in CONFIGS])
def test_config_builds_and_runs(path):
    cfg = Config.fromfile(path)
    scope = cfg.get('default_scope')
    assert scope in ('mmdet', 'mmseg'), f'{path}: default_scope {scope!r}'
    pytest.importorskip(scope)
    assert 'flatten_mm.models' in cfg.custom_imports['imports']
    assert cfg.model.backbone.type.startswith('flatten_mm.')
    init_default_scope(scope)
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    model = MODELS.build(cfg.model).eval()
    backbone = model.backbone
    declared = list(backbone.out_channels)
    if getattr(model, 'with_neck', False) or getattr(model, 'neck', None) is not None:
        assert list(cfg.model.neck.in_channels) == declared
    else:  # e.g. UperNet reads the backbone maps directly
        head = cfg.model.decode_head
        in_index = head.get('in_index', list(range(len(declared))))
        in_index = in_index if isinstance(in_index, (list, tuple)) else [in_index]
        assert list(head.in_channels) == [declared[i] for i in in_index]
    if 'auxiliary_head' in cfg.model and cfg.model.auxiliary_head is not None:
        aux = cfg.model.auxiliary_head
        for a in (aux if isinstance(aux, list) else [aux]):
            assert a.in_channels == declared[a.in_index]
    x = torch.randn(1, 3, 224, 256)
    with torch.no_grad():
        feats = backbone(x)
        assert [f.shape[1] for f in feats] == declared
        for f, s in zip(feats, backbone.out_strides):
            assert tuple(f.shape[-2:]) == (-(-224 // s), -(-256 // s))
        if getattr(model, 'neck', None) is not None:
            model.neck(feats)
