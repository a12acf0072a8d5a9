"""Evaluate a checkpoint of a detector, segmentor or classifier (mmdet / mmseg / mmpretrain
config).

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--show-dir DIR]
                         [--cfg-options k=v ...] [--launcher ...]

``--show-dir`` saves every test image with the predictions drawn (boxes and masks for
mmdet, the class map for mmseg, the predicted class for mmpretrain) through the library's
own visualization hook.
"""
import argparse
import os
import os.path as osp
import sys

from mmengine.config import Config, DictAction


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test (and evaluate) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint: a file, a URL, or flatten_mm://NAME '
                        '(an official model, downloaded and converted on first use)')
    parser.add_argument('--work-dir', help='the dir to save evaluation metrics')
    parser.add_argument('--out', help='dump predictions to a pickle file (mmdet)')
    parser.add_argument('--show', action='store_true', help='show predictions in a window')
    parser.add_argument('--show-dir', help='directory where painted images are saved')
    parser.add_argument('--wait-time', type=float, default=2, help='interval of --show (s)')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override config settings, e.g. test_dataloader.batch_size=2')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def enable_visualization(cfg: Config, args) -> None:
    """Turn on the mmdet / mmseg / mmpretrain visualization hook to paint predictions."""
    hook = cfg.default_hooks.get('visualization', None)
    if hook is None:
        raise SystemExit('--show/--show-dir need `default_hooks.visualization` in the config '
                         '(DetVisualizationHook, SegVisualizationHook or VisualizationHook)')
    if cfg.get('default_scope') == 'mmpretrain':  # mmpretrain's VisualizationHook
        hook.update(enable=True, interval=1)
        if args.show:
            hook.update(show=True, wait_time=args.wait_time)
        if args.show_dir:
            hook['out_dir'] = osp.abspath(args.show_dir)
        return
    hook['draw'] = True
    if args.show:
        hook['show'] = True
        hook['wait_time'] = args.wait_time
    if args.show_dir:
        if hook['type'].endswith('SegVisualizationHook'):
            hook['interval'] = 1
            cfg.visualizer['save_dir'] = args.show_dir
        else:  # mmdet: paints into <work_dir>/<timestamp>/<test_out_dir>
            hook['test_out_dir'] = osp.abspath(args.show_dir)


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    cfg.load_from = args.checkpoint
    if args.show or args.show_dir:
        enable_visualization(cfg, args)
    if args.out is not None:
        if not args.out.endswith(('.pkl', '.pickle')):
            raise SystemExit('--out must be a .pkl file')
        cfg.test_evaluator = [cfg.test_evaluator] if isinstance(cfg.test_evaluator, dict) \
            else list(cfg.test_evaluator)
        cfg.test_evaluator.append(dict(type='DumpResults', out_file_path=args.out))

    from flatten_mm.compat import setup_cpu_distributed
    for note in setup_cpu_distributed(cfg):  # torchrun on a machine without CUDA
        print(f'flatten_mm: {note}', file=sys.stderr)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
    runner.test()


if __name__ == '__main__':
    main()
