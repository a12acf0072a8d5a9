"""Markdown table of params / FLOPs of the shipped configs next to the papers' numbers.

    python dev/flops_table.py [--only SUBSTRING ...] [--threads 1]

Rows: the published FLatten rows (COCO at 1280x800, ADE20K at 512x2048; numbers from
``shared/spec/results.md``, FLatten paper Tables 1-2) and the other families' configs
(no published FLOPs). Each row is counted with ``flatten_mm.analysis.flops`` (see
``tools/analysis/get_flops.py``).
"""
import argparse
import os.path as osp
import sys
import time

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch  # noqa: E402
from mmengine.config import Config  # noqa: E402

from flatten_mm.analysis.flops import model_complexity  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))

# (config, input (H, W), paper GFLOPs, paper params M, note)
ROWS = [
    ('configs/mmdet/flatten_pvt/mask-rcnn_flatten-pvt-t_fpn_1x_coco.py', (1280, 800), 244, 32,
     'Mask R-CNN'),
    ('configs/mmdet/flatten_swin/mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py',
     (1280, 800), 268, 49, 'Mask R-CNN'),
    ('configs/mmdet/flatten_swin/cascade-mask-rcnn_flatten-swin-t-p4-w7_fpn_4conv1fc-giou_'
     'ms-crop-3x_coco.py', (1280, 800), 747, 87, 'Cascade Mask R-CNN'),
    ('configs/mmdet/flatten_swin/cascade-mask-rcnn_flatten-swin-s-p4-w7_fpn_4conv1fc-giou_'
     'ms-crop-3x_coco.py', (1280, 800), 841, 108, 'Cascade Mask R-CNN'),
    ('configs/mmseg/flatten_pvt/fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py', (512, 2048), 169,
     16, 'Semantic FPN'),
    ('configs/mmseg/flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py',
     (512, 2048), 946, 60, 'UperNet'),
    ('configs/mmseg/flatten_swin/upernet_flatten-swin-s_8xb2-160k_ade20k-512x512.py',
     (512, 2048), 1038, 82, 'UperNet'),
    # no published FLOPs
    ('configs/mmdet/flatten_pvt_v2/mask-rcnn_flatten-pvt-v2-b1_fpn_1x_coco.py', (1280, 800),
     None, None, 'Mask R-CNN'),
    ('configs/mmdet/flatten_cswin/mask-rcnn_flatten-cswin-t_fpn_1x_coco.py', (1280, 800), None,
     None, 'Mask R-CNN'),
    ('configs/mmdet/quadtree_pvt_v2/retinanet_quadtree-b-pvt-v2-b1_fpn_1x_coco.py', (1280, 800),
     None, None, 'RetinaNet'),
    ('configs/mmdet/quadtree_pvt_v2/mask-rcnn_quadtree-b-pvt-v2-b1_fpn_1x_coco.py', (1280, 800),
     None, None, 'Mask R-CNN'),
    ('configs/mmdet/sima_xcit/mask-rcnn_sima-xcit-s12-p16_fpn_ms-crop-3x_coco.py', (1280, 800),
     None, None, 'Mask R-CNN'),
    ('configs/mmdet/hybrid/retinanet_pvt-v2-b1-qt12-sr34_fpn_1x_coco.py', (1280, 800), None,
     None, 'RetinaNet'),
    ('configs/mmseg/quadtree_pvt_v2/fpn_quadtree-b-pvt-v2-b1_8xb2-160k_ade20k-512x512.py',
     (512, 2048), None, None, 'Semantic FPN'),
    ('configs/mmseg/hybrid/fpn_pvt-v2-b1-fla12-sima34_4xb4-80k_ade20k-512x512.py', (512, 2048),
     None, None, 'Semantic FPN'),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--only', nargs='*', default=(), help='rows whose config contains these')
    p.add_argument('--threads', type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print('| config | model | input | params (ours / paper) | GFLOPs (ours / paper) | '
          'attention ops | hooks only | time |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- |')
    for path, hw, p_flops, p_params, model in ROWS:
        if args.only and not any(s in path for s in args.only):
            continue
        if not osp.isfile(osp.join(ROOT, path)):
            continue
        t0 = time.time()
        report, params = model_complexity(Config.fromfile(osp.join(ROOT, path)), hw)
        total_params = params['total'] - params.get('auxiliary_head', 0)
        paper_f = f' / {p_flops}' if p_flops else ''
        paper_p = f' / {p_params}' if p_params else ''
        print(f'| {osp.basename(path)[:-3]} | {model} | {hw[0]}x{hw[1]} | '
              f'{total_params / 1e6:.1f}M{paper_p} | {report.total / 1e9:.1f}{paper_f} | '
              f'{report.attention_total / 1e9:.1f} | {report.hooks_total / 1e9:.1f} | '
              f'{time.time() - t0:.0f}s |', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
