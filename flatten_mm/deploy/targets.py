"""What is exported: a module ``x (B, 3, H, W) -> tuple of tensors`` and its description.

* bare backbone: input the normalised image batch, outputs the backbone's NCHW maps;
* mmseg segmentor: input a float32 RGB 0-255 batch (the config's ``data_preprocessor``
  normalisation is part of the graph), output the decode head's logits
  (``model(x, mode='tensor')``, ``(B, num_classes, H / 4, W / 4)`` for Semantic FPN);
* mmdet detector, same input: single-stage (RetinaNet, ...) the raw head outputs of
  ``mode='tensor'`` (per level ``cls_score`` then per level ``bbox_pred``); two-stage
  (Mask R-CNN, Faster R-CNN: ``RPNHead`` + ``StandardRoIHead``) the whole ``mode='tensor'``
  path: RPN proposals (NMS in the graph) and the RoI heads' ``cls_score``, ``bbox_pred``
  and ``mask_preds`` for every proposal (see ``two_stage``); other two-stage heads
  (cascade, HTC) export backbone + neck + RPN head, and the note says why.
"""
import os.path as osp
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from mmengine.config import Config
from mmengine.runner import load_checkpoint

from ..apis.forward import build_model
from ..models.catalogue import get_backbone_spec
from .two_stage import two_stage_tensor_forward, two_stage_unsupported

_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
#: bundled real image used by ``--check`` (COCO val2017, see demo/data/SOURCES.md)
DEMO_IMAGE = osp.join(_ROOT, 'demo', 'data', 'coco_mini', 'val2017', '000000037777.jpg')
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


@dataclass
class ExportTarget:
    """A module to export and what describes its graph.

    Attributes:
        module: ``x (1, 3, H, W) -> tuple of tensors``, eval mode.
        kind: ``backbone``, ``segmentor`` or ``detector``.
        name: catalogue name or config file.
        input_format: what the graph input is (written to the file's metadata).
        output_names: one name per output tensor.
        min_hw: smallest input the model accepts (``min_input_size()`` of the backbone).
        notes: what of the model is not in the graph, and why.
        instance_key: the outputs whose rows identify instances with a data-dependent
            count and order (two-stage detectors: ``rois``, ``rpn_scores``); checks match
            rows by them (``export.compare_outputs``). ``None``: outputs are compared as
            they are.
    """

    module: nn.Module
    kind: str
    name: str
    input_format: str
    output_names: List[str]
    min_hw: Tuple[int, int] = (1, 1)
    notes: List[str] = field(default_factory=list)
    instance_key: Optional[Tuple[str, ...]] = None

    def example_input(self, hw: Sequence[int]) -> torch.Tensor:
        """The bundled demo image resized to ``hw`` in this target's input format."""
        return load_demo_image(hw, normalize=self.kind == 'backbone')


def load_demo_image(hw: Sequence[int], normalize: bool = False) -> torch.Tensor:
    """``demo/data`` COCO image resized (bilinear) to ``hw``: ``(1, 3, H, W)`` float32 RGB
    0-255, or ImageNet-normalised with ``normalize``."""
    from PIL import Image
    H, W = int(hw[0]), int(hw[1])
    img = Image.open(DEMO_IMAGE).convert('RGB').resize((W, H), Image.BILINEAR)
    x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1)[None]
    if normalize:
        x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(
            IMAGENET_STD).view(1, 3, 1, 1)
    return x.contiguous()


class _Flatten(nn.Module):
    """Flattens nested list / tuple outputs of ``fn(x)`` into one tuple."""

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model = model
        self._fn = fn

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        out = []

        def walk(o):
            if isinstance(o, (list, tuple)):
                for item in o:
                    walk(item)
            else:
                out.append(o)

        walk(self._fn(self.model, x))
        return tuple(out)


class _Normalized(nn.Module):
    """RGB 0-255 input -> the config's ``data_preprocessor`` normalisation -> ``inner``."""

    def __init__(self, inner: nn.Module, mean: torch.Tensor, std: torch.Tensor,
                 to_bgr: bool):
        super().__init__()
        self.inner = inner
        self.register_buffer('mean', mean.reshape(1, 3, 1, 1).float().clone())
        self.register_buffer('std', std.reshape(1, 3, 1, 1).float().clone())
        self.to_bgr = to_bgr

    def forward(self, x: torch.Tensor):
        if self.to_bgr:
            x = x.flip(1)
        return self.inner((x - self.mean) / self.std)


def backbone_target(name: str, model: Optional[nn.Module] = None) -> ExportTarget:
    """A bare backbone: catalogue ``name`` (random weights) or the given ``model``."""
    if model is None:
        model = get_backbone_spec(name).build()
    model = model.eval()
    n = len(model.out_indices) if hasattr(model, 'out_indices') else len(model.out_channels)
    strides = list(getattr(model, 'out_strides', [None] * n))
    names = [f'out{i}_stride{s}' if s else f'out{i}' for i, s in enumerate(strides[:n])]
    min_hw = tuple(model.min_input_size()) if hasattr(model, 'min_input_size') else (1, 1)
    return ExportTarget(
        _Flatten(model, lambda m, x: m(x)), 'backbone', name,
        'float32 (1, 3, H, W), ImageNet-normalised RGB (the tensor the backbone takes)',
        names, min_hw)


def _preprocessor_norm(model: nn.Module) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    dp = model.data_preprocessor
    mean = getattr(dp, 'mean', None)
    std = getattr(dp, 'std', None)
    if mean is None or std is None or not getattr(dp, '_enable_normalize', True):
        mean, std = torch.zeros(3), torch.ones(3)
    swap = bool(getattr(dp, '_channel_conversion', getattr(dp, 'channel_conversion', False)))
    # configs load BGR; with bgr_to_rgb their mean/std are RGB-ordered, so an RGB input is
    # normalised directly; without, the model sees BGR and the RGB input is flipped first
    return mean, std, not swap


def _per_level_names(inner: nn.Module, head: str, min_hw) -> List[str]:
    """``{head}_cls_score_l{i}`` then ``{head}_bbox_pred_l{i}``, counted on a probe run."""
    with torch.no_grad():
        probe = inner(torch.zeros(1, 3, max(64, min_hw[0]), max(64, min_hw[1])))
    n = len(probe) // 2
    if len(probe) != 2 * n:
        return [f'out{i}' for i in range(len(probe))]
    return ([f'{head}_cls_score_l{i}' for i in range(n)] +
            [f'{head}_bbox_pred_l{i}' for i in range(n)])


def _two_stage(model: nn.Module, min_hw) -> Tuple[nn.Module, List[str], str]:
    """The exported part of a two-stage detector, its output names and the note."""
    reason = two_stage_unsupported(model)
    if reason is None:
        names = ['rois', 'rpn_scores']
        if model.roi_head.with_bbox:
            names += ['roi_cls_score', 'roi_bbox_pred']
        if model.roi_head.with_mask:
            names.append('roi_mask_preds')
        cfg = model.rpn_head.test_cfg
        note = ('two-stage detector, whole mode=\'tensor\': backbone, neck, RPN proposals '
                f'(per level top {cfg.get("nms_pre", -1)}, NMS IoU '
                f'{dict(cfg.nms).get("iou_threshold")}, at most {cfg.max_per_img}; '
                'torchvision NMS / RoIAlign in the graph: ONNX NonMaxSuppression / RoiAlign) '
                'as rois (R, 5: image index, x1, y1, x2, y2) and rpn_scores, and the RoI '
                'heads\' raw outputs for every proposal (first dimension R, data-dependent; '
                'masks for the first 100). Box decoding against the rois, the final NMS and '
                'mask pasting are not in the graph')
        return _Flatten(model, two_stage_tensor_forward), names, note
    inner = _Flatten(model, lambda m, x: m.rpn_head(m.extract_feat(x)))
    note = ('two-stage detector: backbone + neck + RPN head are exported (per level RPN '
            f'cls_score, bbox_pred); the proposal NMS and RoI heads are not, because of the '
            f'{reason}')
    return inner, _per_level_names(inner, 'rpn', min_hw), note


def config_target(config, checkpoint: Optional[str] = None,
                  cfg_options: Optional[dict] = None) -> ExportTarget:
    """An mmseg segmentor or mmdet detector built from ``config`` (path or Config),
    with ``checkpoint`` loaded when given (random weights otherwise)."""
    cfg = config if isinstance(config, Config) else Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    scope = cfg.get('default_scope')
    model = build_model(cfg)
    if checkpoint:
        load_checkpoint(model, checkpoint, map_location='cpu')
    model.eval()
    name = osp.basename(getattr(config, 'filename', None) or str(config))
    backbone = model.backbone
    min_hw = tuple(backbone.min_input_size()) if hasattr(backbone, 'min_input_size') else (1, 1)
    mean, std, to_bgr = _preprocessor_norm(model)
    fmt = ('float32 (1, 3, H, W), RGB 0-255 (the config\'s data_preprocessor mean/std '
           'are in the graph; no resize or padding)')
    notes: List[str] = []
    instance_key = None
    if scope == 'mmseg':
        inner = _Flatten(model, lambda m, x: m(x, mode='tensor'))
        names = ['seg_logits']
        kind = 'segmentor'
        notes.append('output: decode-head logits at the head\'s resolution (mode=\'tensor\'); '
                     'resize to the image and argmax outside the graph')
    elif scope == 'mmdet':
        kind = 'detector'
        if getattr(model, 'with_rpn', False) or hasattr(model, 'rpn_head'):
            inner, names, note = _two_stage(model, min_hw)
            notes.append(note)
            instance_key = ('rois', 'rpn_scores') if names[0] == 'rois' else None
        else:
            def fn(m, x):
                return m(x, mode='tensor')
            notes.append('single-stage detector: raw head outputs of mode=\'tensor\' (per level '
                         'cls_score, bbox_pred); anchor decoding and NMS are not in the graph')
            inner = _Flatten(model, fn)
            names = _per_level_names(inner, 'head', min_hw)
    else:
        raise ValueError(f'{name}: default_scope must be mmdet or mmseg, got {scope!r}')
    module = _Normalized(inner, mean, std, to_bgr).eval()
    return ExportTarget(module, kind, name, fmt, names, min_hw, notes, instance_key)
