"""Put a flatten_mm backbone into an existing mmdet 3.x / mmseg 1.x config.

    python tools/swap_backbone.py SRC_CONFIG --backbone flatten-pvt-v2-b1 \
        [--checkpoint CKPT] -o NEW_CONFIG [--force] [--verify] [--train-smoke]
    python tools/swap_backbone.py --list

SRC_CONFIG is a config file or a scoped name (``mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py``).
The new config inherits it and overrides the backbone, the channels read by the neck /
heads, ``out_indices``, ``custom_imports``, the weight-decay rules and (with
``--checkpoint``) ``init_cfg``; see ``flatten_mm/swap/plan.py``. Nothing is written
when the config cannot be adapted or NEW_CONFIG exists (without ``--force``).
``--verify`` builds the new model on CPU and runs one forward; ``--train-smoke`` runs one
training iteration on real images through the config's own train pipeline (its dataset,
else the bundled demo images; a synthetic batch when that pipeline cannot run on them,
see ``flatten_mm/swap/demo.py``) and checks that the losses and gradients are
finite and every trainable backbone parameter gets a gradient (if not: exit status 1 and
an error line saying which).
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from flatten_mm.models.catalogue import format_catalogue  # noqa: E402
from flatten_mm.swap.plan import random_weights_warning, swap_backbone, verify_config  # noqa: E402
from flatten_mm.swap.demo import DemoUnavailable  # noqa: E402
from flatten_mm.swap.smoke import train_smoke  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('src', nargs='?', help='config file or mmdet::/mmseg:: config name')
    p.add_argument('--backbone', help='catalogue name (see --list)')
    p.add_argument('--checkpoint',
                   help='ImageNet weights for init_cfg: flatten_mm://NAME for the official '
                   'ones, or a converted file (without it the backbone trains from random '
                   'weights)')
    p.add_argument('-o', '--out', help='path of the new config')
    p.add_argument('--force', action='store_true', help='overwrite an existing --out')
    p.add_argument('--verify', action='store_true',
                   help='build the new model on CPU and run one forward at 224x256')
    p.add_argument('--train-smoke', action='store_true',
                   help='run one training iteration on CPU (real images through the '
                   'config\'s train pipeline: its dataset, else the bundled demo data; '
                   'synthetic when that cannot run): finite losses, a gradient for every '
                   'backbone parameter, one optimizer step')
    p.add_argument('--smoke-data', choices=('auto', 'real', 'synthetic'), default='auto',
                   help='batch of --train-smoke: auto (real images, synthetic fallback), '
                   'real (an error instead of the fallback) or synthetic')
    p.add_argument('--smoke-size', type=int, nargs=2, default=(256, 256), metavar=('H', 'W'),
                   help='image size of --train-smoke (default 256 256)')
    p.add_argument('--list', action='store_true',
                   help='print every backbone name with its parameters and strides')
    args = p.parse_args(argv)
    if not args.list and not (args.src and args.backbone and args.out):
        p.error('SRC_CONFIG, --backbone and -o are required (or --list)')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print(format_catalogue())
        return 0
    try:
        swap_backbone(args.src, args.backbone, args.out, args.checkpoint, args.force)
    except ValueError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 1
    print(f'wrote {args.out}')
    if not args.checkpoint:
        print('warning: ' + random_weights_warning(args.backbone).replace('\n', ' '),
              file=sys.stderr)
    if args.verify:
        shapes = verify_config(args.out)
        print('verified: built and ran one forward; backbone maps ' +
              ', '.join('x'.join(map(str, s[1:])) for s in shapes))
    if args.train_smoke:
        try:
            report = train_smoke(args.out, input_hw=tuple(args.smoke_size),
                                 data=args.smoke_data)
        except DemoUnavailable as exc:
            print(f'error: --smoke-data real: {exc}', file=sys.stderr)
            return 1
        print(report.summary())
        if not report.ok:
            print('error: --train-smoke failed: ' + '; '.join(report.failures), file=sys.stderr)
            return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
