"""Predict on images with a detector or segmentor (mmdet / mmseg config) and paint the
predictions: mmdet's ``DetInferencer`` or mmseg's ``MMSegInferencer``, chosen by the
config's ``default_scope``.

    python tools/infer.py CONFIG CHECKPOINT IMAGE [IMAGE ...] [--out-dir DIR]
                          [--device cpu|cuda] [--score-thr 0.3]

CHECKPOINT is a trained or converted file, or ``flatten_mm://NAME`` (an official trained
model, downloaded and converted on first use). The painted images go to
``DIR/vis/``, the predictions as JSON to ``DIR/preds/`` (mmdet) or the class maps to
``DIR/pred/`` (mmseg).
"""
import argparse
import sys

from mmengine.config import Config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Predict on images and paint the results')
    parser.add_argument('config', help='mmdet / mmseg config file')
    parser.add_argument('checkpoint', help='checkpoint: a file, a URL, or flatten_mm://NAME')
    parser.add_argument('images', nargs='+', help='image files or folders')
    parser.add_argument('--out-dir', default='outputs', help='where the painted images go')
    parser.add_argument('--device', default='cpu', help='cpu, cuda or cuda:N')
    parser.add_argument('--score-thr', type=float, default=0.3,
                        help='detection: boxes below this score are not painted')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    scope = Config.fromfile(args.config).get('default_scope')
    if scope == 'mmdet':
        from mmdet.apis import DetInferencer
        infer = DetInferencer(args.config, args.checkpoint, device=args.device)
        for image in args.images:
            infer(image, out_dir=args.out_dir, pred_score_thr=args.score_thr,
                  no_save_pred=False)
    elif scope == 'mmseg':
        from mmseg.apis import MMSegInferencer
        infer = MMSegInferencer(args.config, args.checkpoint, device=args.device)
        for image in args.images:
            infer(image, out_dir=args.out_dir)
    else:
        raise SystemExit(f'{args.config}: default_scope is {scope!r}; tools/infer.py paints '
                         'mmdet and mmseg predictions (mmpretrain: tools/test.py --show-dir)')
    print(f'painted predictions in {args.out_dir}/vis')
    return 0


if __name__ == '__main__':
    sys.exit(main())
