"""The export rewrites of two-stage detectors (``flatten_mm/deploy/two_stage.py``, issue
#17) compute exactly what mmdet / mmcv compute: NMS against ``mmcv.ops.nms`` /
``batched_nms``, the whole Mask R-CNN ``mode='tensor'`` path against unmodified mmdet at
sizes where the RPN's ``nms_pre`` cut does and does not apply, with no proposal left, and
the heads that are not rewritten are named. (ONNX Runtime on the exported file:
test_onnx_models.py.)"""
import os.path as osp

import pytest
import torch

from flatten_mm.deploy import config_target
from flatten_mm.deploy.export import max_relative_differences
from flatten_mm.deploy.two_stage import (batched_nms_torchvision, nms_torchvision,
                                         two_stage_rewrites, two_stage_unsupported)

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
MASK_RCNN = 'configs/mmdet/flatten_pvt_v2/mask-rcnn_flatten-pvt-v2-b0_fpn_1x_coco.py'
CASCADE = ('configs/mmdet/flatten_swin/'
           'cascade-mask-rcnn_flatten-swin-t-p4-w7_fpn_4conv1fc-giou_ms-crop-3x_coco.py')
TINY_PVT = {'model.backbone.arch': dict(_delete_=True, embed_dims=(8, 16, 24, 32),
                                        depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                                        mlp_ratios=(2, 2, 2, 2)),
            'model.neck.in_channels': [8, 16, 24, 32]}


def _samples(x):
    from mmdet.structures import DetDataSample
    shape = tuple(x.shape[-2:])
    return [DetDataSample(metainfo=dict(img_shape=shape, batch_input_shape=shape,
                                        pad_shape=shape))]


def _boxes(n, seed):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 60
    wh = torch.rand(n, 2, generator=g) * 30 + 1
    # distinct scores: with ties the order of equal boxes is the implementation's choice
    scores = torch.randperm(n, generator=g).float() / n + 0.01
    return torch.cat([xy, xy + wh], 1), scores


@pytest.mark.parametrize('kwargs', [dict(iou_threshold=0.5),
                                    dict(iou_threshold=0.3, score_threshold=0.4),
                                    dict(iou_threshold=0.7, max_num=7)])
def test_nms_matches_mmcv(kwargs):
    from mmcv.ops import nms
    boxes, scores = _boxes(300, 0)
    dets, keep = nms(boxes, scores, **kwargs)
    dets_tv, keep_tv = nms_torchvision(boxes, scores, **kwargs)
    assert 0 < len(keep) < 300
    assert torch.equal(keep_tv, keep) and torch.equal(dets_tv, dets)


@pytest.mark.parametrize('class_agnostic', [False, True])
def test_batched_nms_matches_mmcv(class_agnostic):
    from mmcv.ops import batched_nms
    boxes, scores = _boxes(400, 1)
    idxs = torch.randint(0, 5, (400, ), generator=torch.Generator().manual_seed(2))
    cfg = dict(type='nms', iou_threshold=0.6, class_agnostic=class_agnostic)
    dets, keep = batched_nms(boxes, scores, idxs, cfg)
    dets_tv, keep_tv = batched_nms_torchvision(boxes, scores, idxs, cfg)
    assert torch.equal(keep_tv, keep) and torch.equal(dets_tv, dets)
    with pytest.raises(NotImplementedError, match='only type=nms'):
        batched_nms_torchvision(boxes, scores, idxs, dict(type='soft_nms', iou_threshold=0.5))


@pytest.fixture(scope='module')
def mask_rcnn():
    torch.manual_seed(0)
    return config_target(osp.join(ROOT, MASK_RCNN), cfg_options=dict(TINY_PVT))


# 64x64: every RPN level has fewer than nms_pre=1000 anchors (mmdet does not rank them);
# 96x160 / 320x256: one / two levels are cut to 1000
@pytest.mark.parametrize('hw', [(64, 64), (96, 160), (320, 256)])
def test_rewritten_mask_rcnn_equals_mmdet(mask_rcnn, hw):
    assert mask_rcnn.output_names == ['rois', 'rpn_scores', 'roi_cls_score', 'roi_bbox_pred',
                                      'roi_mask_preds']
    assert mask_rcnn.instance_key == ('rois', 'rpn_scores')
    x = mask_rcnn.example_input(hw)
    with torch.no_grad():
        ref = mask_rcnn.module(x)
        with two_stage_rewrites() as applied:
            out = mask_rcnn.module(x)
    assert len(applied) == 4
    assert ref[0].shape[0] > 100 and ref[4].shape[0] == 100
    assert [r.shape for r in ref] == [o.shape for o in out]
    assert max_relative_differences(ref, [o.numpy() for o in out]) == [0.0] * 5
    # the rois are the proposals mode='tensor' used: its outputs are ours after them
    model = mask_rcnn.module.inner.model
    norm = mask_rcnn.module
    with torch.no_grad():
        samples = _samples(x)
        plain = model((x - norm.mean) / norm.std if not norm.to_bgr else
                      (x.flip(1) - norm.mean) / norm.std, samples, mode='tensor')[0]
    assert all(torch.equal(a, b) for a, b in zip(plain, ref[2:]))


def test_rewritten_mask_rcnn_without_proposals(mask_rcnn):
    rpn_cfg = mask_rcnn.module.inner.model.rpn_head.test_cfg
    old = rpn_cfg.min_bbox_size
    rpn_cfg.min_bbox_size = 10 ** 6  # every proposal filtered out
    try:
        x = mask_rcnn.example_input((64, 96))
        with torch.no_grad():
            ref = mask_rcnn.module(x)
            with two_stage_rewrites():
                out = mask_rcnn.module(x)
    finally:
        rpn_cfg.min_bbox_size = old
    assert [tuple(r.shape) for r in ref] == [(0, 5), (0, ), (0, 81), (0, 320), (0, 80, 28, 28)]
    assert [r.shape for r in ref] == [o.shape for o in out]


def test_rewrites_restore_and_only_hide_onnx_export_from_mmdet(monkeypatch):
    from mmcv.ops import RoIAlign
    from mmdet.models.dense_heads import RPNHead
    from mmdet.models.roi_heads.roi_extractors import SingleRoIExtractor
    originals = (RPNHead._predict_by_feat_single, SingleRoIExtractor.forward, RoIAlign.forward)
    monkeypatch.setattr(torch.onnx, 'is_in_onnx_export', lambda: True)
    mmdet_code = {'__name__': 'mmdet.models.fake', 'torch': torch}
    exec('def ask():\n    return torch.onnx.is_in_onnx_export()', mmdet_code)
    with two_stage_rewrites():
        assert RPNHead._predict_by_feat_single is not originals[0]
        assert mmdet_code['ask']() is False  # mmdet's stale 2.x ONNX branches stay off
        assert torch.onnx.is_in_onnx_export() is True  # everyone else sees the export
    assert (RPNHead._predict_by_feat_single, SingleRoIExtractor.forward,
            RoIAlign.forward) == originals
    assert mmdet_code['ask']() is True


def test_cascade_exports_rpn_part_and_says_why():
    swin_tiny = {'model.backbone.arch': dict(_delete_=True, embed_dims=8, depths=(2, 2, 2, 2),
                                             num_heads=(1, 2, 2, 4)),
                 'model.neck.in_channels': [8, 16, 32, 64]}
    target = config_target(osp.join(ROOT, CASCADE), cfg_options=swin_tiny)
    assert two_stage_unsupported(target.module.inner.model).startswith(
        'roi_head CascadeRoIHead')
    assert target.output_names == ([f'rpn_cls_score_l{i}' for i in range(5)] +
                                   [f'rpn_bbox_pred_l{i}' for i in range(5)])
    assert 'because of the roi_head CascadeRoIHead' in target.notes[0]


def test_compare_outputs_matches_instances_by_rois():
    """Near-tied proposals may come out of ONNX Runtime in another order or one may be
    replaced: rows are matched by roi and score, unmatched ones counted, values compared;
    identical rois (a box clipped to the image from two levels) pair up one-to-one."""
    import numpy as np
    from flatten_mm.deploy.export import compare_outputs
    from flatten_mm.deploy.targets import ExportTarget
    target = ExportTarget(torch.nn.Identity(), 'detector', 'x', '', ['rois', 'score', 'mask'],
                          instance_key=('rois', 'score'))
    g = torch.Generator().manual_seed(0)
    rois = torch.cat([torch.zeros(6, 1), torch.rand(6, 4, generator=g) * 100], 1)
    rois[2] = rois[0]  # the same box twice, other scores
    score, mask = torch.rand(6, generator=g), torch.rand(3, 2, generator=g)
    perm = [1, 0, 2, 4, 3, 5]  # order swaps, masks only for the first three
    out = [rois[perm].numpy(), score[perm].numpy(), mask[[1, 0, 2]].numpy()]
    check = compare_outputs(target, [rois, score, mask], out)
    assert check.diffs == [0.0, 0.0, 0.0] and check.unmatched == (0, 0)
    out[2] = out[2].copy()
    out[2][0] += 0.01  # the mask of roi 1 (first in ONNX Runtime's order)
    out[0] = np.concatenate([out[0][:5], out[0][5:] + 1.0])  # the last roi is another box
    check = compare_outputs(target, [rois, score, mask], out)
    assert check.unmatched == (1, 1) and check.instances == (6, 6)
    assert check.diffs[:2] == [0.0, 0.0]
    assert abs(check.diffs[2] - 0.01 / mask.abs().max().item()) < 1e-6
    assert check.unmatched_fraction == 1 / 6
