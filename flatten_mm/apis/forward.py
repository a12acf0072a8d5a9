"""Build an mmdet / mmseg model from a config and run its deterministic inference graph.

``dense_forward`` runs what a detector or segmentor computes for one image, without the
data-dependent post-processing whose cost would vary with the (random) weights:

* mmseg ``EncoderDecoder``: backbone, neck, decode head (``model._forward``; auxiliary
  heads are training-only);
* mmdet single-stage and DETR-like detectors: backbone, neck, head / transformer
  (``model._forward``);
* mmdet two-stage / cascade detectors: backbone, neck, RPN head, then every bbox stage
  of the RoI head on a fixed number of random proposals (1000 by default) and every
  mask stage on the first 100 -- mmdet 2.x's ``forward_dummy``, the convention of the
  published Mask R-CNN / Cascade Mask R-CNN FLOP numbers (mmdet 3.x's ``_forward``
  instead refines the boxes between cascade stages and runs the mask heads on all
  proposals).
"""
import copy
from typing import Optional, Tuple

import torch
import torch.nn as nn
from mmengine.config import Config
from mmengine.logging import MMLogger
from mmengine.registry import init_default_scope
from mmengine.utils import import_modules_from_strings


def strip_pretrained(obj) -> None:
    """Remove, in place, every checkpoint a model config would read while its weights
    are initialised: ``init_cfg`` entries of type ``Pretrained`` (single or in a list)
    and old-style ``pretrained=`` paths, at any depth. The other ``init_cfg`` entries
    (Xavier, Normal, Constant...) stay."""
    if isinstance(obj, dict):
        init = obj.get('init_cfg')
        if isinstance(init, dict) and init.get('type') == 'Pretrained':
            obj['init_cfg'] = None
        elif isinstance(init, (list, tuple)):
            obj['init_cfg'] = [c for c in init
                               if not (isinstance(c, dict) and c.get('type') == 'Pretrained')]
        if isinstance(obj.get('pretrained'), str):
            obj['pretrained'] = None
        for v in obj.values():
            strip_pretrained(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            strip_pretrained(v)


def build_model(cfg: Config, scope: Optional[str] = None,
                init_weights: bool = False) -> nn.Module:
    """Build ``cfg.model`` with the registry of ``cfg.default_scope`` (``mmdet`` /
    ``mmseg``), importing ``custom_imports`` first; the model is returned in eval mode.

    ``init_weights=False``: the modules keep their constructors' initialisation (quick;
    what a checkpoint is loaded over). ``True``: ``model.init_weights()`` runs as
    mmengine's Runner runs it before training, with every checkpoint entry removed first
    (``strip_pretrained``: nothing is read or downloaded) -- needed to run a randomly
    initialised model, since some parameters are created uninitialised
    (``torch.Tensor(n)``) and only set there (SSD's ``L2Norm`` scale, DETR-likes'
    ``level_embed``): without it they hold whatever was in memory.
    """

    scope = scope or cfg.get('default_scope')
    if scope not in ('mmdet', 'mmseg'):
        raise ValueError(f'default_scope must be mmdet or mmseg, got {scope!r}')
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg.custom_imports)
    init_default_scope(scope)
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    model_cfg = copy.deepcopy(cfg.model)
    if scope == 'mmseg' and model_cfg.get('pretrained') is not None:
        model_cfg.pretrained = None
    if not init_weights:
        return MODELS.build(model_cfg).eval()
    strip_pretrained(model_cfg)
    model = MODELS.build(model_cfg)
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel('WARNING')  # no per-parameter initialisation listing
    try:
        model.init_weights()
    finally:
        logger.setLevel(level)
    return model.eval()


def _random_proposals(num: int, hw: Tuple[int, int], device: torch.device,
                      generator: torch.Generator) -> torch.Tensor:
    H, W = hw
    xy = torch.rand(num, 2, generator=generator) * torch.tensor([W * 0.8, H * 0.8])
    wh = torch.rand(num, 2, generator=generator) * torch.tensor([W * 0.2, H * 0.2]) + 4
    return torch.cat([xy, xy + wh], dim=1).to(device)


def roi_head_dummy_forward(roi_head: nn.Module, feats, rois: torch.Tensor,
                           num_mask_rois: int = 100) -> tuple:
    """mmdet 2.x ``forward_dummy`` of a (cascade) RoI head: every bbox stage on all
    ``rois``, every mask stage on the first ``num_mask_rois``."""
    outs = ()
    stages = getattr(roi_head, 'num_stages', None)
    if stages is None:
        if roi_head.with_bbox:
            res = roi_head._bbox_forward(feats, rois)
            outs += (res['cls_score'], res['bbox_pred'])
        if roi_head.with_mask:
            outs += (roi_head._mask_forward(feats, rois[:num_mask_rois])['mask_preds'], )
        return outs
    if roi_head.with_bbox:
        for i in range(stages):
            res = roi_head._bbox_forward(i, feats, rois)
            outs += (res['cls_score'], res['bbox_pred'])
    if roi_head.with_mask:
        for i in range(stages):
            outs += (roi_head._mask_forward(i, feats, rois[:num_mask_rois])['mask_preds'], )
    return outs


def dense_forward(model: nn.Module, inputs: torch.Tensor, num_proposals: int = 1000):
    """Run the inference graph of ``model`` on ``inputs (B, 3, H, W)`` (see module doc).

    Returns whatever the last head returns (tuples of tensors).
    """
    if hasattr(model, 'roi_head') and getattr(model, 'with_rpn', False):
        from mmdet.structures.bbox import bbox2roi
        feats = model.extract_feat(inputs)
        model.rpn_head(feats)
        gen = torch.Generator().manual_seed(0)
        hw = tuple(inputs.shape[-2:])
        proposals = [_random_proposals(num_proposals, hw, inputs.device, gen)
                     for _ in range(inputs.shape[0])]
        return roi_head_dummy_forward(model.roi_head, feats, bbox2roi(proposals))
    if type(model).__module__.startswith('mmdet.'):
        # single-stage and DETR-like detectors: DETRs read the batch shape from the samples
        from mmdet.structures import DetDataSample
        hw = tuple(inputs.shape[-2:])
        samples = [DetDataSample(metainfo=dict(img_shape=hw, pad_shape=hw,
                                               batch_input_shape=hw))
                   for _ in range(inputs.shape[0])]
        return model._forward(inputs, samples)
    if hasattr(model, '_forward'):
        return model._forward(inputs)
    return model(inputs)
