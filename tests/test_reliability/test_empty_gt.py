"""Empty ground truth in an mmdet training batch, for every registered backbone.

A Mask R-CNN (mmdet's own ``mask-rcnn_r50_fpn`` model base, slimmed heads) with each tiny
backbone takes one training step on a batch where one image has no annotations, and on
a batch where no image has any: the losses stay finite (the box / mask losses of an
empty image are zero, not NaN) and every gradient is finite.
"""
import os.path as osp

import numpy as np
import pytest
import torch

from backbone_specs import registered_backbones, spec
from reliability_report import record

NAMES = registered_backbones()
HW = (96, 128)


def build_detector(name: str):
    mmdet = pytest.importorskip('mmdet')
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmdet.registry import MODELS as DET_MODELS

    import flatten_mm.models  # noqa: F401
    from flatten_mm.registry import MODELS

    init_default_scope('mmdet')
    base = osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs', '_base_', 'models',
                    'mask-rcnn_r50_fpn.py')
    cfg = Config.fromfile(base).model
    kwargs = dict(spec(name)['kwargs'])
    backbone = MODELS.build(dict(type=f'flatten_mm.{name}', **kwargs))
    cfg.backbone = dict(type=f'flatten_mm.{name}', **kwargs)
    ch = 32
    cfg.neck.update(in_channels=list(backbone.out_channels), out_channels=ch,
                    num_outs=5)
    cfg.rpn_head.update(in_channels=ch, feat_channels=ch)
    cfg.roi_head.bbox_roi_extractor.out_channels = ch
    cfg.roi_head.mask_roi_extractor.out_channels = ch
    cfg.roi_head.bbox_head.update(in_channels=ch, fc_out_channels=64, num_classes=3)
    cfg.roi_head.mask_head.update(in_channels=ch, conv_out_channels=ch, num_convs=1,
                                  num_classes=3)
    cfg.train_cfg.rcnn.sampler.num = 64
    model = DET_MODELS.build(cfg)
    model.init_weights()
    return model.train()


def sample(with_gt: bool):
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData
    h, w = HW
    data = DetDataSample(metainfo=dict(img_shape=HW, ori_shape=HW, pad_shape=HW,
                                       batch_input_shape=HW, scale_factor=(1., 1.)))
    inst = InstanceData()
    if with_gt:
        inst.bboxes = torch.tensor([[10., 12., 60., 70.], [50., 20., 120., 90.]])
        inst.labels = torch.tensor([0, 2])
        masks = np.zeros((2, h, w), dtype=np.uint8)
        masks[0, 12:70, 10:60] = 1
        masks[1, 20:90, 50:120] = 1
    else:
        inst.bboxes = torch.zeros((0, 4))
        inst.labels = torch.zeros((0, ), dtype=torch.long)
        masks = np.zeros((0, h, w), dtype=np.uint8)
    inst.masks = BitmapMasks(masks, h, w)
    data.gt_instances = inst
    return data


@pytest.mark.parametrize('name', NAMES)
def test_empty_ground_truth_in_a_training_batch(name):
    torch.manual_seed(0)
    model = build_detector(name)
    for case, flags in (('one of two images empty', (True, False)),
                        ('all images empty', (False, False))):
        model.zero_grad()
        x = torch.randn(len(flags), 3, *HW)
        losses = model.loss(x, [sample(f) for f in flags])
        total = sum(v.sum() if isinstance(v, torch.Tensor) else sum(t.sum() for t in v)
                    for k, v in losses.items() if 'loss' in k)
        assert torch.isfinite(total), f'{case}: {losses}'
        for k, v in losses.items():
            vals = v if isinstance(v, (list, tuple)) else [v]
            assert all(torch.isfinite(t).all() for t in vals), f'{case}: {k} = {v}'
        total.backward()
        bad = [n for n, p in model.named_parameters()
               if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert not bad, f'{case}: non-finite gradients in {bad[:5]}'
        shown = {k: round(float(sum(t.detach().sum() for t in
                                    (v if isinstance(v, (list, tuple)) else [v]))), 4)
                 for k, v in losses.items() if 'loss' in k}
        record('empty_gt', name, f'Mask R-CNN training step, {case}',
               f'finite losses {shown}; finite gradients',
               title='Empty ground truth in a training batch (mmdet Mask R-CNN)')
