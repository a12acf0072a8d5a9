"""Train a detector, segmentor or classifier from an mmdet / mmseg / mmpretrain config.

    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--amp | --no-amp]
                          [--cfg-options k=v ...] [--launcher {none,pytorch,slurm,mpi}]

Works for mmdet 3.x, mmseg 1.x and mmpretrain 1.x configs (the config's ``default_scope``
decides); on a machine without CUDA, ``--launcher pytorch`` runs on gloo
(``flatten_mm.compat.setup_cpu_distributed``), which the libraries' own tools cannot.
Multi-GPU / multi-node: ``tools/dist_train.sh`` (torchrun) or ``tools/slurm_train.sh``.
"""
import argparse
import os
import os.path as osp
import sys

from mmengine.config import Config, DictAction


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a detector / segmentor / classifier')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and checkpoints')
    parser.add_argument(
        '--resume', nargs='?', type=str, const='auto',
        help='resume from the given checkpoint, or (no value) from the latest checkpoint '
        'in the work dir')
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument('--amp', action='store_true',
                           help='fp16 automatic mixed precision (AmpOptimWrapper, CUDA only)')
    precision.add_argument('--no-amp', action='store_true',
                           help='train in float32 although the config asks for AMP '
                           '(AmpOptimWrapper), e.g. on a machine without CUDA')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the learning rate with the total batch size')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override config settings, e.g. train_cfg.max_iters=10')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def build_cfg(args) -> Config:
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    if args.amp:
        if not _has_cuda():
            raise SystemExit('--amp uses mmengine AmpOptimWrapper, which needs a CUDA device; '
                             'on CPU train in float32 (or bf16 autocast in your own loop)')
        if cfg.optim_wrapper.get('type', 'OptimWrapper') == 'AmpOptimWrapper':
            print('AMP training is already enabled in the config', file=sys.stderr)
        else:
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'
    if args.no_amp and cfg.optim_wrapper.get('type') == 'AmpOptimWrapper':
        cfg.optim_wrapper.type = 'OptimWrapper'
        for key in ('loss_scale', 'dtype', 'use_fsdp'):  # (AmpOptimWrapper's own arguments)
            cfg.optim_wrapper.pop(key, None)
    elif cfg.optim_wrapper.get('type') == 'AmpOptimWrapper' and not _has_cuda():
        raise SystemExit(f'{args.config} trains with AMP (AmpOptimWrapper), which needs a CUDA '
                         'device: add --no-amp to train in float32 on this machine')
    if args.auto_scale_lr:
        if 'auto_scale_lr' in cfg and 'base_batch_size' in cfg.auto_scale_lr:
            cfg.auto_scale_lr.enable = True
        else:
            raise SystemExit('--auto-scale-lr needs `auto_scale_lr.base_batch_size` in the config')
    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return cfg


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = build_cfg(args)
    from flatten_mm.compat import setup_cpu_distributed
    for note in setup_cpu_distributed(cfg):  # torchrun on a machine without CUDA
        print(f'flatten_mm: {note}', file=sys.stderr)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    if 'runner_type' not in cfg:
        runner = Runner.from_cfg(cfg)
    else:
        runner = RUNNERS.build(cfg)
    runner.train()


if __name__ == '__main__':
    main()
