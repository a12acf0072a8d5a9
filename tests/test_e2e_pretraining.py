"""Pretraining end to end, with mmpretrain's own tools, on a tiny ImageNet-layout folder.

The test builds ``imagenet/{train,val}/<class>/*.JPEG`` with ``meta/{train,val}.txt`` (the
layout and annotation files mmpretrain's ``ImageNet`` dataset reads) from the bundled demo
images, then:

* mmpretrain's ``tools/train.py`` trains the FLatten-PVTv2-b0 config of
  ``configs/mmpretrain`` for 2 iterations and its ``tools/test.py`` evaluates the
  checkpoint (top-1 / top-5);
* the trained classifier becomes the backbone of the Mask R-CNN config: every backbone
  weight of the detector equals the classifier's, by ``init_cfg`` with ``prefix='backbone.'``
  and by the plain checkpoint path;
* ``tools/dist_train.sh`` runs one config in 2 processes (torchrun, DDP; gloo on a CPU
  machine, where mmengine cannot initialise the process group itself);
* for one variant of every family, a classifier's checkpoint loads into that family's
  detection backbone under the strict checks (the output norms and adapters only the
  dense backbone has keep their initialisation).
"""
import glob
import os
import os.path as osp
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT

pytest.importorskip('mmpretrain')
pytest.importorskip('mmdet')

import mmpretrain  # noqa: E402

MMPRETRAIN_TOOLS = osp.join(osp.dirname(mmpretrain.__file__), '.mim', 'tools')
PVT_B0 = osp.join(REPO_ROOT, 'configs', 'mmpretrain', 'flatten_pvt_v2',
                  'flatten-pvt-v2-b0_8xb128_in1k.py')
CLASSES = ('n00000001', 'n00000002', 'n00000003')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def imagenet(tmp_path_factory):
    """A 3-class ImageNet-layout folder: 8 training and 6 validation images."""
    images = sorted(glob.glob(osp.join(REPO_ROOT, 'demo', 'data', 'coco_mini', '*', '*.jpg')))
    assert len(images) >= 14, images
    root = tmp_path_factory.mktemp('imagenet')
    for split, chosen in (('train', images[:8]), ('val', images[8:14])):
        lines = []
        for i, src in enumerate(chosen):
            label = i % len(CLASSES)
            rel = f'{CLASSES[label]}/{osp.splitext(osp.basename(src))[0]}.JPEG'
            os.makedirs(root / split / CLASSES[label], exist_ok=True)
            shutil.copy(src, root / split / rel)
            lines.append(f'{rel} {label}')
        os.makedirs(root / 'meta', exist_ok=True)
        (root / 'meta' / f'{split}.txt').write_text('\n'.join(lines) + '\n')
    return str(root)


def tiny_run_options(data_root: str) -> list:
    """``--cfg-options`` for the tiny folder: its root, 2 iterations of 4 images, no
    worker processes, a log line per iteration."""
    opts = [f'{part}.dataset.data_root={data_root}' for part in
            ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    opts += [f'{part}.{key}' for part in ('train_dataloader', 'val_dataloader',
                                          'test_dataloader')
             for key in ('num_workers=0', 'persistent_workers=False')]
    opts += ['train_dataloader.batch_size=4', 'val_dataloader.batch_size=3',
             'test_dataloader.batch_size=3', 'train_cfg.max_epochs=1',
             'default_hooks.logger.interval=1', 'randomness.seed=0']
    return ['--cfg-options', *opts]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS='1')
    env['PYTHONPATH'] = os.pathsep.join([REPO_ROOT, env.get('PYTHONPATH', '')])
    return env


def _run(cmd, timeout=900) -> str:
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f'{cmd}\n{out[-6000:]}'
    return out


@pytest.fixture(scope='module')
def trained_classifier(imagenet, tmp_path_factory):
    """mmpretrain's tools/train.py on the FLatten-PVTv2-b0 config: (checkpoint, log)."""
    work = str(tmp_path_factory.mktemp('work'))
    out = _run([sys.executable, osp.join(MMPRETRAIN_TOOLS, 'train.py'), PVT_B0,
                '--work-dir', work, *tiny_run_options(imagenet)])
    return osp.join(work, 'epoch_1.pth'), out


def test_mmpretrain_train_and_test_tools_run_a_config(imagenet, trained_classifier):
    ckpt, log = trained_classifier
    # 8 images, batch 4: two training iterations, then the validation of the epoch
    assert re.search(r'Epoch\(train\)\s+\[1\]\[2/2\]', log), log[-3000:]
    assert 'accuracy/top1' in log and 'accuracy/top5' in log
    out = _run([sys.executable, osp.join(MMPRETRAIN_TOOLS, 'test.py'), PVT_B0, ckpt,
                *tiny_run_options(imagenet)])
    found = re.search(r'accuracy/top1: ([\d.]+)\s+accuracy/top5: ([\d.]+)', out)
    assert found, out[-3000:]
    top1, top5 = map(float, found.groups())
    assert 0 <= top1 <= top5 <= 100
    # 6 validation images: top-1 is a multiple of 1/6
    assert round(top1 * 6 / 100, 6) == round(top1 * 6 / 100)
    # this repository's tools/test.py too, painting the predicted classes
    shown = osp.join(osp.dirname(ckpt), 'shown')
    ours = _run([sys.executable, 'tools/test.py', PVT_B0, ckpt, '--show-dir', shown,
                 *tiny_run_options(imagenet)])
    assert re.search(r'accuracy/top1: ([\d.]+)\s+accuracy/top5: ([\d.]+)', ours).groups() == \
        found.groups()  # the same checkpoint, the same numbers
    assert len(glob.glob(osp.join(shown, '*.png'))) == 6
    state = torch.load(ckpt, map_location='cpu', weights_only=False)['state_dict']
    assert {k.split('.')[0] for k in state} >= {'backbone', 'head'}


@pytest.mark.parametrize('how', ['prefix', 'plain path'])
def test_trained_classifier_becomes_the_mask_rcnn_backbone(trained_classifier, how):
    from mmdet.registry import MODELS
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    ckpt, _ = trained_classifier
    cfg = Config.fromfile(osp.join(REPO_ROOT, 'configs', 'mmdet', 'flatten_pvt_v2',
                                   'mask-rcnn_flatten-pvt-v2-b0_fpn_1x_coco.py'))
    init_cfg = dict(type='Pretrained', checkpoint=ckpt)
    if how == 'prefix':
        init_cfg['prefix'] = 'backbone.'
    cfg.model.backbone.init_cfg = init_cfg
    init_default_scope('mmdet')
    detector = MODELS.build(cfg.model)
    detector.init_weights()
    trained = torch.load(ckpt, map_location='cpu', weights_only=False)['state_dict']
    expected = {k[len('backbone.'):]: v for k, v in trained.items() if k.startswith('backbone.')}
    got = detector.backbone.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_two_process_ddp_pretraining(imagenet, tmp_path):
    """tools/dist_train.sh (torchrun, 2 processes) on the QuadTree-B-b0 classifier."""
    config = osp.join(REPO_ROOT, 'configs', 'mmpretrain', 'quadtree_pvt_v2',
                      'quadtree-b-pvt-v2-b0_8xb128_in1k.py')
    env = _env()
    env['PORT'] = str(_free_port())
    # the script runs `python`: this interpreter's
    env['PATH'] = os.pathsep.join([osp.dirname(sys.executable), env.get('PATH', '')])
    cmd = ['bash', osp.join(REPO_ROOT, 'tools', 'dist_train.sh'), config, '2',
           '--work-dir', str(tmp_path), *tiny_run_options(imagenet)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # 8 images over 2 processes x 4 per batch: one iteration each, world size 2
    assert re.search(r'Epoch\(train\)\s+\[1\]\[1/1\]', out), out[-3000:]
    assert 'Distributed training: True' in out and 'CPUDistributedDataParallel' in out
    assert out.count("distributed backend 'nccl' replaced by gloo") == 2  # one per process
    assert osp.isfile(tmp_path / 'epoch_1.pth')


#: one pretraining config and one detection config of every family
FAMILY_PAIRS = {
    'flatten-pvt-t': 'flatten_pvt/mask-rcnn_flatten-pvt-t_fpn_1x_coco.py',
    'flatten-swin-t': 'flatten_swin/mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py',
    'flatten-cswin-t': 'flatten_cswin/mask-rcnn_flatten-cswin-t_fpn_1x_coco.py',
    'quadtree-b-pvt-v2-b0': 'quadtree_pvt_v2/mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco.py',
    'sima-xcit-t12-p16': 'sima_xcit/mask-rcnn_sima-xcit-t12-p16_fpn_ms-crop-3x_coco.py',
}


@pytest.mark.parametrize('name', sorted(FAMILY_PAIRS))
def test_classifier_checkpoint_loads_into_the_family_detection_backbone(name, tmp_path):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS as CLS_MODELS

    from flatten_mm.models.zoo import pretraining_config
    from flatten_mm.registry import MODELS

    cls_cfg = Config.fromfile(osp.join(REPO_ROOT, pretraining_config(name)))
    init_default_scope('mmpretrain')
    classifier = CLS_MODELS.build(cls_cfg.model)
    classifier.init_weights()
    path = str(tmp_path / 'classifier.pth')
    torch.save({'state_dict': classifier.state_dict(), 'meta': {}}, path)

    det_cfg = Config.fromfile(osp.join(REPO_ROOT, 'configs', 'mmdet', FAMILY_PAIRS[name]))
    backbone_cfg = det_cfg.model.backbone.to_dict()
    backbone_cfg['init_cfg'] = dict(type='Pretrained', checkpoint=path, prefix='backbone.')
    torch.manual_seed(1)
    backbone = MODELS.build(backbone_cfg)
    fresh = {k: v.clone() for k, v in backbone.state_dict().items()}
    backbone.init_weights()
    trained = classifier.backbone.state_dict()
    dense_only = tuple(getattr(backbone, 'dense_only_prefixes', ()))
    for key, value in backbone.state_dict().items():
        if key in trained:
            assert torch.equal(value, trained[key]), key
        else:  # only what the dense backbone adds (output norms, SimA's adapters)
            assert key.startswith(dense_only), key
    assert any(not torch.equal(fresh[k], trained[k]) for k in trained if k in fresh)
