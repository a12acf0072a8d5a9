"""Training-step suite: forward + backward + optimizer step, ours against the softmax
counterparts, eager and ``torch.compile``, fp32 or under autocast.

One **step** of a backbone: the forward (under ``torch.autocast(device_type, dtype)`` with
``amp``), the loss (``output_loss``: every output map, weighted by a fixed ramp over its
channels, averaged), ``loss.backward()``, ``AdamW.step()``, ``zero_grad(set_to_none=True)``
(the order of mmengine's ``OptimWrapper.update_params``: no gradient outlives its step, so
the peak memory of a step includes the gradients). A ``forward`` step is the inference
forward of the same model under ``torch.no_grad()`` (eval mode), so forward and training
rows come from one code path. Of a whole detector / segmentor built from a config
(``WHOLE_MODEL_PAIRS``): ``model(mode='loss')`` on a synthetic batch
(``swap_smoke.synthetic_batch``: random images, boxes, masks or label maps; put through
the data preprocessor once, outside the step), ``parse_losses``, backward, AdamW step,
``zero_grad``.

Every case of a group (ours and its baselines at one resolution, each eager and, with
``compile_backend``, compiled) alternates round-robin in one process
(``timing.measure_alternating``), so ratios are taken inside one run. Peak memory of a
step (``peak_mem_mb``): CUDA, the caching allocator's peak during one step above what was
allocated before it (parameters and AdamW state are outside; activations, gradients and
the workspace of the step inside); CPU, the running peak of the allocations recorded by
the PyTorch profiler during the step (same definition, counted from the allocation
events instead of the allocator).
"""
import copy
import functools
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .cases import BACKBONE_PAIRS, backbone_cases, quick_pairs, ratio_rows
from .timing import _row, measure_alternating, peak_memory_bytes

#: execution modes of the suite
EXECS = ('eager', 'compile')
#: step kinds of the suite
STEPS = ('forward', 'train')
#: default input sizes ``(H, W)`` of the training suite (issue #13: detection sizes)
TRAIN_RESOLUTIONS = ((512, 512), (1024, 1024), (800, 1344))

#: whole models: name -> (config of ours, {baseline name: backbone dict replacing ours})
WHOLE_MODEL_PAIRS: Dict[str, Tuple[str, Dict[str, dict]]] = {
    'mask-rcnn flatten-pvt-v2-b0': (
        'configs/mmdet/flatten_pvt_v2/mask-rcnn_flatten-pvt-v2-b0_fpn_1x_coco.py',
        {'mask-rcnn pvt-v2-b0 (mmdet)': dict(type='mmdet.PyramidVisionTransformerV2',
                                             embed_dims=32, num_layers=[2, 2, 2, 2])}),
    'upernet flatten-swin-t': (
        'configs/mmseg/flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py',
        {'upernet swin-t (mmseg)': dict(type='mmseg.SwinTransformer', embed_dims=96,
                                        depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                                        window_size=7, drop_path_rate=0.3)}),
}
#: the tiny whole model of ``quick`` runs (CPU tests): 4 stages of 8-64 channels
QUICK_WHOLE_MODEL = 'mask-rcnn flatten-pvt-v2-tiny'
_QUICK_OURS = dict(type='flatten_mm.FLattenPVTv2', drop_path_rate=0., init_cfg=None,
                   arch=dict(embed_dims=(8, 16, 32, 64), depths=(1, 1, 1, 1),
                             num_heads=(1, 2, 4, 8), mlp_ratios=(2, 2, 2, 2)))
_QUICK_BASE = dict(type='mmdet.PyramidVisionTransformerV2', embed_dims=8,
                   num_layers=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], mlp_ratios=(2, 2, 2, 2))


def output_tensors(out: Any) -> List[torch.Tensor]:
    """Every tensor of a (nested) tuple / list / dict of backbone outputs."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in output_tensors(o)]
    return []


def output_loss(out: Any) -> torch.Tensor:
    """The training suite's loss: ``sum(mean(o.float() * w))`` over every output tensor,
    ``w`` a ramp from -1 to 1 over the channels (dim 1 of ``(B, C, H, W)`` maps, the last
    dim otherwise).

    A plain mean would not do: the mean (and mean square) over the channels of a
    LayerNorm-ed output is a constant at initialisation, which leaves every parameter
    before the output norms without gradient.
    """
    tensors = output_tensors(out)
    if not tensors:
        raise ValueError(f'the model returned no tensor to build a loss from: {type(out)}')
    loss = 0.
    for t in tensors:
        dim = 1 if t.dim() == 4 else t.dim() - 1
        shape = [1] * t.dim()
        shape[dim] = t.shape[dim]
        w = torch.linspace(-1., 1., t.shape[dim], device=t.device).view(shape)
        loss = loss + (t.float() * w).mean()
    return loss


def amp_label(amp: Optional[torch.dtype]) -> str:
    """``'fp32'`` (no autocast), ``'bf16'``, ``'fp16'``: the tool's ``--amp`` names."""
    labels = {None: 'fp32', torch.float32: 'fp32', torch.bfloat16: 'bf16',
              torch.float16: 'fp16'}
    return labels.get(amp, str(amp).replace('torch.', ''))


def _autocast(device: torch.device, amp: Optional[torch.dtype]):
    if amp is None or amp == torch.float32:
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=amp)


def make_optimizer(model: nn.Module, lr: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (``weight_decay=0.05``, the recipes' value)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f'{type(model).__name__} has no trainable parameter')
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.05)


def backbone_step(model: nn.Module, run: Callable[[torch.Tensor], Any], x: torch.Tensor,
                  step: str = 'train', amp: Optional[torch.dtype] = None,
                  optimizer: Optional[torch.optim.Optimizer] = None) -> Callable[[], Any]:
    """A zero-argument callable doing one ``step`` of a backbone.

    Args:
        model: the backbone (put in train mode for ``'train'``, eval for ``'forward'``).
        run: ``x -> outputs`` (e.g. ``model`` itself, timm's ``forward_intermediates``,
            or a ``torch.compile`` of either).
        x: input ``(B, 3, H, W)``.
        step: ``'train'`` (forward, loss, backward, optimizer step, zero_grad) or
            ``'forward'`` (inference forward under ``no_grad``).
        amp: autocast dtype (``None`` / float32: no autocast).
        optimizer: for ``'train'`` (default: ``make_optimizer(model)``).

    Returns:
        The callable; ``'train'`` returns the loss (detached), ``'forward'`` the outputs.
    """
    if step not in STEPS:
        raise ValueError(f'step must be one of {STEPS}, got {step!r}')
    device = x.device
    if step == 'forward':
        model.eval()

        def forward():
            with torch.no_grad(), _autocast(device, amp):
                return run(x)
        return forward
    model.train()
    opt = optimizer if optimizer is not None else make_optimizer(model)

    def train():
        with _autocast(device, amp):
            out = run(x)
        loss = output_loss(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return train


def _compile(fn: Callable, backend: str) -> Callable:
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(fn, backend=backend)


def kernels_setting() -> str:
    """What ``FLATTEN_MM_TRITON`` says for this process (``''`` when unset)."""
    return os.environ.get('FLATTEN_MM_TRITON', '')


def run_step_benchmark(pairs: Optional[Dict[str, Sequence[str]]] = None,
                       resolutions: Sequence[Tuple[int, int]] = TRAIN_RESOLUTIONS,
                       batch: int = 8,
                       device: str = 'cpu',
                       amp: Optional[torch.dtype] = None,
                       steps: Sequence[str] = ('train', ),
                       execs: Sequence[str] = ('eager', ),
                       compile_backend: str = 'inductor',
                       warmup: int = 2,
                       repeats: int = 5,
                       memory: bool = True,
                       quick: bool = False,
                       log: Optional[Callable[[str], None]] = None) -> List[Dict[str, Any]]:
    """Backbone step suite: per family, resolution and step kind, ours and its baselines
    (each in every ``execs`` mode) alternate in one process.

    Args:
        pairs: ours -> baselines (default ``BACKBONE_PAIRS``; ``quick_pairs()`` with
            ``quick``); baselines not installed here are left out.
        resolutions: input sizes ``(H, W)``.
        batch: images per step.
        device: ``'cpu'`` or ``'cuda'``.
        amp: autocast dtype (e.g. ``torch.bfloat16``); weights stay float32.
        steps: ``'train'`` and / or ``'forward'``.
        execs: ``'eager'`` and / or ``'compile'`` (``torch.compile(backend=
            compile_backend)`` of the model's call; compiled during warm-up).
        warmup: untimed rounds (at least 1: AdamW allocates its state in the first step).
        repeats: timed rounds.
        memory: also measure the peak memory of one step.
        quick: tiny architectures (see ``cases.backbone_cases``).
        log: optional progress callback.

    Returns:
        One row per (model, exec, step, resolution): ``suite`` ``'step'``, ``step``,
        ``exec``, ``amp``, ``kernels`` (``FLATTEN_MM_TRITON``), ``group``, ``median_ms``,
        ``min_ms``, ``cpu_ms``, ``images_per_s``, ``peak_mem_mb``, ``note`` on failures.
        ``step_ratio_rows`` pairs them.
    """
    for s in steps:
        if s not in STEPS:
            raise ValueError(f'unknown step {s!r}; available: {STEPS}')
    for e in execs:
        if e not in EXECS:
            raise ValueError(f'unknown exec {e!r}; available: {EXECS}')
    device_ = torch.device(device)
    available = backbone_cases(quick)
    if pairs is None:
        pairs = quick_pairs() if quick else BACKBONE_PAIRS
    amp_name = amp_label(amp)
    rows: List[Dict[str, Any]] = []
    for ours, baselines in pairs.items():
        names = [ours] + [b for b in baselines if b in available]
        for step in steps:
            for hw in resolutions:
                torch.manual_seed(0)
                x = torch.randn(batch, 3, *hw, device=device_)
                cases, errors, keys = {}, {}, []
                for name in names:
                    for ex in execs:
                        key = f'{name} [{ex}]'
                        keys.append((name, ex, key))
                        try:
                            torch.manual_seed(0)
                            model = available[name].build(tuple(hw)).to(device_)
                            run = functools.partial(available[name].run, model)
                            if ex == 'compile':
                                run = _compile(run, compile_backend)
                            cases[key] = backbone_step(model, run, x, step, amp)
                        except Exception as err:  # noqa: BLE001 - reported in the table
                            errors[key] = f'error: {type(err).__name__}: {str(err)[:200]}'
                # a failing first step (or compilation) is reported, not fatal
                for key in list(cases):
                    try:
                        cases[key]()
                    except Exception as err:  # noqa: BLE001
                        errors[key] = f'error: {type(err).__name__}: {str(err)[:200]}'
                        del cases[key]
                if log is not None:
                    log(f'{step} {hw[0]}x{hw[1]} {amp_name}: {", ".join(cases)}')
                timings = measure_alternating(cases, device_, max(0, warmup - 1), repeats,
                                              grad=step == 'train')
                for name, ex, key in keys:
                    extra = dict(height=hw[0], width=hw[1], tokens=hw[0] * hw[1],
                                 group=f'{ours}@{hw[0]}x{hw[1]}/{step}/{ex}', step=step,
                                 exec=ex, amp=amp_name, kernels=kernels_setting(),
                                 source=available[name].source)
                    rows.append(_measured_row('step', name, key, cases, timings, errors,
                                              device_, batch, memory, step == 'train',
                                              extra))
                del cases
                if device_.type == 'cuda':
                    torch.cuda.empty_cache()
    return rows


def _measured_row(suite: str, name: str, key: str, cases: Dict[str, Callable],
                  timings: Dict[str, Any], errors: Dict[str, str], device_: torch.device,
                  batch: int, memory: bool, grad: bool,
                  extra: Dict[str, Any]) -> Dict[str, Any]:
    """The row of case ``key`` (model ``name``): its timing and peak memory, or the
    error that kept it from running (``note``)."""
    if key not in cases:
        return _row(suite, name, None, device_, torch.float32, batch,
                    note=errors.get(key, 'not run'), **extra)
    row = _row(suite, name, timings[key], device_, torch.float32, batch, **extra)
    if memory:
        peak = peak_memory_bytes(cases[key], device_, grad=grad)
        row['peak_mem_mb'] = None if peak is None else peak / 2**20
    row['_wall'] = list(timings[key].wall)
    return row


def step_ratio_rows(rows: Sequence[Dict[str, Any]],
                    pairs: Optional[Dict[str, Sequence[str]]] = None,
                    suite: str = 'step') -> List[Dict[str, Any]]:
    """Ours / baseline ratios of the step suites (``cases.ratio_rows`` on ``suite`` rows;
    every ratio row carries ``step``, ``exec``, ``amp``, ``kernels``, ``batch``)."""
    return ratio_rows(rows, pairs, suite=suite)


# --------------------------------------------------------------------------- whole models
def _root() -> str:
    """The checkout (``benchmarks/core/`` is two folders below it)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def whole_model_configs(quick: bool = False) -> Dict[str, Tuple[Any, Dict[str, Any]]]:
    """``name -> (Config of ours, {baseline name: Config})`` of ``WHOLE_MODEL_PAIRS``
    (``quick``: a Mask R-CNN with 8-64-channel FLatten-PVTv2 / mmdet PVTv2 backbones,
    32 RPN proposals and 16 sampled RoIs per image).

    Backbone ``init_cfg`` is dropped (no checkpoint is read); baselines replace the
    backbone dict of ours whole, so neck and heads are identical.
    """
    from mmengine.config import Config, ConfigDict
    out = {}
    if quick:
        path, base = WHOLE_MODEL_PAIRS['mask-rcnn flatten-pvt-v2-b0']
        cfg = Config.fromfile(os.path.join(_root(), path))
        cfg.model.backbone = ConfigDict(_QUICK_OURS)
        cfg.model.neck.in_channels = [8, 16, 32, 64]
        # fewer RPN proposals and sampled RoIs (CPU time; every head still trains)
        cfg.model.train_cfg.rpn_proposal.update(nms_pre=100, max_per_img=32)
        cfg.model.train_cfg.rcnn.sampler.num = 16
        b = copy.deepcopy(cfg)
        b.model.backbone = ConfigDict(_QUICK_BASE)
        return {QUICK_WHOLE_MODEL: (cfg, {'mask-rcnn pvt-v2-tiny (mmdet)': b})}
    for name, (path, baselines) in WHOLE_MODEL_PAIRS.items():
        cfg = Config.fromfile(os.path.join(_root(), path))
        cfg.model.backbone.init_cfg = None
        cfg.model.backbone.drop_path_rate = 0.
        bases = {}
        for bname, backbone in baselines.items():
            b = copy.deepcopy(cfg)
            b.model.backbone = ConfigDict(dict(backbone, init_cfg=None, drop_path_rate=0.))
            bases[bname] = b
        out[name] = (cfg, bases)
    return out


def whole_model_step(cfg, input_hw: Tuple[int, int], batch: int, device: torch.device,
                     amp: Optional[torch.dtype] = None, seed: int = 0
                     ) -> Tuple[nn.Module, Callable[[], torch.Tensor]]:
    """Build ``cfg.model`` (SyncBN as BatchNorm) and a callable doing one training step on
    a synthetic batch of ``batch`` images of ``input_hw``.

    Returns:
        ``(model, step)``; ``step()`` returns the summed loss (detached).
    """
    from mmengine.model import revert_sync_batchnorm

    from flatten_mm.apis.forward import build_model
    from flatten_mm.swap.smoke import _smoke_model_cfg, synthetic_batch
    notes: List[str] = []
    cfg = _smoke_model_cfg(cfg, input_hw, notes)
    torch.manual_seed(seed)
    model = revert_sync_batchnorm(build_model(cfg)).to(device).train()
    batch_data = synthetic_batch(cfg.get('default_scope'), cfg.model, input_hw, batch,
                                 seed=seed)
    data = model.data_preprocessor(batch_data, True)  # moved to the model's device
    opt = make_optimizer(model)

    def train():
        with _autocast(device, amp):
            losses = model(**data, mode='loss')
        loss, _ = model.parse_losses(losses)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return model, train


def run_whole_model_benchmark(input_hws: Sequence[Tuple[int, int]] = ((512, 512), ),
                              batch: int = 2,
                              device: str = 'cpu',
                              amp: Optional[torch.dtype] = None,
                              names: Optional[Sequence[str]] = None,
                              warmup: int = 2,
                              repeats: int = 5,
                              memory: bool = True,
                              quick: bool = False,
                              log: Optional[Callable[[str], None]] = None
                              ) -> List[Dict[str, Any]]:
    """Training steps of whole detectors / segmentors, ours against the same config with
    the baseline backbone, alternating in one process (suite ``'model_step'``).

    Needs mmdet / mmseg with mmcv's ops on ``device`` (RoIAlign, ...): a model whose
    build or first step fails gets a row with the error in ``note`` (e.g. UperNet at
    batch 1: the batch norm after its 1x1 pyramid pooling needs 2 images, as in mmseg).

    Args:
        input_hws: image sizes.
        batch: images per step.
        device: ``'cpu'`` or ``'cuda'``.
        amp: autocast dtype or ``None``.
        names: subset of ``WHOLE_MODEL_PAIRS`` (default all; ignored with ``quick``).
        warmup, repeats, memory, quick, log: as ``run_step_benchmark``.

    Returns:
        Rows like ``run_step_benchmark``'s (``step='train'``, ``exec='eager'``).
    """
    device_ = torch.device(device)
    amp_name = amp_label(amp)
    configs = whole_model_configs(quick)
    if names and not quick:
        unknown = [n for n in names if n not in configs]
        if unknown:
            raise ValueError(f'unknown whole models {unknown}; available: {list(configs)}')
        configs = {n: configs[n] for n in names}
    rows: List[Dict[str, Any]] = []
    for ours, (cfg, bases) in configs.items():
        members = dict({ours: cfg}, **bases)
        for hw in input_hws:
            cases, errors = {}, {}
            for name, c in members.items():
                try:
                    _, fn = whole_model_step(c, tuple(hw), batch, device_, amp)
                    fn()  # first step: builds AdamW state, reports errors here
                    cases[name] = fn
                except Exception as err:  # noqa: BLE001 - reported in the table
                    errors[name] = f'error: {type(err).__name__}: {str(err)[:200]}'
            if log is not None:
                log(f'model train {hw[0]}x{hw[1]} {amp_name}: {", ".join(cases)}')
            timings = measure_alternating(cases, device_, max(0, warmup - 1), repeats,
                                          grad=True)
            for name in members:
                extra = dict(height=hw[0], width=hw[1], tokens=hw[0] * hw[1],
                             group=f'{ours}@{hw[0]}x{hw[1]}/train/eager', step='train',
                             exec='eager', amp=amp_name, kernels=kernels_setting(),
                             source='config')
                rows.append(_measured_row('model_step', name, name, cases, timings, errors,
                                          device_, batch, memory, True, extra))
            del cases
            if device_.type == 'cuda':
                torch.cuda.empty_cache()
    return rows


def whole_model_pairs(quick: bool = False) -> Dict[str, Tuple[str, ...]]:
    """``ours -> baselines`` names of the whole-model suite (for ``step_ratio_rows``)."""
    if quick:
        return {QUICK_WHOLE_MODEL: ('mask-rcnn pvt-v2-tiny (mmdet)', )}
    return {k: tuple(v[1]) for k, v in WHOLE_MODEL_PAIRS.items()}


# --------------------------------------------------------------------------- classifiers
#: ImageNet classifiers (pretraining cost): ours (configs/mmpretrain) -> {baseline: config}.
#: The softmax counterparts are mmpretrain's own Swin-T and XCiT-S12/16 configs, and for
#: the PVTv2-based models the plain PVTv2-b0 classifier of configs/mmpretrain (softmax
#: spatial-reduction attention in the same skeleton; mmpretrain has no PVTv2)
CLASSIFIER_PAIRS: Dict[str, Tuple[str, Dict[str, str]]] = {
    'flatten-pvt-v2-b0': (
        'configs/mmpretrain/flatten_pvt_v2/flatten-pvt-v2-b0_8xb128_in1k.py',
        {'pvt-v2-b0': 'configs/mmpretrain/pvt_v2/pvt-v2-b0_8xb128_in1k.py'}),
    'quadtree-b-pvt-v2-b0': (
        'configs/mmpretrain/quadtree_pvt_v2/quadtree-b-pvt-v2-b0_8xb128_in1k.py',
        {'pvt-v2-b0': 'configs/mmpretrain/pvt_v2/pvt-v2-b0_8xb128_in1k.py'}),
    'flatten-swin-t': (
        'configs/mmpretrain/flatten_swin/flatten-swin-t_8xb128_in1k.py',
        {'swin-t (mmpretrain)': 'mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py'}),
    'sima-xcit-s12-p16': (
        'configs/mmpretrain/sima_xcit/sima-xcit-s12-p16_8xb128_in1k.py',
        {'xcit-s12-p16 (mmpretrain)': 'mmpretrain::xcit/xcit-small-12-p16_8xb128_in1k.py'}),
}
#: default batches of the classifier suite at 224x224 (per-GPU batches of the recipes are
#: 64-256; these fit a CPU or one GPU and show how the cost grows with the batch)
CLASSIFIER_BATCHES = (8, 32)


def _load_config(path: str):
    """A config of this checkout, or one shipped inside a package (``mmpretrain::...``)."""
    from mmengine.config import Config
    if '::' in path:
        from mmengine.hub import get_config
        return get_config(path)
    return Config.fromfile(os.path.join(_root(), path))


def classifier_step(cfg, input_hw: Tuple[int, int], batch: int, device: torch.device,
                    amp: Optional[torch.dtype] = None, seed: int = 0
                    ) -> Tuple[nn.Module, Callable[[], torch.Tensor]]:
    """Build the mmpretrain classifier of ``cfg`` (drop path off, SyncBN as BatchNorm) and
    a callable doing one training step -- ``model(mode='loss')`` on a random batch with
    random labels, backward, AdamW step, ``zero_grad`` -- as mmpretrain's training loop
    runs it (without Mixup / CutMix, which act on the data before the model).

    Returns:
        ``(model, step)``; ``step()`` returns the loss (detached).
    """
    from mmengine.model import revert_sync_batchnorm
    from mmpretrain.structures import DataSample

    from flatten_mm.models.classification import build_classifier
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.drop_path_rate = 0.
    model_cfg.pop('train_cfg', None)  # batch augments belong to the data preprocessor
    torch.manual_seed(seed)
    model = revert_sync_batchnorm(build_classifier(model_cfg)).to(device).train()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, *input_hw, generator=g).to(device)
    num_classes = model_cfg.head.num_classes
    labels = torch.randint(num_classes, (batch, ), generator=g).tolist()
    samples = [DataSample().set_gt_label(i) for i in labels]
    opt = make_optimizer(model)

    def train():
        with _autocast(device, amp):
            losses = model(x, samples, mode='loss')
        loss, _ = model.parse_losses(losses)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return model, train


def run_classifier_benchmark(batches: Sequence[int] = CLASSIFIER_BATCHES,
                             input_hw: Tuple[int, int] = (224, 224),
                             device: str = 'cpu',
                             amp: Optional[torch.dtype] = None,
                             names: Optional[Sequence[str]] = None,
                             warmup: int = 2,
                             repeats: int = 5,
                             memory: bool = True,
                             log: Optional[Callable[[str], None]] = None
                             ) -> List[Dict[str, Any]]:
    """Training steps of the ImageNet classifiers (what pretraining costs), ours against
    the softmax counterpart, alternating in one process (suite ``'classifier_step'``).

    Args:
        batches: images per step (one group per batch).
        input_hw: image size (ImageNet training: 224x224).
        device, amp, warmup, repeats, memory, log: as ``run_step_benchmark``.
        names: subset of ``CLASSIFIER_PAIRS`` (default all).

    Returns:
        Rows like ``run_step_benchmark``'s (``step='train'``, ``exec='eager'``).
    """
    device_ = torch.device(device)
    amp_name = amp_label(amp)
    pairs = dict(CLASSIFIER_PAIRS)
    if names:
        unknown = [n for n in names if n not in pairs]
        if unknown:
            raise ValueError(f'unknown classifiers {unknown}; available: {list(pairs)}')
        pairs = {n: pairs[n] for n in names}
    rows: List[Dict[str, Any]] = []
    for ours, (path, baselines) in pairs.items():
        members = dict({ours: path}, **baselines)
        for batch in batches:
            cases, errors = {}, {}
            for name, cfg_path in members.items():
                try:
                    _, fn = classifier_step(_load_config(cfg_path), input_hw, batch, device_,
                                            amp)
                    fn()  # first step: builds AdamW state, reports errors here
                    cases[name] = fn
                except Exception as err:  # noqa: BLE001 - reported in the table
                    errors[name] = f'error: {type(err).__name__}: {str(err)[:200]}'
            if log is not None:
                log(f'classifier train {input_hw[0]}x{input_hw[1]} batch {batch} {amp_name}: '
                    f'{", ".join(cases)}')
            timings = measure_alternating(cases, device_, max(0, warmup - 1), repeats,
                                          grad=True)
            for name in members:
                extra = dict(height=input_hw[0], width=input_hw[1],
                             tokens=input_hw[0] * input_hw[1],
                             group=f'{ours}@b{batch}/train/eager', step='train',
                             exec='eager', amp=amp_name, kernels=kernels_setting(),
                             source='config')
                rows.append(_measured_row('classifier_step', name, name, cases, timings,
                                          errors, device_, batch, memory, True, extra))
            del cases
            if device_.type == 'cuda':
                torch.cuda.empty_cache()
    return rows


def classifier_pairs() -> Dict[str, Tuple[str, ...]]:
    """``ours -> baselines`` names of the classifier suite (for ``step_ratio_rows``)."""
    return {k: tuple(v[1]) for k, v in CLASSIFIER_PAIRS.items()}
