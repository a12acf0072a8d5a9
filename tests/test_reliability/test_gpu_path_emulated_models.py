"""The emulated GPU path (see ``test_gpu_path_emulated.py``) in a 2-process DDP run with a
synchronised batch norm and in whole mm models: a Mask R-CNN and a UperNet config, one
training iteration each with ``with_cp=True``.

torch's ``SyncBatchNorm`` runs across processes on CUDA only; the DDP case's batch norm
all-reduces its batch statistics through ``torch.distributed.nn`` (differentiable
collectives, as SyncBN's forward and backward communicate), so the kernels' forward and
backward run between collectives and under DDP's gradient hooks, as on GPUs.

Every case asserts what the backbone matrix asserts: nothing raised, no warning of ours,
every first-use verdict a pass, and the parameter gradients of the PyTorch path
(``FLATTEN_MM_TRITON=0``) within 1e-5 (relative L2 norm over every parameter, float32).
"""
import os
import os.path as osp
import random
import socket
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from conftest import REPO_ROOT
from test_gpu_path_emulated import (DEVICE, build, emulated_gpu,  # noqa: F401
                                    no_warnings_of_ours, pytorch_path, relative)
from flatten_mm.models.ops import dispatch

DDP_FAMILY = 'hybrid-pvt-v2'  # QuadTree, FLA and SimA stages: both kernel families
DDP_BATCH = 4


class _SyncBN(nn.BatchNorm2d):
    """A training-mode batch norm over the batch of every process (in a process group):
    the statistics are all-reduced by ``torch.distributed.nn`` (differentiable), as
    ``SyncBatchNorm`` does on CUDA; without a group, ``BatchNorm2d``."""

    def forward(self, x):
        if not (self.training and dist.is_initialized()):
            return super().forward(x)
        from torch.distributed.nn import all_reduce
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype)
        sums = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), count])
        sums = all_reduce(sums)
        C = x.shape[1]
        mean, var = sums[:C] / sums[-1], sums[C:2 * C] / sums[-1] - (sums[:C] / sums[-1])**2
        x = (x - mean[:, None, None]) / (var[:, None, None] + self.eps).sqrt()
        return x * self.weight[:, None, None] + self.bias[:, None, None]


class _WithSyncBN(nn.Module):
    """A backbone and a head with a synchronised batch norm on its last map."""

    def __init__(self, backbone: nn.Module, channels: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Conv2d(channels, 8, 1), _SyncBN(8), nn.ReLU())

    def forward(self, x):
        outs = self.backbone(x)
        return outs[:-1] + (self.head(outs[-1]), )


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)
    backbone = build(DDP_FAMILY, drop_path_rate=0.)  # (no per-sample randomness)
    channels = backbone(torch.zeros(1, 3, 64, 64))[-1].shape[1]
    torch.manual_seed(0)
    return _WithSyncBN(backbone, channels).train()


def _batch():
    return torch.randn(DDP_BATCH, 3, 64, 64, generator=torch.Generator().manual_seed(3))


def _loss(outs, samples: slice):
    """A fixed random projection of the outputs of ``samples`` (of the whole batch)."""
    gen = torch.Generator().manual_seed(2)
    total = 0.
    for o in outs:
        w = torch.randn((DDP_BATCH, ) + tuple(o.shape[1:]), generator=gen)[samples]
        total = total + (o * w).sum()
    return total


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    """One of 2 DDP processes (gloo): half the batch each, SyncBN, the emulated GPU
    path; writes its gradients, warnings and verdicts for the test to read."""
    dispatch.AUTO_DEVICE_TYPES = ('cuda', 'cpu')
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=2)
    try:
        model = _ddp_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        half = slice(rank * DDP_BATCH // 2, (rank + 1) * DDP_BATCH // 2)
        problems = []
        try:
            with no_warnings_of_ours():
                torch.manual_seed(1)
                _loss(ddp(_batch()[half]), half).backward()
        except AssertionError as e:  # (the warnings)
            problems.append(str(e))
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.save(dict(grads=grads, problems=problems, verdicts=dispatch.verdicts()),
                   osp.join(out_dir, f'rank{rank}.pt'))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.timeout(900)
def test_ddp_with_sync_bn_through_the_kernels(emulated_gpu):
    """2 processes x 2 images with a synchronised batch norm equal 1 process x 4 images
    with BatchNorm on the PyTorch path (DDP averages the two halves' gradients: the sum
    loss's gradient over the whole batch is twice that)."""
    if DEVICE != 'cpu':
        pytest.skip('2 processes on one GPU: the DDP case runs emulated on the CPU (CI)')
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_ddp_worker, args=(_free_port(), out), nprocs=2, join=True,
                           start_method='spawn')
        ranks = [torch.load(osp.join(out, f'rank{r}.pt'), weights_only=False)
                 for r in range(2)]
    for r in ranks:
        assert not r['problems'], r['problems']
        assert r['verdicts'] and all(r['verdicts'].values()), r['verdicts']
    model = _ddp_model()
    with pytorch_path():
        torch.manual_seed(1)
        _loss(model(_batch()), slice(None)).backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for r in ranks:  # (DDP leaves every rank the same averaged gradients)
        assert relative({n: 2 * g for n, g in r['grads'].items()}, ref) <= 1e-5


# --------------------------------------------------------------------------- whole models
TINY_PVT = dict(embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 3, 4),
                mlp_ratios=(2, 2, 2, 2))
TINY_SWIN = dict(embed_dims=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4))
MODELS = {
    'mask-rcnn': ('configs/quickstart/mask-rcnn_flatten-pvt-v2-b0_fpn_quickstart_coco-mini.py',
                  dict(backbone=dict(arch=dict(_delete_=True, **TINY_PVT), with_cp=True, init_cfg=None),
                       neck=dict(in_channels=[16, 32, 48, 64], out_channels=32),
                       rpn_head=dict(in_channels=32, feat_channels=32),
                       roi_head=dict(bbox_head=dict(in_channels=32, fc_out_channels=64),
                                     mask_head=dict(in_channels=32, conv_out_channels=32),
                                     bbox_roi_extractor=dict(out_channels=32),
                                     mask_roi_extractor=dict(out_channels=32)))),
    'upernet': ('configs/mmseg/flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py',
                dict(backbone=dict(arch=dict(_delete_=True, **TINY_SWIN), with_cp=True, init_cfg=None,
                                   drop_path_rate=0.),
                     decode_head=dict(in_channels=[16, 32, 64, 128], channels=32),
                     auxiliary_head=dict(in_channels=64, channels=16))),
}


def _model_step(cfg, batch):
    from flatten_mm.apis.forward import build_model
    from mmengine.model import revert_sync_batchnorm
    torch.manual_seed(0)
    model = revert_sync_batchnorm(build_model(cfg, init_weights=True)).train().to(DEVICE)
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(1)  # (proposal / RoI sampling)
    data = model.data_preprocessor(batch, True)
    loss, _ = model.parse_losses(model(**data, mode='loss'))
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.timeout(900)
@pytest.mark.parametrize('name', list(MODELS))
def test_whole_model_with_cp_through_the_kernels(emulated_gpu, name):
    pytest.importorskip('mmdet' if name == 'mask-rcnn' else 'mmseg')
    if DEVICE == 'cuda':
        from mmcv.ops import get_compiling_cuda_version
        if get_compiling_cuda_version() in (None, '', 'not available'):
            pytest.skip('mmcv without its CUDA ops (RoIAlign, nms): the whole models run '
                        'emulated on the CPU (CI)')
    from mmengine.config import Config
    from flatten_mm.swap.demo import demo_batch
    path, overrides = MODELS[name]
    cfg = Config.fromfile(osp.join(REPO_ROOT, path))
    cfg.merge_from_dict(dict(model=overrides))
    if cfg.model.get('data_preprocessor', {}).get('size') is not None:
        cfg.model.data_preprocessor.size = (128, 128)
    batch, _ = demo_batch(cfg, (128, 128), batch_size=2, seed=0)
    with no_warnings_of_ours():
        got = _model_step(cfg, batch)
    verdicts = dispatch.verdicts()
    assert verdicts and all(verdicts.values()), verdicts
    assert any(n.startswith('backbone.') for n in got)
    with pytorch_path():
        ref = _model_step(cfg, batch)
    assert relative(got, ref) <= 1e-5
