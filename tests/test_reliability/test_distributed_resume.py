"""Distributed training, kill + resume, the runner's checkpoint loading, SyncBN on CPU.

The shipped SimA RetinaNet recipe also runs 2 iterations under 2-process torchrun (tiny
arch, bundled COCO images): DDP without ``find_unused_parameters`` fails at iteration 2
if any trainable parameter gets no gradient (see also ``test_unused_parameters.py``).

All runs go through ``tools/train.py`` (torchrun for 2 processes, gloo on CPU) with a
small deterministic Semantic FPN config written next to each run: it inherits the
quick-start ADE20K config and swaps in a tiny FLatten-PVTv2 arch, fixed 128x128 resizes
(no random augmentation), no dropout / drop-path, GroupNorm in the head (batch norm
statistics depend on the per-process batch, so they could not match), 6 iterations,
checkpoints every 2, ``randomness=dict(seed=0, deterministic=True)``. The test hook
(``reliability_hooks.RecordLossHook``) writes every rank's loss at full precision.

Tolerances: 2 processes x batch 1 vs 1 process x batch 2 (same global batch, same
samples): per-iteration loss (mean over ranks) within 1e-5 relative, final weights within
1e-5 absolute (gradient all-reduce sums in another order than a batch mean). Kill +
resume (SIGTERM after the checkpoint of iteration 2, resume, SIGKILL after iteration 4,
resume) vs uninterrupted: losses of the resumed iterations within 1e-6 absolute and final
weights within 1e-6 (observed: bit-identical).
"""
import glob
import json
import os
import os.path as osp
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO_ROOT

HERE = osp.dirname(osp.abspath(__file__))
SEG = osp.join(REPO_ROOT, 'configs', 'quickstart',
               'fpn_flatten-pvt-v2-b0_quickstart_ade20k-mini.py')
MAX_ITERS = 6
CKPT_EVERY = 2

CONFIG = '''_base_ = {base!r}
custom_imports = dict(imports=['flatten_mm.models', 'reliability_hooks'],
                      allow_failed_imports=False)
size = (128, 128)
model = dict(
    data_preprocessor=dict(size=size),
    backbone=dict(drop_path_rate=0., arch=dict(_delete_=True, embed_dims=(16, 32, 64, 128),
                                               depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8),
                                               mlp_ratios=(4, 4, 4, 4))),
    neck=dict(in_channels=[16, 32, 64, 128], out_channels=64),
    decode_head=dict(in_channels=[64] * 4, channels=32, dropout_ratio=0.,
                     norm_cfg=dict(type='GN', num_groups=8, requires_grad=True)))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='Resize', scale=size, keep_ratio=False),
    dict(type='PackSegInputs')]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=size, keep_ratio=False),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')]
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = [dict(type='mmseg.IoUMetric', iou_metrics=['mIoU']),
                 dict(type='GatheredSamplesMetric', out_dir={records!r})]
test_evaluator = val_evaluator
train_cfg = dict(max_iters={max_iters}, val_interval={max_iters})
default_hooks = dict(logger=dict(interval=1),
                     checkpoint=dict(interval={every}, max_keep_ckpts=-1),
                     visualization=dict(draw=False))
log_processor = dict(window_size=1)
custom_hooks = [dict(type='RecordLossHook', out_dir={records!r})]
randomness = dict(seed=0, deterministic=True)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Run:
    """One training job: its config, work dir and loss records."""

    def __init__(self, root) -> None:
        self.root = str(root)
        self.work = osp.join(self.root, 'work')
        self.records = osp.join(self.root, 'records')
        self.config = osp.join(self.root, 'cfg.py')
        os.makedirs(self.work, exist_ok=True)
        with open(self.config, 'w') as f:
            f.write(CONFIG.format(base=SEG, records=self.records, max_iters=MAX_ITERS,
                                  every=CKPT_EVERY))

    def command(self, nproc: int = 1, extra=()) -> list:
        args = [self.config, '--work-dir', self.work, *extra]
        if nproc == 1:
            return [sys.executable, 'tools/train.py', *args]
        return [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc),
                '--master_port', str(free_port()), 'tools/train.py', *args,
                '--launcher', 'pytorch']

    @staticmethod
    def env(**extra) -> dict:
        env = dict(os.environ, **extra)
        env['PYTHONPATH'] = os.pathsep.join([REPO_ROOT, HERE, os.environ.get('PYTHONPATH', '')])
        return env

    def train(self, nproc: int = 1, extra=(), timeout: int = 600) -> str:
        proc = subprocess.run(self.command(nproc, extra), cwd=REPO_ROOT, env=self.env(),
                              capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f'{self.command(nproc, extra)}\n{out[-6000:]}'
        return out

    def losses(self, rank: int = 0) -> dict:
        """iteration -> loss of ``rank`` (the last record wins for repeated iterations)."""
        path = osp.join(self.records, f'losses_rank{rank}.jsonl')
        with open(path) as f:
            return {r['iter']: r['loss'] for r in map(json.loads, f)}

    def weights(self, it: int) -> dict:
        from flatten_mm.compat import load_local_checkpoint
        return load_local_checkpoint(osp.join(self.work, f'iter_{it}.pth'))['state_dict']

    def val_metrics(self) -> dict:
        files = sorted(glob.glob(osp.join(self.work, '*', 'vis_data', 'scalars.json')))
        with open(files[-1]) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [r for r in records if 'mIoU' in r][-1]


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel())


@pytest.fixture(scope='module')
def single(tmp_path_factory):
    """The uninterrupted 1-process reference run (a user's file sits in its work dir)."""
    pytest.importorskip('mmseg')
    run = Run(tmp_path_factory.mktemp('single'))
    with open(osp.join(run.work, 'my_notes.txt'), 'w') as f:
        f.write('do not delete')
    run.log = run.train()
    return run


def test_two_processes_match_one_process_and_gather_all_results(single, tmp_path):
    dist = Run(tmp_path)
    dist.train(nproc=2, extra=['--cfg-options', 'train_dataloader.batch_size=1'])
    ref = single.losses()
    rank0, rank1 = dist.losses(0), dist.losses(1)
    assert sorted(ref) == sorted(rank0) == sorted(rank1) == list(range(1, MAX_ITERS + 1))
    for it in ref:
        mean = (rank0[it] + rank1[it]) / 2
        assert abs(mean - ref[it]) <= 1e-5 * abs(ref[it]), (it, mean, ref[it])
        assert rank0[it] != rank1[it], 'both ranks saw the same sample'
    assert max_abs_diff(dist.weights(MAX_ITERS), single.weights(MAX_ITERS)) <= 1e-5
    # evaluation: rank 0 computed the metric over the results of both ranks
    with open(osp.join(dist.records, 'gathered_1.json')) as f:
        gathered = json.load(f)
    images = sorted(glob.glob(osp.join(REPO_ROOT, 'demo', 'data', 'ade_mini', '**', '*.jpg'),
                              recursive=True))
    assert sorted(osp.basename(g['img_path']) for g in gathered) == \
        sorted(osp.basename(p) for p in images)
    assert {g['rank'] for g in gathered} == {0, 1}
    m1, m2 = single.val_metrics(), dist.val_metrics()
    for key in ('aAcc', 'mIoU', 'mAcc'):
        assert abs(m1[key] - m2[key]) <= 0.011, (key, m1[key], m2[key])


def start_until_hang(run: Run, hang_after: int, extra=()) -> subprocess.Popen:
    """Start ``tools/train.py`` and return once the job sits after iteration
    ``hang_after`` (its checkpoint written), still running."""
    env = Run.env(FLATTEN_MM_TEST_HANG_AFTER_ITER=str(hang_after))
    marker = osp.join(run.records, 'hanging')
    if osp.exists(marker):
        os.remove(marker)
    proc = subprocess.Popen(run.command(extra=list(extra) + ['--cfg-options',
                                                            'train_cfg.val_interval=1000']),
                            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not osp.exists(marker):
        assert proc.poll() is None, f'training ended early:\n{proc.stderr.read()[-4000:]}'
        assert time.time() < deadline, 'training did not reach the checkpoint'
        time.sleep(0.5)
    return proc


def kill(proc: subprocess.Popen, sig: int) -> None:
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    assert proc.returncode == -sig


def test_killed_run_resumes_to_the_same_losses(single, tmp_path):
    """SIGTERM after the first checkpoint, ``--resume CKPT`` (that checkpoint's path),
    SIGKILL after the second, ``--resume`` (the work dir's latest): every iteration runs
    once and the resumed ones reproduce the uninterrupted run."""
    run = Run(tmp_path)
    kill(start_until_hang(run, CKPT_EVERY), signal.SIGTERM)
    first = osp.join(run.work, f'iter_{CKPT_EVERY}.pth')
    assert osp.isfile(first)
    logs = set(os.listdir(run.work))
    kill(start_until_hang(run, 2 * CKPT_EVERY, extra=['--resume', first]), signal.SIGKILL)
    assert osp.isfile(osp.join(run.work, f'iter_{2 * CKPT_EVERY}.pth'))
    assert not osp.exists(osp.join(run.work, f'iter_{MAX_ITERS}.pth'))
    assert logs <= set(os.listdir(run.work)), 'the interrupted run\'s files were removed'
    out = run.train(extra=['--resume', '--cfg-options', 'train_cfg.val_interval=1000'])
    assert 'Auto resumed from the latest checkpoint ' \
        f'{osp.join(run.work, f"iter_{2 * CKPT_EVERY}.pth")}' in out
    ref, resumed = single.losses(), run.losses()
    # a resume that started over would record iterations 1, 2, ... again
    with open(osp.join(run.records, 'losses_rank0.jsonl')) as f:
        assert [r['iter'] for r in map(json.loads, f)] == list(range(1, MAX_ITERS + 1))
    for it in range(CKPT_EVERY + 1, MAX_ITERS + 1):
        assert abs(resumed[it] - ref[it]) <= 1e-6, (it, resumed[it], ref[it])
    assert max_abs_diff(run.weights(MAX_ITERS), single.weights(MAX_ITERS)) <= 1e-6
    # three runs' log dirs, nothing wiped
    assert len([d for d in os.listdir(run.work) if osp.isdir(osp.join(run.work, d))]) == 3


def test_work_dir_is_not_wiped(single):
    with open(osp.join(single.work, 'my_notes.txt')) as f:
        assert f.read() == 'do not delete'


def test_runner_checkpoints_need_the_loader_fix_and_load_without_full_unpickling(
        single, monkeypatch):
    """On this torch (weights_only=True by default) mmengine 0.10.7's own loader cannot
    read the runner's checkpoints; flatten_mm's loader reads them with weights_only=True
    and an allow-list, never with full unpickling."""
    import pickle

    from mmengine.runner.checkpoint import CheckpointLoader, load_from_local

    import flatten_mm.models  # noqa: F401  (installs the loader, as custom_imports do)
    from flatten_mm.compat import load_local_checkpoint
    path = osp.join(single.work, f'iter_{CKPT_EVERY}.pth')
    with pytest.raises(pickle.UnpicklingError):
        load_from_local(path, map_location='cpu')  # mmengine's loader, unpatched
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, map_location='cpu')
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get('weights_only'))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, 'load', spy)
    monkeypatch.delenv('FLATTEN_MM_TRUST_CHECKPOINTS', raising=False)
    ckpt = CheckpointLoader.load_checkpoint(path, map_location='cpu')  # what resume calls
    assert CheckpointLoader._schemes[''] is load_local_checkpoint
    assert calls and all(c is True for c in calls), calls
    assert {'state_dict', 'optimizer', 'message_hub', 'param_schedulers', 'meta'} <= set(ckpt)
    assert ckpt['meta']['iter'] == CKPT_EVERY


def test_sync_bn_is_replaced_for_cpu_multi_process_runs(monkeypatch):
    """torch's SyncBatchNorm needs CUDA across processes: for torchrun on CPU,
    ``setup_cpu_distributed`` initialises gloo itself, selects a DDP wrapper without
    ``device_ids`` and turns SyncBN into per-process BN. Without a launcher it does
    nothing (mmengine reverts SyncBN itself in single-process runs)."""
    pytest.importorskip('mmseg')
    import torch.distributed as dist
    from mmengine.config import Config

    from flatten_mm.compat import setup_cpu_distributed
    cfg = Config.fromfile(SEG)
    assert cfg.model.decode_head.norm_cfg.type == 'SyncBN'
    cfg.launcher = 'none'
    assert setup_cpu_distributed(cfg) == [] and cfg.model.decode_head.norm_cfg.type == 'SyncBN'
    if torch.cuda.is_available():
        pytest.skip('CUDA present: the CPU path is not taken')
    cfg.launcher = 'pytorch'
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    monkeypatch.setenv('MASTER_PORT', str(free_port()))
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '1')
    try:
        notes = setup_cpu_distributed(cfg)
        assert dist.is_initialized() and dist.get_backend() == 'gloo'
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert cfg.model.decode_head.norm_cfg.type == 'BN'
    assert cfg.model_wrapper_cfg.type == 'CPUDistributedDataParallel'
    assert any('decode_head.norm_cfg' in n for n in notes), notes


def test_sync_bn_backbone_runs_single_process_on_cpu():
    from backbone_specs import build
    model = build('SimAXCiT', norm_cfg=dict(type='SyncBN')).train()
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
    outs = model(torch.randn(2, 3, 48, 64))
    sum(o.mean() for o in outs).backward()


def test_cpu_ddp_wrapper_reverts_a_backbone_default_sync_bn(tmp_path):
    """A SyncBN that no config ``norm_cfg`` names (``SimAXCiT``'s default) cannot run on
    CPU once a process group exists, so ``setup_cpu_distributed``'s config rewrite cannot
    reach it; the CPU DDP wrapper turns it into per-process BN (same parameters)."""
    import torch.distributed as dist
    from mmengine.registry import MODEL_WRAPPERS

    from backbone_specs import build
    from flatten_mm.compat import _register_cpu_ddp
    if dist.is_initialized():
        pytest.fail('a process group is already initialised in this test process')
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=0,
                            world_size=1)
    try:
        model = build('SimAXCiT').train()
        assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
        with pytest.raises(ValueError, match='SyncBatchNorm expected input tensor to be on GPU'):
            model(torch.randn(2, 3, 32, 32))
        weight = model.blocks[0].local_mp.bn.weight
        wrapped = MODEL_WRAPPERS.build(dict(type=_register_cpu_ddp(), module=model))
        assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in wrapped.modules())
        assert wrapped.module.blocks[0].local_mp.bn.weight is weight
        sum(o.mean() for o in wrapped(torch.randn(2, 3, 32, 32))).backward()
        assert weight.grad is not None
    finally:
        dist.destroy_process_group()


SIMA_RETINANET_CONFIG = '''_base_ = {base!r}
custom_imports = dict(imports=['flatten_mm.models', 'reliability_hooks'],
                      allow_failed_imports=False)
data_root = 'demo/data/coco_mini/'
size = (128, 96)
model = dict(
    backbone=dict(arch=dict(_delete_=True, embed_dims=32, depth={depth}, num_heads=2),
                  init_cfg=None),
    neck=dict(in_channels={in_channels!r}))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale=size, keep_ratio=True),
    dict(type='PackDetInputs')]
train_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True), batch_sampler=None,
    dataset=dict(data_root=data_root, ann_file='annotations/instances_train2017.json',
                 data_prefix=dict(img='train2017/'),
                 filter_cfg=dict(filter_empty_gt=True, min_size=8), pipeline=train_pipeline))
val_dataloader = None
val_cfg = None
val_evaluator = None
test_dataloader = None
test_cfg = None
test_evaluator = None
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=2)
param_scheduler = []
default_hooks = dict(logger=dict(interval=1),
                     checkpoint=dict(by_epoch=False, interval=2),
                     visualization=dict(draw=False))
log_processor = dict(by_epoch=False, window_size=1)
custom_hooks = [dict(type='RecordLossHook', out_dir={records!r})]
randomness = dict(seed=0)
'''


def test_sima_retinanet_trains_two_iterations_under_ddp(tmp_path):
    """The shipped SimA RetinaNet recipe (tiny arch, its own out_indices / block_indices,
    neck and heads) under 2-process torchrun (gloo) with mmdet's default
    ``find_unused_parameters=False``: both ranks finish iteration 2. A backbone map that
    the neck does not read (fpn1 without gradient) made DDP fail at iteration 2 with
    "Expected to have finished reduction in the prior iteration"."""
    pytest.importorskip('mmdet')
    from mmengine.config import Config
    found = sorted(glob.glob(osp.join(REPO_ROOT, 'configs', 'mmdet', 'sima_xcit',
                                      'retinanet_*.py')))
    assert found, 'no SimA RetinaNet config under configs/mmdet/sima_xcit'
    cfg = Config.fromfile(found[0])
    assert cfg.get('find_unused_parameters', False) is False
    from flatten_mm.registry import MODELS
    import flatten_mm.models  # noqa: F401
    cls = MODELS.get(cfg.model.backbone.type.rsplit('.', 1)[-1])
    arch, _ = cls._split_patch_suffix(cfg.model.backbone.arch, cfg.model.backbone.get('patch_size'))
    run = Run(tmp_path)
    with open(run.config, 'w') as f:
        f.write(SIMA_RETINANET_CONFIG.format(
            base=found[0], depth=cls.arch_zoo[arch]['depth'], records=run.records,
            in_channels=[32] * len(cfg.model.neck.in_channels)))
    run.train(nproc=2)
    for rank in (0, 1):
        losses = run.losses(rank)
        assert sorted(losses) == [1, 2], (rank, losses)
        assert all(v == v and abs(v) < float('inf') for v in losses.values()), losses
    assert osp.isfile(osp.join(run.work, 'iter_2.pth'))


@pytest.mark.skipif(not torch.cuda.is_available(), reason='--amp (AmpOptimWrapper) needs CUDA')
def test_amp_training_on_cuda(tmp_path):
    pytest.importorskip('mmseg')
    run = Run(tmp_path)
    # deterministic=False: mmseg's IoU metric uses torch.histc, which has no deterministic
    # CUDA kernel (the CPU tests keep deterministic=True)
    out = run.train(extra=['--amp', '--cfg-options', 'train_cfg.val_interval=1000',
                           'randomness.deterministic=False'])
    assert "type='AmpOptimWrapper'" in out, 'tools/train.py --amp did not select fp16 AMP'
    losses = run.losses()
    print('fp16 AMP losses on', torch.cuda.get_device_name(), losses)
    assert len(losses) == MAX_ITERS
    assert all(v == v and abs(v) < float('inf') for v in losses.values())
