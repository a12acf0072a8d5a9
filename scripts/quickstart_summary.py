"""The closing summary of ``scripts/quickstart.sh``: what was trained on what, the metrics
``tools/test.py`` wrote, what to expect of them, where the outputs are, what to try next.

    python scripts/quickstart_summary.py DET_CONFIG DET_WORK_DIR SEG_CONFIG SEG_WORK_DIR
"""
import glob
import json
import os
import os.path as osp
import re
import sys
from typing import Dict, List, Optional

from mmengine.config import Config

#: the metrics shown, in this order (mmdet's CocoMetric, mmseg's IoUMetric)
DET_METRICS = {'coco/bbox_mAP': 'bbox mAP', 'coco/bbox_mAP_50': 'bbox mAP@50',
               'coco/segm_mAP': 'segm mAP'}
SEG_METRICS = {'mIoU': 'mIoU', 'aAcc': 'pixel accuracy', 'mAcc': 'mean class accuracy'}


def test_metrics(work_dir: str) -> Dict[str, float]:
    """The metrics of the newest ``tools/test.py`` run in ``work_dir`` (mmengine writes them
    to ``<timestamp>/<timestamp>.json``)."""
    runs = sorted(glob.glob(osp.join(work_dir, '*', '*.json')), key=osp.getmtime)
    for path in reversed(runs):
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
        if isinstance(record, dict) and any(k in record for k in (*DET_METRICS, *SEG_METRICS)):
            return record
    raise SystemExit(f'no test metrics under {work_dir}: did tools/test.py run?')


def _count_images(dataset: dict) -> int:
    """Images of an mmdet COCO dataset (its annotation file) or an mmseg folder dataset."""
    root = dataset.get('data_root', '')
    if dataset.get('ann_file'):
        with open(osp.join(root, dataset['ann_file']), encoding='utf-8') as f:
            return len(json.load(f)['images'])
    folder = osp.join(root, dataset['data_prefix']['img_path'])
    return len([f for f in os.listdir(folder) if not f.startswith('.')])


def _images(dataset: dict) -> str:
    """``'12 images (demo/data/...)'``."""
    root = dataset.get('data_root', '')
    prefix = dataset.get('data_prefix', {})
    folder = osp.join(root, prefix.get('img', prefix.get('img_path', '')))
    return f'{_count_images(dataset)} images ({osp.normpath(folder)})'


def _first_image(dataset: dict) -> Optional[str]:
    root = dataset.get('data_root', '')
    prefix = dataset.get('data_prefix', {})
    folder = osp.join(root, prefix.get('img', prefix.get('img_path', '')))
    names = sorted(f for f in os.listdir(folder) if f.endswith(('.jpg', '.png')))
    return osp.normpath(osp.join(folder, names[0])) if names else None


def _checkpoint(work_dir: str) -> str:
    """The newest checkpoint of a training run (mmengine's ``last_checkpoint`` file)."""
    try:
        with open(osp.join(work_dir, 'last_checkpoint'), encoding='utf-8') as f:
            path = f.read().strip()
    except OSError:
        raise SystemExit(f'no checkpoint in {work_dir}: did tools/train.py run?')
    return osp.relpath(path) if osp.isabs(path) and not osp.relpath(path).startswith('..') \
        else path


def _iterations(checkpoint: str) -> str:
    match = re.search(r'iter_(\d+)\.pth$', checkpoint)
    return match.group(1) if match else '?'


def describe(config: str, work_dir: str, task: str) -> List[str]:
    """The lines for one model: data, metrics, outputs."""
    cfg = Config.fromfile(config)
    train, test = cfg.train_dataloader.dataset, cfg.test_dataloader.dataset
    model = cfg.model.type + (f" ({cfg.model.decode_head.type})" if cfg.model.get('decode_head')
                              else '') + ' + ' + cfg.model.backbone.type.split('.')[-1]
    if cfg.model.backbone.get('arch'):
        model += f" ({cfg.model.backbone.arch})"
    same = _images(train) == _images(test)
    data = (f'trained and tested on the same {_images(train)}' if same else
            f'trained on {_images(train)}, tested on {_images(test)}')
    metrics = test_metrics(work_dir)
    checkpoint = _checkpoint(work_dir)
    names = DET_METRICS if task == 'det' else SEG_METRICS
    shown = ', '.join(f'{label} {metrics[key]:.3f}' if task == 'det' else
                      f'{label} {metrics[key]:.1f}%' for key, label in names.items()
                      if key in metrics)
    return [f'{model}, {_iterations(checkpoint)} iterations from random weights, {data}:',
            f'    {shown}',
            f'    checkpoint {checkpoint}; painted predictions in {osp.join(work_dir, "show")}/']


def main(argv: List[str]) -> int:
    if len(argv) != 4:
        print(__doc__)
        return 2
    det_cfg, det_dir, seg_cfg, seg_dir = argv
    lines = ['', '=' * 88, 'Quick start finished (CPU, the real COCO / ADE20K images bundled in '
             'demo/data)', '']
    lines += describe(det_cfg, det_dir, 'det') + [''] + describe(seg_cfg, seg_dir, 'seg')
    image = _first_image(Config.fromfile(det_cfg).test_dataloader.dataset)
    lines += [
        '',
        'What to expect: a few dozen iterations from random weights on a handful of images',
        'show that data, training, evaluation and painting work end to end; a COCO mAP of',
        '0.000 and a low mIoU (mostly the most frequent classes) are normal. Published numbers',
        'need the full datasets and the ImageNet-pretrained backbone: see docs/model_zoo.md.',
        '',
        'Next, predict on an image with the trained detector:',
        f'    python tools/infer.py {det_cfg} \\',
        f'        {_checkpoint(det_dir)} {image} --out-dir outputs/quickstart',
        '=' * 88]
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
