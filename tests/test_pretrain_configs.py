"""ImageNet-1k classifiers (``configs/mmpretrain``): one config per catalogue variant, built
through mmpretrain's registry, the official classifier's structure, one training step that
reaches every parameter, and a 224x224 batch classified."""
import glob
import os.path as osp

import pytest
import torch

from conftest import REPO_ROOT

pytest.importorskip('mmpretrain')

from mmengine.config import Config  # noqa: E402
from mmengine.registry import init_default_scope  # noqa: E402

from flatten_mm.models.catalogue import backbone_catalogue  # noqa: E402
from flatten_mm.models.classification import catalogue_classifier_cfg  # noqa: E402
from flatten_mm.models.zoo import pretraining_config  # noqa: E402

CATALOGUE = backbone_catalogue()
CONFIGS = sorted(p for p in glob.glob(osp.join(REPO_ROOT, 'configs', 'mmpretrain', '*', '*.py'))
                 if '_base_' not in p.split(osp.sep))

#: parameters (millions, with the 1000-class head) of the official classifiers, counted
#: from the official code: shared/spec/backbones.md ("params" columns)
SPEC_PARAMS = {
    'flatten-pvt-t': 12.15, 'flatten-pvt-s': 21.67, 'flatten-pvt-m': 37.24,
    'flatten-pvt-b': 50.65,
    'flatten-pvt-v2-b0': 3.59, 'flatten-pvt-v2-b1': 12.93, 'flatten-pvt-v2-b2': 22.55,
    'flatten-pvt-v2-b3': 38.27, 'flatten-pvt-v2-b4': 51.84,
    'flatten-swin-t': 29.19, 'flatten-swin-s': 50.51, 'flatten-swin-b': 88.97,
    'flatten-swin-b-384': 91.43,
    'flatten-cswin-t': 21.20, 'flatten-cswin-s': 35.45, 'flatten-cswin-b': 74.87,
    'flatten-cswin-b-384': 78.37,
    'quadtree-b-pvt-v2-b0': 3.59, 'quadtree-b-pvt-v2-b1': 13.66, 'quadtree-b-pvt-v2-b2': 25.07,
    'quadtree-b-pvt-v2-b3': 46.26, 'quadtree-b-pvt-v2-b4': 64.20, 'quadtree-a-pvt-v2-b0': 3.20,
    'sima-xcit-n12-p16': 3.05, 'sima-xcit-n12-p8': 3.05, 'sima-xcit-t12-p16': 6.72,
    'sima-xcit-t12-p8': 6.71, 'sima-xcit-s12-p16': 26.25, 'sima-xcit-s12-p8': 26.21,
    'sima-xcit-t24-p16': 12.12, 'sima-xcit-t24-p8': 12.11, 'sima-xcit-s24-p16': 47.67,
    'sima-xcit-s24-p8': 47.63, 'sima-xcit-m24-p16': 84.40, 'sima-xcit-m24-p8': 84.32,
    'sima-xcit-l24-p16': 189.10, 'sima-xcit-l24-p8': 188.93,
}


def test_one_pretraining_config_per_catalogue_variant():
    names = {osp.basename(p).split('_')[0] for p in CONFIGS}
    assert names == set(CATALOGUE)
    assert len(CONFIGS) == len(CATALOGUE)
    for name, spec in CATALOGUE.items():
        path = pretraining_config(name)
        assert osp.isfile(osp.join(REPO_ROOT, path)), path
        assert path.startswith(f'configs/mmpretrain/{spec.family}/{name}_8xb')


@pytest.mark.parametrize('name', sorted(CATALOGUE))
def test_pretraining_config_builds_trains_and_classifies(name):
    import mmpretrain.models  # noqa: F401
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample

    cfg = Config.fromfile(osp.join(REPO_ROOT, pretraining_config(name)))
    assert cfg.default_scope == 'mmpretrain'
    assert 'flatten_mm.models' in cfg.custom_imports['imports']
    # the official classifier's structure (flatten_mm.models.classification), the recipe's
    # drop path
    expected = catalogue_classifier_cfg(CATALOGUE[name],
                                        drop_path_rate=cfg.model.backbone.drop_path_rate)
    assert cfg.model.backbone.to_dict() == expected['backbone']
    assert cfg.model.neck.to_dict() == expected['neck']
    assert (cfg.model.head.type, cfg.model.head.num_classes, cfg.model.head.in_channels) == \
        ('LinearClsHead', 1000, expected['head']['in_channels'])
    assert cfg.model.head.loss.type == 'LabelSmoothLoss'

    init_default_scope('mmpretrain')
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    count = sum(p.numel() for p in model.parameters())
    if name in SPEC_PARAMS:
        assert abs(count / 1e6 - SPEC_PARAMS[name]) < 0.006, count
    # one training step: every parameter is trainable and gets a gradient (DDP without
    # find_unused_parameters, as mmpretrain's tools/train.py runs it)
    assert all(p.requires_grad for p in model.parameters())
    model.train()
    x = torch.randn(2, 3, 224, 224)
    samples = [DataSample().set_gt_label(i) for i in (3, 997)]
    losses = model(x, samples, mode='loss')
    loss = sum(v for v in losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    model.eval()
    with torch.no_grad():
        logits = model(x, mode='tensor')
    assert logits.shape == (2, 1000) and torch.isfinite(logits).all()
