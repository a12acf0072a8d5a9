"""Two-stage mmdet detectors (Mask R-CNN, Faster R-CNN) whole in ``mode='tensor'``.

``TwoStageDetector._forward`` runs backbone, neck, ``rpn_head.predict`` (proposal
decoding + NMS) and ``roi_head.forward`` (RoIAlign + bbox head, and the mask head on the
first 100 RoIs): its outputs are the RoI heads' raw ``cls_score`` ``(R, C + 1)``,
``bbox_pred`` ``(R, 4C)`` and ``mask_preds`` ``(min(R, 100), C, 28, 28)``, with ``R`` the
number of proposals that survive the RPN's NMS (data-dependent, at most ``max_per_img``).
Three pieces of it cannot be exported as they are, and are rewritten during export
(what mmdeploy's rewriters do for the same modules):

* ``RPNHead._predict_by_feat_single`` (+ ``_bbox_post_process``): Python branches on
  sizes and data (``if nms_pre < scores.shape[0]``, ``if not valid_mask.all()``,
  ``if bboxes.numel() > 0``) and ``InstanceData`` length checks with Python integers.
  The rewrite ranks, cuts, filters and suppresses unconditionally on plain tensors: the
  same proposals in the same order at every size (an empty result stays empty).
* ``mmcv.ops.batched_nms`` / ``nms``: a C++ extension function. The rewrite is the same
  per-level offset NMS through ``torchvision.ops.nms`` (ONNX ``NonMaxSuppression``), with
  mmcv's ``score_threshold`` / ``max_num``; other NMS types (soft-NMS) are refused.
* ``SingleRoIExtractor.forward``: scatters each RoI level's features with ``nonzero``
  and skips empty levels (a branch on data); the rewrite pools every RoI at every level
  and keeps its own level by a 0/1 mask (exactly the same values, ``x * 1 + 0``), and
  ``mmcv.ops.RoIAlign`` (average mode) runs as ``torchvision.ops.roi_align`` (ONNX
  ``RoiAlign``, the same aligned sampling).
* ``torch.onnx.is_in_onnx_export()`` as seen from mmdet's own modules: False. mmdet 3.x
  still carries its 2.x ONNX branches (``delta2bbox`` -> ``onnx_delta2bbox``, which imports
  the removed ``mmdet.core``); the regular code paths trace as they are.

The reference ``compare_with_pytorch`` checks against is the unmodified mmdet/mmcv path.
"""
import contextlib
import sys
from types import SimpleNamespace
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

#: what ``two_stage_unsupported`` accepts
_ROI_HEADS = ('StandardRoIHead', )
_ROI_EXTRACTORS = ('SingleRoIExtractor', )
_RPN_HEADS = ('RPNHead', )


def two_stage_unsupported(model: nn.Module) -> Optional[str]:
    """Why ``model``'s whole ``mode='tensor'`` path cannot be exported (``None``: it can)."""
    rpn = getattr(model, 'rpn_head', None)
    roi = getattr(model, 'roi_head', None)
    if rpn is None or roi is None:
        return 'no rpn_head / roi_head'
    if type(rpn).__name__ not in _RPN_HEADS:
        return f'rpn_head {type(rpn).__name__} (rewritten: {", ".join(_RPN_HEADS)})'
    if type(roi).__name__ not in _ROI_HEADS:
        return (f'roi_head {type(roi).__name__} (rewritten: {", ".join(_ROI_HEADS)}; '
                'cascade and HTC heads loop over stages with data-dependent refinement)')
    nms = dict(rpn.test_cfg.get('nms', {}) or {})
    if nms.get('type', 'nms') != 'nms':
        return f"RPN NMS type {nms.get('type')!r} (only 'nms' is rewritten)"
    for ext_name in ('bbox_roi_extractor', 'mask_roi_extractor'):
        ext = getattr(roi, ext_name, None)
        if ext is None:
            continue
        if type(ext).__name__ not in _ROI_EXTRACTORS:
            return f'{ext_name} {type(ext).__name__} (rewritten: SingleRoIExtractor)'
        for layer in ext.roi_layers:
            if type(layer).__name__ != 'RoIAlign' or getattr(layer, 'pool_mode', 'avg') != 'avg':
                return (f'{ext_name} layer {type(layer).__name__} '
                        f'(only average-mode RoIAlign is rewritten)')
    if getattr(roi, 'with_shared_head', False) and roi.shared_head is not None:
        return 'roi_head with a shared head (C4 models)'
    return None


def nms_torchvision(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
                    offset: int = 0, score_threshold: float = 0.0,
                    max_num: int = -1) -> Tuple[torch.Tensor, torch.Tensor]:
    """``mmcv.ops.nms`` through ``torchvision.ops.nms``: ``(dets (K, 5), keep (K,))``."""
    from torchvision.ops import nms as tv_nms
    if offset != 0:
        raise NotImplementedError('mmcv nms with offset=1 has no torchvision equivalent')
    inds_map = None
    if score_threshold > 0:
        valid = scores > score_threshold
        inds_map = torch.nonzero(valid).squeeze(1)
        boxes, scores = boxes[inds_map], scores[inds_map]
    keep = tv_nms(boxes, scores, float(iou_threshold))
    if max_num > 0:
        keep = keep[:max_num]
    dets = torch.cat((boxes[keep], scores[keep].reshape(-1, 1)), dim=1)
    if inds_map is not None:
        keep = inds_map[keep]
    return dets, keep


def batched_nms_torchvision(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor,
                            nms_cfg: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """``mmcv.ops.batched_nms`` (4-coordinate boxes, ``type='nms'``) through torchvision:
    the same offset trick; mmcv's ``split_thr`` only splits the work (same result)."""
    cfg = dict(nms_cfg)
    class_agnostic = cfg.pop('class_agnostic', False)
    if cfg.pop('type', 'nms') != 'nms':
        raise NotImplementedError('only type=nms is rewritten')
    cfg.pop('split_thr', None)
    if class_agnostic:
        boxes_for_nms = boxes
    else:
        # max over the boxes and 0: defined without boxes too (mmcv's boxes.max() is
        # not); the same offset whenever a coordinate is >= 0 (RPN boxes are clipped)
        top = torch.cat([boxes.reshape(-1), boxes.new_zeros(1)]).max()
        offsets = idxs.to(boxes) * (top + torch.tensor(1).to(boxes))
        boxes_for_nms = boxes + offsets[:, None]
    dets, keep = nms_torchvision(boxes_for_nms, scores, **cfg)
    return torch.cat([boxes[keep], dets[:, -1:]], -1), keep


def _rpn_predict_single(original):

    def _predict_by_feat_single(self, cls_score_list, bbox_pred_list, score_factor_list,
                                mlvl_priors, img_meta, cfg, rescale=False,
                                with_nms=True):
        if rescale or not with_nms:
            return original(self, cls_score_list, bbox_pred_list, score_factor_list,
                            mlvl_priors, img_meta, cfg, rescale, with_nms)
        from mmdet.structures.bbox import cat_boxes, get_box_tensor, get_box_wh
        cfg = self.test_cfg if cfg is None else cfg
        nms_pre = cfg.get('nms_pre', -1)
        preds, priors_kept, mlvl_scores, level_ids = [], [], [], []
        for level, (cls_score, bbox_pred, priors) in enumerate(
                zip(cls_score_list, bbox_pred_list, mlvl_priors)):
            bbox_pred = bbox_pred.permute(1, 2, 0).reshape(-1, self.bbox_coder.encode_size)
            cls_score = cls_score.permute(1, 2, 0).reshape(-1, self.cls_out_channels)
            if self.use_sigmoid_cls:
                scores = cls_score.sigmoid().reshape(-1)
            else:
                scores = cls_score.softmax(-1)[:, :-1].reshape(-1)
            if nms_pre > 0:
                # always ranked and cut: with fewer than nms_pre boxes the cut keeps all
                # (mmdet skips the sort then; NMS ranks by score either way)
                scores, order = scores.sort(descending=True)
                scores, order = scores[:nms_pre], order[:nms_pre]
                bbox_pred, priors = bbox_pred[order], priors[order]
            preds.append(bbox_pred)
            priors_kept.append(priors)
            mlvl_scores.append(scores)
            level_ids.append(torch.full_like(scores, level, dtype=torch.long))
        bboxes = get_box_tensor(self.bbox_coder.decode(
            cat_boxes(priors_kept), torch.cat(preds), max_shape=img_meta['img_shape']))
        scores, level_ids = torch.cat(mlvl_scores), torch.cat(level_ids)
        if cfg.get('min_bbox_size', -1) >= 0:
            w, h = get_box_wh(bboxes)
            valid = torch.nonzero((w > cfg.min_bbox_size) & (h > cfg.min_bbox_size)).squeeze(1)
            bboxes, scores, level_ids = bboxes[valid], scores[valid], level_ids[valid]
        det_bboxes, keep = batched_nms_torchvision(bboxes, scores, level_ids, cfg.nms)
        bboxes, scores = bboxes[keep][:cfg.max_per_img], det_bboxes[:cfg.max_per_img, -1]
        # plain fields: InstanceData checks lengths with Python integers, which would fix
        # (or, after NMS, fail on) the box count
        return SimpleNamespace(bboxes=bboxes, scores=scores,
                               labels=torch.zeros_like(scores, dtype=torch.long))

    return _predict_by_feat_single


def _single_roi_extractor_forward(self, feats, rois, roi_scale_factor=None):
    rois = rois.type_as(feats[0])
    num_levels = len(feats)
    if num_levels == 1:
        return self.roi_layers[0](feats[0], rois)
    target_lvls = self.map_roi_levels(rois, num_levels)
    if roi_scale_factor is not None:
        rois = self.roi_rescale(rois, roi_scale_factor)
    roi_feats = None
    for i in range(num_levels):
        keep = (target_lvls == i).to(feats[i].dtype).view(-1, 1, 1, 1)
        level = self.roi_layers[i](feats[i], rois) * keep
        roi_feats = level if roi_feats is None else roi_feats + level
    return roi_feats


def _roi_align_forward(original):

    def forward(self, input, rois):
        if getattr(self, 'pool_mode', 'avg') != 'avg':
            return original(self, input, rois)
        from torchvision.ops import roi_align
        return roi_align(input, rois, self.output_size, self.spatial_scale,
                         self.sampling_ratio, self.aligned)

    return forward


def _not_for_mmdet(original):

    def is_in_onnx_export() -> bool:
        caller = sys._getframe(1).f_globals.get('__name__', '')
        return False if caller.startswith('mmdet.') else original()

    return is_in_onnx_export


@contextlib.contextmanager
def two_stage_rewrites() -> Iterator[List[str]]:
    """The rewrites above, applied inside the block (yields their names; nothing is
    applied when mmdet / mmcv are not installed)."""
    applied: List[str] = []
    undo = []
    try:
        from mmcv.ops import RoIAlign
        from mmdet.models.dense_heads import RPNHead
        from mmdet.models.roi_heads.roi_extractors import SingleRoIExtractor
    except Exception:  # no mmdet: no detector to export
        yield applied
        return
    for cls, attr, new, name in (
            (RPNHead, '_predict_by_feat_single',
             _rpn_predict_single(RPNHead._predict_by_feat_single),
             'mmdet RPNHead proposals (branch-free, torchvision NMS)'),
            (SingleRoIExtractor, 'forward', _single_roi_extractor_forward,
             'mmdet SingleRoIExtractor (masked levels)'),
            (RoIAlign, 'forward', _roi_align_forward(RoIAlign.forward),
             'mmcv RoIAlign (torchvision roi_align)'),
            (torch.onnx, 'is_in_onnx_export', _not_for_mmdet(torch.onnx.is_in_onnx_export),
             'mmdet legacy ONNX branches off')):
        original = cls.__dict__[attr]
        setattr(cls, attr, new)
        undo.append(lambda cls=cls, attr=attr, original=original: setattr(cls, attr, original))
        applied.append(name)
    try:
        yield applied
    finally:
        for fn in reversed(undo):
            fn()


def two_stage_tensor_forward(model: nn.Module, x: torch.Tensor):
    """``model(x, mode='tensor')`` of an image batch without data samples (each image's
    ``img_shape`` is the input size: no padding), with the proposals it used in front:
    ``(rois (R, 5) [image index, x1, y1, x2, y2], rpn_scores (R,)) + roi_head outputs``.
    The RoI heads' ``bbox_pred`` are deltas relative to these proposals, so a deployment
    needs them to decode boxes."""
    from mmdet.structures import DetDataSample
    from mmdet.structures.bbox import bbox2roi
    H, W = x.shape[-2:]
    samples = []
    for _ in range(x.shape[0]):
        sample = DetDataSample()
        for key in ('img_shape', 'batch_input_shape', 'pad_shape'):
            # set_field, not metainfo=: that deep-copies, which symbolic sizes refuse
            sample.set_field((H, W), key, field_type='metainfo')
        samples.append(sample)
    # TwoStageDetector._forward, step by step to keep the proposals
    feats = model.extract_feat(x)
    proposals = model.rpn_head.predict(feats, samples, rescale=False)
    roi_outs = model.roi_head.forward(feats, proposals, samples)
    rois = bbox2roi([p.bboxes for p in proposals])
    scores = torch.cat([p.scores for p in proposals])
    return (rois, scores) + tuple(roi_outs)
