"""End to end: the quick-start configs through tools/train.py and tools/test.py on the
bundled real COCO / ADE20K images. (Resuming -- ``--resume CKPT`` and ``--resume`` from
the work dir, after SIGTERM and SIGKILL, to the same losses -- is
tests/test_reliability/test_distributed_resume.py.)"""
import glob
import json
import math
import os
import os.path as osp
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

DET = 'configs/quickstart/mask-rcnn_flatten-pvt-v2-b0_fpn_quickstart_coco-mini.py'
SEG = 'configs/quickstart/fpn_flatten-pvt-v2-b0_quickstart_ade20k-mini.py'
# the detection run is shortened to keep CI fast on 2 CPU cores (Mask R-CNN costs seconds
# per iteration there): 20 iterations, checkpoints every 10, evaluation by tools/test.py
DET_SHORT = ['train_cfg.max_iters=20', 'train_cfg.val_interval=1000',
             'default_hooks.checkpoint.interval=10', 'default_hooks.logger.interval=2',
             'log_processor.window_size=2']
SEG_SHORT = DET_SHORT


def run(args, timeout=900):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run([sys.executable] + args, cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f'{args}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}'
    return proc.stdout + proc.stderr


def scalars(work_dir):
    """Records of mmengine's vis_data/scalars.json of the latest run in work_dir."""
    files = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    assert files, f'no scalars.json under {work_dir}'
    with open(files[-1]) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_test_metrics(work_dir):
    files = sorted(glob.glob(osp.join(work_dir, '*', '*.json')))
    assert files, f'no test metrics json under {work_dir}'
    with open(files[-1]) as f:
        return json.load(f)


def assert_every_image_painted(show_dir, image_dir):
    """Each test image has a painted file named after it under ``show_dir`` (mmdet
    keeps the name, mmseg's visualizer adds a prefix / suffix), readable as an image."""
    import cv2
    stems = sorted(osp.splitext(f)[0] for f in os.listdir(image_dir))
    painted = [p for p in glob.glob(osp.join(str(show_dir), '**', '*'), recursive=True)
               if p.endswith(('.jpg', '.png'))]
    unpainted = [s for s in stems if not any(s in osp.basename(p) for p in painted)]
    assert stems and not unpainted, f'not painted: {unpainted}; painted: {painted[:5]}'
    for path in painted:
        image = cv2.imread(path)
        assert image is not None and image.size > 0, path


def check_loss_decreases(records, key='loss'):
    losses = [(r['iter'], r[key]) for r in records if key in r]
    assert len(losses) >= 6, losses
    assert all(math.isfinite(v) for _, v in losses)
    first = sum(v for _, v in losses[:2]) / 2
    last = sum(v for _, v in losses[-2:]) / 2
    assert last < first, f'loss did not decrease: {losses}'
    return losses


@pytest.fixture(scope='module')
def det_run(tmp_path_factory):
    pytest.importorskip('mmdet')
    work = str(tmp_path_factory.mktemp('det'))
    run(['tools/train.py', DET, '--work-dir', work, '--cfg-options'] + DET_SHORT)
    return work


def test_detection_train_and_test(det_run):
    """(As scripts/quickstart.sh: train and test share the work dir.)"""
    losses = check_loss_decreases(scalars(det_run))
    assert losses[-1][0] == 20
    show = osp.join(det_run, 'show')
    run(['tools/test.py', DET, osp.join(det_run, 'iter_20.pth'), '--work-dir', det_run,
         '--show-dir', show])
    metrics = read_test_metrics(det_run)
    for key in ('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP', 'coco/segm_mAP_50'):
        assert key in metrics and math.isfinite(metrics[key]) and 0 <= metrics[key] <= 1, key
    assert_every_image_painted(show, osp.join(REPO_ROOT, 'demo/data/coco_mini/val2017'))


@pytest.fixture(scope='module')
def seg_run(tmp_path_factory):
    pytest.importorskip('mmseg')
    work = str(tmp_path_factory.mktemp('seg'))
    run(['tools/train.py', SEG, '--work-dir', work, '--cfg-options'] + SEG_SHORT)
    return work


def test_segmentation_train_and_test(seg_run):
    check_loss_decreases(scalars(seg_run))
    show = osp.join(seg_run, 'show')
    run(['tools/test.py', SEG, osp.join(seg_run, 'iter_20.pth'), '--work-dir', seg_run,
         '--show-dir', show])
    metrics = read_test_metrics(seg_run)
    for key in ('mIoU', 'aAcc', 'mAcc'):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert_every_image_painted(
        show, osp.join(REPO_ROOT, 'demo/data/ade_mini/ADEChallengeData2016/images/validation'))


def test_summary_reports_the_metrics_and_a_next_command_that_works(det_run, seg_run, tmp_path):
    """The closing summary of scripts/quickstart.sh: the metrics tools/test.py wrote, the
    checkpoints, and a next command (tools/infer.py) that paints a prediction."""
    for work in (det_run, seg_run):  # (the test above, when run alone)
        if not glob.glob(osp.join(work, '*', '*.json')):
            cfg = DET if work == det_run else SEG
            run(['tools/test.py', cfg, osp.join(work, 'iter_20.pth'), '--work-dir', work])
    out = run(['scripts/quickstart_summary.py', DET, det_run, SEG, seg_run])
    det, seg = read_test_metrics(det_run), read_test_metrics(seg_run)
    assert f"bbox mAP {det['coco/bbox_mAP']:.3f}" in out
    assert f"segm mAP {det['coco/segm_mAP']:.3f}" in out
    assert f"mIoU {seg['mIoU']:.1f}%" in out
    assert '20 iterations from random weights' in out
    assert osp.join(det_run, 'iter_20.pth') in out and 'What to expect' in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith('python tools/infer.py'))
    command = ' '.join(line.strip().rstrip('\\') for line in lines[start:start + 2]).split()
    out_dir = str(tmp_path / 'infer')
    command[command.index('--out-dir') + 1] = out_dir
    run(command[1:])
    painted = glob.glob(osp.join(out_dir, 'vis', '*.jpg'))
    assert len(painted) == 1 and osp.basename(painted[0]) == osp.basename(command[4])
