"""Parameters and FLOPs (multiply-adds) of a model, attention maths included.

    python tools/analysis/get_flops.py CONFIG [--shape H [W]] [--num-proposals 1000]
    python tools/analysis/get_flops.py --backbone flatten-swin-t [--shape 224 224]

Default input: 1280x800 (H x W) for mmdet configs, 512x2048 for mmseg configs,
224x224 for a bare backbone. Attention operators are counted by their analytic
formulas (``flatten_mm/analysis/flops.py``), every other layer by module hooks, so the
total includes each attention matmul exactly once. By default the attention operators'
arithmetic is skipped while counting (shapes suffice); ``--exact-run`` runs it.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

import torch  # noqa: E402

from flatten_mm.models.catalogue import get_backbone_spec  # noqa: E402
from flatten_mm.analysis.flops import (count_flops, count_params, format_report,  # noqa: E402
                                       model_complexity)

DEFAULT_SHAPES = {'mmdet': (1280, 800), 'mmseg': (512, 2048), 'backbone': (224, 224)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config', nargs='?', help='mmdet / mmseg config file')
    p.add_argument('--backbone', help='count a bare catalogue backbone instead of a config')
    p.add_argument('--shape', type=int, nargs='+', help='input H [W] (one value: square)')
    p.add_argument('--num-proposals', type=int, default=1000,
                   help='fixed proposals fed to two-stage RoI heads (mask heads get 100)')
    p.add_argument('--exact-run', action='store_true',
                   help='also compute the attention operators (slower; same counts)')
    p.add_argument('--threads', type=int, default=0, help='torch threads (0: default)')
    args = p.parse_args(argv)
    if bool(args.config) == bool(args.backbone):
        p.error('give a CONFIG or --backbone NAME')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    stub = not args.exact_run
    if args.backbone:
        spec = get_backbone_spec(args.backbone)
        hw = tuple(args.shape or DEFAULT_SHAPES['backbone'])
        hw = hw * 2 if len(hw) == 1 else hw
        model = spec.build().eval()
        report = count_flops(model, torch.zeros(1, 3, *hw), stub_attention=stub)
        params = count_params(model)
        title = f'{spec.name} ({spec.type}, arch {spec.arch!r}), input 1x3x{hw[0]}x{hw[1]}'
    else:
        from mmengine.config import Config
        cfg = Config.fromfile(args.config)
        scope = cfg.get('default_scope', 'mmdet')
        hw = tuple(args.shape or DEFAULT_SHAPES.get(scope, (1280, 800)))
        hw = hw * 2 if len(hw) == 1 else hw
        report, params = model_complexity(cfg, hw, stub_attention=stub,
                                          num_proposals=args.num_proposals)
        title = (f'{osp.basename(args.config)} ({cfg.model.type}, backbone '
                 f'{cfg.model.backbone.type}), input 1x3x{hw[0]}x{hw[1]}')
    print(format_report(report, params, title))
    return 0


if __name__ == '__main__':
    sys.exit(main())
