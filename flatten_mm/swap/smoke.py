"""One training iteration of a (swapped) config on CPU.

What a user wants to know before launching a multi-GPU job: the loss graph of the whole
model runs with the new backbone, every loss is finite, every trainable backbone
parameter receives a gradient (DDP without ``find_unused_parameters`` needs it), and the
config's optimizer (with its ``paramwise_cfg``) builds and steps.

The batch (``data='auto'``) is made of real images and their annotations, loaded by the
config's own train pipeline from its dataset when present, else from the bundled demo
data (``swap_demo``: COCO images for mmdet, ADE20K for mmseg; the pipeline's sizes
scaled to ``input_hw``). When that pipeline cannot run on the demo data (panoptic
annotations absent, fewer classes than the demo labels...), the batch is synthetic,
built for the config's own data preprocessor: ``batch_size`` random uint8 images of
``input_hw`` with a few random boxes, labels and box-shaped masks (``gt_instances``;
plus a semantic map for panoptic models), or a random label map (mmseg ``gt_sem_seg``,
some pixels ignored). ``SmokeReport.batch`` says which was used and why. The
preprocessor's fixed sizes (mmseg ``size``, mmdet ``BatchFixedSizePad``) are set to
``input_hw``, random multi-scale batch resizing (YOLOX / RTMDet) is left out, SyncBN
runs as BatchNorm and ``AmpOptimWrapper`` as ``OptimWrapper`` (CPU).
"""
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np
import torch
from mmengine.config import Config
from mmengine.logging import MessageHub, MMLogger
from mmengine.model import revert_sync_batchnorm
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope
from mmengine.structures import InstanceData, PixelData

from ..apis.forward import build_model
from .demo import DemoUnavailable, demo_batch


@dataclass
class SmokeReport:
    """Outcome of ``train_smoke``.

    Attributes:
        losses: every logged loss of the iteration (``loss`` is their sum).
        backbone_params: trainable backbone parameter tensors.
        frozen: backbone parameter tensors with ``requires_grad=False``.
        no_grad: trainable backbone parameters that received no gradient.
        nonfinite: parameters (any part of the model) whose gradient is not finite.
        seconds: wall time of the forward + backward + step.
        notes: what was changed for the CPU run.
        batch: which batch was used (``'demo: ...'`` / ``'dataset: ...'`` real images
            through the train pipeline, or ``'synthetic: <why>'``).
    """

    losses: Dict[str, float]
    backbone_params: int
    frozen: int
    no_grad: List[str]
    nonfinite: List[str]
    seconds: float
    notes: List[str] = field(default_factory=list)
    batch: str = ''

    @property
    def failures(self) -> List[str]:
        """Why the iteration is not one a training job can start from (empty when ``ok``):
        non-finite losses, trainable backbone parameters without a gradient, non-finite
        gradients."""
        out = []
        bad = [k for k, v in self.losses.items() if not math.isfinite(v)]
        if bad:
            out.append('non-finite losses: ' + ', '.join(bad))
        if self.no_grad:
            out.append(f'{len(self.no_grad)} trainable backbone parameter tensors received no '
                       'gradient: ' + ', '.join(self.no_grad[:5])
                       + (' ...' if len(self.no_grad) > 5 else ''))
        if self.nonfinite:
            out.append(f'{len(self.nonfinite)} parameter tensors have a non-finite gradient: '
                       + ', '.join(self.nonfinite[:5]) + (' ...' if len(self.nonfinite) > 5 else ''))
        return out

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        loss = ', '.join(f'{k}={v:.4g}' for k, v in self.losses.items())
        lines = [f'train smoke: one iteration in {self.seconds:.1f}s; {loss}',
                 f'batch: {self.batch}',
                 f'backbone: {self.backbone_params - len(self.no_grad)} of '
                 f'{self.backbone_params} trainable parameter tensors received a gradient'
                 + (f' ({self.frozen} frozen)' if self.frozen else '')]
        if self.no_grad:
            lines.append('  no gradient: ' + ', '.join(self.no_grad[:10])
                         + (' ...' if len(self.no_grad) > 10 else ''))
        if self.nonfinite:
            lines.append('  non-finite gradient: ' + ', '.join(self.nonfinite[:10]))
        bad = [k for k, v in self.losses.items() if not math.isfinite(v)]
        if bad:
            lines.append('  non-finite losses: ' + ', '.join(bad))
        lines += [f'  ({n})' for n in self.notes]
        return '\n'.join(lines)


def fewer_rois(train_cfg, notes: List[str]) -> None:
    """Fewer RPN proposals (64) and sampled RoIs (32 per stage): CPU time; every head
    still trains."""
    if not train_cfg:
        return
    changed = False
    if train_cfg.get('rpn_proposal'):
        train_cfg.rpn_proposal.update(nms_pre=200, max_per_img=64)
        changed = True
    rcnn = train_cfg.get('rcnn')
    for stage in rcnn if isinstance(rcnn, (list, tuple)) else [rcnn] if rcnn else []:
        if isinstance(stage, dict) and stage.get('sampler') and 'num' in stage.sampler:
            stage.sampler.num = 32
            changed = True
    if changed:
        notes.append('fewer RPN proposals (64) and sampled RoIs (32)')


def mmsyncbn_as_bn(obj, notes: List[str] = None) -> None:
    """Replace mmcv's ``MMSyncBN`` (which needs a process group to be built) by ``BN``
    in a model config, in place (torch's ``SyncBN`` builds anywhere and is reverted
    after the build)."""
    found = []

    def walk(o):
        if isinstance(o, dict):
            if o.get('type') == 'MMSyncBN':
                o['type'] = 'BN'
                found.append(1)
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    if found and notes is not None:
        notes.append('MMSyncBN built as BN (no process group on one CPU)')


def _smoke_model_cfg(cfg: Config, input_hw: Tuple[int, int], notes: List[str],
                     few_rois: bool = False) -> Config:
    cfg = copy.deepcopy(cfg)
    mmsyncbn_as_bn(cfg.model, notes)
    if few_rois:
        fewer_rois(cfg.model.get('train_cfg'), notes)
    prep = cfg.model.get('data_preprocessor')
    if isinstance(prep, dict):
        if prep.get('size') is not None:
            notes.append(f'data_preprocessor.size {tuple(prep["size"])} -> {input_hw}')
            prep['size'] = input_hw
        augments = prep.get('batch_augments') or []
        kept = []
        for aug in augments:
            if 'size' in aug:
                aug = dict(aug, size=input_hw)
                kept.append(aug)
            else:
                notes.append(f'batch augment {aug.get("type")} left out')
        if augments:
            prep['batch_augments'] = kept or None
    return cfg


def _num_classes(model_cfg) -> Tuple[int, int]:
    """(thing classes, stuff classes) read from the heads of the model config."""
    def find(obj, key):
        if isinstance(obj, dict):
            if isinstance(obj.get(key), int):
                return obj[key]
            for v in obj.values():
                r = find(v, key)
                if r is not None:
                    return r
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                r = find(v, key)
                if r is not None:
                    return r
        return None

    things = find(model_cfg, 'num_things_classes')
    if things is not None:
        return things, find(model_cfg, 'num_stuff_classes') or 0
    return find(model_cfg, 'num_classes') or 1, 0


def synthetic_batch(scope: str, model_cfg, input_hw: Tuple[int, int], batch_size: int = 2,
                    num_objects: int = 3, seed: int = 0) -> dict:
    """A ``dict(inputs=[...], data_samples=[...])`` batch as a dataloader would give it.

    Args:
        scope: ``'mmdet'`` or ``'mmseg'``.
        model_cfg: the model config (class counts are read from its heads).
        input_hw: image size ``(H, W)``.

    Returns:
        ``inputs``: ``batch_size`` uint8 tensors ``(3, H, W)``; ``data_samples``:
        ``DetDataSample`` with ``gt_instances`` (``bboxes (N, 4)``, ``labels (N,)``,
        ``masks`` BitmapMasks ``(N, H, W)``) and ``gt_sem_seg (1, H, W)``, or
        ``SegDataSample`` with ``gt_sem_seg (1, H, W)``.
    """
    if scope == 'mmdet' and isinstance(model_cfg.get('track_head'), dict):
        return synthetic_clips(model_cfg, input_hw, batch_size, num_objects, seed)
    g = torch.Generator().manual_seed(seed)
    H, W = input_hw
    things, stuff = _num_classes(model_cfg)
    meta = dict(img_shape=(H, W), ori_shape=(H, W), pad_shape=(H, W), scale_factor=(1., 1.),
                flip=False, flip_direction=None, img_path='', img_id=0)
    inputs, samples = [], []
    for _ in range(batch_size):
        inputs.append(torch.randint(0, 256, (3, H, W), generator=g, dtype=torch.uint8))
        if scope == 'mmseg':
            from mmseg.structures import SegDataSample
            seg = torch.randint(0, things, (1, H, W), generator=g)
            seg[:, :H // 8] = 255  # some ignored pixels
            sample = SegDataSample(metainfo=dict(meta))
            sample.gt_sem_seg = PixelData(data=seg)
            samples.append(sample)
            continue
        from mmdet.structures import DetDataSample
        from mmdet.structures.mask import BitmapMasks
        xy = torch.rand(num_objects, 2, generator=g) * torch.tensor([W * 0.5, H * 0.5])
        wh = (torch.rand(num_objects, 2, generator=g) * 0.3 + 0.15) * torch.tensor([W, H])
        boxes = torch.cat([xy, xy + wh], 1).round()
        masks = np.zeros((num_objects, H, W), dtype=np.uint8)
        for i, (x1, y1, x2, y2) in enumerate(boxes.long().tolist()):
            masks[i, y1:y2, x1:x2] = 1
        labels = torch.randint(0, things, (num_objects, ), generator=g)
        sample = DetDataSample(metainfo=dict(meta))
        sample.gt_instances = InstanceData(bboxes=boxes, labels=labels,
                                           masks=BitmapMasks(masks, H, W))
        sample.ignored_instances = InstanceData(bboxes=torch.zeros(0, 4),
                                                labels=torch.zeros(0, dtype=torch.long))
        sem = torch.full((1, H, W), 255, dtype=torch.long)
        if stuff:
            sem[:, H // 2:] = things + torch.randint(0, stuff, (1, ), generator=g)
        for i in range(num_objects):
            sem[0][torch.from_numpy(masks[i]).bool()] = labels[i]
        sample.gt_sem_seg = PixelData(sem_seg=sem)
        samples.append(sample)
    return dict(inputs=inputs, data_samples=samples)


def synthetic_clips(model_cfg, input_hw: Tuple[int, int], batch_size: int = 2,
                    num_objects: int = 3, seed: int = 0) -> dict:
    """A video batch for a clip model (Mask2Former VIS, ``TrackDataPreprocessor``):
    ``batch_size`` clips of ``track_head.num_frames`` random uint8 frames ``(T, 3, H, W)``,
    each a ``TrackDataSample`` whose frames carry the same ``num_objects`` instances
    (``instances_ids`` 0..n-1; boxes moved by a few pixels per frame, box-shaped masks)."""
    from mmdet.structures import DetDataSample, TrackDataSample
    from mmdet.structures.mask import BitmapMasks
    g = torch.Generator().manual_seed(seed)
    H, W = input_hw
    frames = model_cfg['track_head'].get('num_frames', 2)
    things, _ = _num_classes(model_cfg)
    inputs, samples = [], []
    for _ in range(batch_size):
        inputs.append(torch.randint(0, 256, (frames, 3, H, W), generator=g,
                                    dtype=torch.uint8))
        xy = torch.rand(num_objects, 2, generator=g) * torch.tensor([W * 0.5, H * 0.5])
        wh = (torch.rand(num_objects, 2, generator=g) * 0.3 + 0.15) * torch.tensor([W, H])
        labels = torch.randint(0, things, (num_objects, ), generator=g)
        video = []
        for t in range(frames):
            boxes = (torch.cat([xy, xy + wh], 1) + 2 * t).clamp(max=min(H, W) - 1).round()
            masks = np.zeros((num_objects, H, W), dtype=np.uint8)
            for i, (x1, y1, x2, y2) in enumerate(boxes.long().tolist()):
                masks[i, y1:y2, x1:x2] = 1
            frame = DetDataSample(metainfo=dict(
                img_shape=(H, W), ori_shape=(H, W), pad_shape=(H, W), scale_factor=(1., 1.),
                flip=False, flip_direction=None, img_path='', img_id=t, frame_id=t,
                video_length=frames))
            frame.gt_instances = InstanceData(
                bboxes=boxes, labels=labels.clone(), masks=BitmapMasks(masks, H, W),
                instances_ids=torch.arange(num_objects))
            video.append(frame)
        samples.append(TrackDataSample(video_data_samples=video,
                                       metainfo=dict(video_length=frames)))
    return dict(inputs=inputs, data_samples=samples)


def train_smoke(path_or_cfg, input_hw: Tuple[int, int] = (256, 256), batch_size: int = 2,
                seed: int = 0, step: bool = True, data: str = 'auto',
                few_rois: bool = False) -> SmokeReport:
    """Run one training iteration of a config on CPU (see the module docstring).

    Args:
        path_or_cfg: config file or ``Config``.
        input_hw: image size; a multiple of 32 keeps the mmdet preprocessor from padding.
        step: also build the config's optimizer and take one step.
        data: ``'auto'`` (real images through the train pipeline: the config's dataset
            when present, else the demo data; synthetic when that cannot run),
            ``'real'`` (the same, but an error instead of the synthetic fallback) or
            ``'synthetic'``.
        few_rois: sample fewer RPN proposals / RoIs (``fewer_rois``; CPU time).

    Returns:
        SmokeReport (check ``.ok``; ``.batch`` says which batch was used).

    Raises:
        DemoUnavailable: ``data='real'`` and the pipeline cannot run here.
    """
    if data not in ('auto', 'real', 'synthetic'):
        raise ValueError(f"data must be 'auto', 'real' or 'synthetic', got {data!r}")
    cfg = path_or_cfg if isinstance(path_or_cfg, Config) else Config.fromfile(path_or_cfg)
    scope = cfg.get('default_scope')
    notes: List[str] = []
    cfg = _smoke_model_cfg(cfg, input_hw, notes, few_rois)
    torch.manual_seed(seed)
    model = revert_sync_batchnorm(build_model(cfg, init_weights=True)).train()
    batch = None
    roi = cfg.model.get('roi_head') or {}
    if data == 'synthetic':
        used = 'synthetic: requested'
    elif scope == 'mmdet' and isinstance(roi, dict) and roi.get('semantic_head'):
        # HTC / SCNet: the semantic head needs COCO-stuff label maps
        msg = (f'the RoI head has a semantic head ({roi["semantic_head"].get("type")}), '
               'which needs stuff label maps; the demo data has instance annotations only')
        if data == 'real':
            raise DemoUnavailable(msg)
        used = f'synthetic: {msg}'
    else:
        things, _ = _num_classes(cfg.model)
        try:
            batch, desc = demo_batch(cfg, input_hw, batch_size, num_classes=things,
                                     seed=seed)
            used = ('demo: ' if 'demo data' in desc else 'dataset: ') + desc
        except DemoUnavailable as exc:
            if data == 'real':
                raise
            used = f'synthetic: {exc}'
    if batch is None:
        batch = synthetic_batch(scope, cfg.model, input_hw, batch_size, seed=seed)
    if getattr(model, 'roi_head', None) is not None and not getattr(model, 'with_rpn', True):
        _random_proposals(batch, seed, notes)
    _runner_info(cfg)
    t0 = time.perf_counter()
    wrapper = (_build_optim_wrapper(model, cfg, notes)
               if step and cfg.get('optim_wrapper') is not None else None)
    data_ = model.data_preprocessor(batch, True)
    losses = model(**data_, mode='loss')
    loss, log_vars = model.parse_losses(losses)
    loss.backward()
    named = dict(model.named_parameters())
    nonfinite = [n for n, p in named.items()
                 if p.grad is not None and not torch.isfinite(p.grad).all()]
    trainable = [(n, p) for n, p in model.backbone.named_parameters() if p.requires_grad]
    frozen = sum(1 for p in model.backbone.parameters() if not p.requires_grad)
    no_grad = [f'backbone.{n}' for n, p in trainable if p.grad is None]
    if wrapper is not None:
        wrapper.step()
        wrapper.zero_grad()
    seconds = time.perf_counter() - t0
    return SmokeReport({k: float(torch.as_tensor(v).detach()) for k, v in log_vars.items()},
                       len(trainable), frozen,
                       no_grad, nonfinite, seconds, notes, used)


def _random_proposals(batch: dict, seed: int, notes: List[str], num: int = 64) -> None:
    """Give each sample ``num`` random ``proposals`` (a Fast R-CNN without RPN reads
    precomputed ones, which neither the demo data nor the synthetic batch has)."""
    g = torch.Generator().manual_seed(seed)
    for sample in batch['data_samples']:
        if sample.get('proposals') is not None:
            continue
        h, w = sample.img_shape[:2]
        xy = torch.rand(num, 2, generator=g) * torch.tensor([w * 0.7, h * 0.7])
        wh = (torch.rand(num, 2, generator=g) * 0.3 + 0.05) * torch.tensor([w, h])
        sample.proposals = InstanceData(bboxes=torch.cat([xy, xy + wh], 1),
                                        scores=torch.rand(num, generator=g))
    notes.append(f'{num} random proposals per image (Fast R-CNN without RPN)')


def _runner_info(cfg: Config) -> None:
    """What mmengine's Runner puts in the message hub before the first iteration
    (TOOD's head reads ``epoch``; other heads read ``iter`` / ``max_iters``)."""
    hub = MessageHub.get_current_instance()
    hub.update_info('epoch', 0)
    hub.update_info('iter', 0)
    train_cfg = cfg.get('train_cfg') or {}
    if train_cfg.get('max_epochs') is not None:
        hub.update_info('max_epochs', train_cfg['max_epochs'])
    if train_cfg.get('max_iters') is not None:
        hub.update_info('max_iters', train_cfg['max_iters'])


def _build_optim_wrapper(model, cfg: Config, notes: List[str]):
    """The config's optimizer wrapper, built before the first forward as mmengine's
    Runner does (some models, e.g. DDQ-DETR, share modules only after a forward)."""
    wrapper_cfg = copy.deepcopy(cfg.optim_wrapper)
    if wrapper_cfg.get('type') == 'AmpOptimWrapper' and not torch.cuda.is_available():
        wrapper_cfg['type'] = 'OptimWrapper'
        for key in ('loss_scale', 'dtype'):
            wrapper_cfg.pop(key, None)
        notes.append('AmpOptimWrapper run as OptimWrapper (CPU)')
    init_default_scope(cfg.get('default_scope'))
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel('WARNING')  # no per-parameter paramwise_options listing
    try:
        wrapper = build_optim_wrapper(model, wrapper_cfg)
    finally:
        logger.setLevel(level)
    return wrapper

