"""Whole-model conversion of official mmdet 2.x / mmseg 0.x checkpoints (QuadTree's
RetinaNet 1x, Mask R-CNN 1x, Semantic FPN 160k files) into checkpoints of our configs.

No download: each test builds the config's model here, writes its weights in the
official layout (official backbone key names, ``backbone.`` / ``neck.`` / ``*_head.``
prefixes, ``{'meta', 'state_dict', 'optimizer'}`` with mmdet 2.x / mmseg 0.x meta
contents), converts the file with ``tools/convert_checkpoint.py`` and checks that the
converted model's predictions on bundled images are bit-identical to the source model's
and that ``tools/test.py`` evaluates it (COCO bbox / segm mAP, mIoU).
"""
import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, load_key_listing
from official_layouts import to_official_pvt_keys, write_official

pytest.importorskip('mmdet')
pytest.importorskip('mmseg')

sys.path.insert(0, osp.join(REPO_ROOT, 'tools'))
import convert_checkpoint  # noqa: E402

from flatten_mm.checkpoints.converters.whole_model import convert_whole_model, is_whole_model  # noqa: E402
from flatten_mm.apis.whole_model import build_config_model  # noqa: E402

QT = 'configs/mmdet/quadtree_pvt_v2'
CONFIGS = {
    'retinanet': f'{QT}/retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco.py',
    'mask_rcnn': f'{QT}/mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco.py',
    'sem_fpn': 'configs/mmseg/quadtree_pvt_v2/fpn_quadtree-b-pvt-v2-b0_8xb2-160k_ade20k-512x512.py',
    'retinanet_flatten_pvt_v2':
    'configs/mmdet/flatten_pvt_v2/retinanet_flatten-pvt-v2-b0_fpn_1x_coco.py',
}
COCO = osp.join(REPO_ROOT, 'demo', 'data', 'coco_mini')
ADE = osp.join(REPO_ROOT, 'demo', 'data', 'ade_mini', 'ADEChallengeData2016')
VAL_IMAGES = (397133, 37777)  # 640x427 and 352x230: >= 161 px (QuadTree top-32) at 256x192

# Official mmdet 2.x / mmseg 0.x names and shapes of the non-backbone modules
# (shared/spec/state_dicts.md §6.1), b0 widths (32, 64, 160, 256)
OFFICIAL_HEAD_KEYS = {
    'retinanet': {
        'neck.lateral_convs.0.conv.weight': (256, 64, 1, 1),
        'neck.lateral_convs.2.conv.weight': (256, 256, 1, 1),
        'neck.fpn_convs.3.conv.weight': (256, 256, 3, 3),  # on_input: C_4 = 256 for b0
        'neck.fpn_convs.4.conv.weight': (256, 256, 3, 3),
        'bbox_head.cls_convs.3.conv.weight': (256, 256, 3, 3),
        'bbox_head.reg_convs.3.conv.weight': (256, 256, 3, 3),
        'bbox_head.retina_cls.weight': (720, 256, 3, 3),
        'bbox_head.retina_reg.weight': (36, 256, 3, 3),
    },
    'mask_rcnn': {
        'neck.lateral_convs.0.conv.weight': (256, 32, 1, 1),
        'neck.fpn_convs.3.conv.weight': (256, 256, 3, 3),
        'rpn_head.rpn_conv.weight': (256, 256, 3, 3),
        'rpn_head.rpn_cls.weight': (3, 256, 1, 1),
        'rpn_head.rpn_reg.weight': (12, 256, 1, 1),
        'roi_head.bbox_head.shared_fcs.0.weight': (1024, 12544),
        'roi_head.bbox_head.shared_fcs.1.weight': (1024, 1024),
        'roi_head.bbox_head.fc_cls.weight': (81, 1024),
        'roi_head.bbox_head.fc_reg.weight': (320, 1024),
        'roi_head.mask_head.convs.3.conv.weight': (256, 256, 3, 3),
        'roi_head.mask_head.upsample.weight': (256, 256, 2, 2),
        'roi_head.mask_head.conv_logits.weight': (80, 256, 1, 1),
    },
    'sem_fpn': {
        'neck.lateral_convs.3.conv.weight': (256, 256, 1, 1),
        'neck.fpn_convs.3.conv.weight': (256, 256, 3, 3),
        'decode_head.scale_heads.0.0.conv.weight': (128, 256, 3, 3),
        'decode_head.scale_heads.0.0.bn.running_var': (128, ),
        'decode_head.scale_heads.3.4.conv.weight': (128, 128, 3, 3),
        'decode_head.conv_seg.weight': (150, 128, 1, 1),
    },
}


# ------------------------------------------------------------------ test configs
def write_test_config(kind, tmp_path, attn_cfg=None):
    """A config inheriting ``CONFIGS[kind]`` that evaluates on bundled images: COCO val
    images ``VAL_IMAGES`` at 256x192 (score threshold 0 so that the random heads predict
    boxes), or the 3 ADE20K images at 512x256."""
    base = osp.join(REPO_ROOT, CONFIGS[kind])
    backbone = dict(init_cfg=None)
    if attn_cfg is not None:
        backbone['attn_cfg'] = attn_cfg
    if kind == 'sem_fpn':
        text = f"""
_base_ = {base!r}
model = dict(backbone={backbone!r})
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(512, 256), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
test_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False, dataset=dict(
    data_root={ADE!r},
    data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
    pipeline=test_pipeline))
val_dataloader = test_dataloader
"""
    else:
        with open(osp.join(COCO, 'annotations', 'instances_val2017.json')) as f:
            ann = json.load(f)
        ann['images'] = [im for im in ann['images'] if im['id'] in VAL_IMAGES]
        ann['annotations'] = [a for a in ann['annotations'] if a['image_id'] in VAL_IMAGES]
        ann_file = str(tmp_path / 'instances_val_subset.json')
        with open(ann_file, 'w') as f:
            json.dump(ann, f)
        if kind == 'mask_rcnn':
            test_cfg = dict(rpn=dict(nms_pre=200, max_per_img=100),
                            rcnn=dict(score_thr=0.0, max_per_img=20))
            with_mask = True
        else:
            test_cfg = dict(nms_pre=200, score_thr=0.0, max_per_img=20)
            with_mask = False
        text = f"""
_base_ = {base!r}
model = dict(backbone={backbone!r}, test_cfg={test_cfg!r})
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(256, 192), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask={with_mask}),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
test_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False, dataset=dict(
    data_root={COCO + '/'!r}, ann_file={ann_file!r}, data_prefix=dict(img='val2017/'),
    pipeline=test_pipeline))
val_dataloader = test_dataloader
test_evaluator = dict(ann_file={ann_file!r})
val_evaluator = test_evaluator
"""
    path = tmp_path / f'test_{kind}.py'
    path.write_text(text)
    return str(path)


def randomize_buffers(model):
    """BN running statistics away from their (0, 1) defaults, so a lost buffer shows."""
    g = torch.Generator().manual_seed(1)
    for name, buf in model.named_buffers():
        if name.endswith('running_mean'):
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
        elif name.endswith('running_var'):
            buf.copy_(torch.rand(buf.shape, generator=g) + 0.5)


def predict(model, config):
    """Predictions of ``model`` on every image of the config's test dataloader."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.runner import Runner
    cfg = Config.fromfile(config)
    init_default_scope(cfg.default_scope)
    loader = Runner.build_dataloader(cfg.test_dataloader)
    model.eval()
    out = []
    with torch.no_grad():
        for batch in loader:
            out += model.test_step(batch)
    return out


def assert_identical_predictions(a, b, kind):
    assert len(a) == len(b) > 0
    for pa, pb in zip(a, b):
        if kind == 'sem_fpn':
            assert torch.equal(pa.seg_logits.data, pb.seg_logits.data)
            assert torch.equal(pa.pred_sem_seg.data, pb.pred_sem_seg.data)
            continue
        ia, ib = pa.pred_instances, pb.pred_instances
        assert len(ia.bboxes) > 0  # score threshold 0: the comparison is not vacuous
        for field in ('bboxes', 'scores', 'labels') + (('masks', ) if 'masks' in ia else ()):
            assert torch.equal(ia.get(field), ib.get(field)), field


def convert(src, dst, config, *extra):
    rc = convert_checkpoint.main([str(src), str(dst), '--config', config, *extra])
    assert rc == 0
    return torch.load(str(dst), map_location='cpu', weights_only=True)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize('kind,attn', [
    ('retinanet', None),
    ('mask_rcnn', None),
    ('sem_fpn', None),
    ('retinanet', dict(attn_type='A')),  # QuadTree-A trunk (no py_att / value branches)
    ('retinanet_flatten_pvt_v2', None),  # an official-layout FLatten-PVTv2 whole model
])
def test_official_layout_converts_to_identical_predictions(kind, attn, tmp_path):
    config = write_test_config(kind, tmp_path, attn)
    torch.manual_seed(0)
    source = build_config_model(config)
    randomize_buffers(source)
    src = tmp_path / 'official.pth'
    official = write_official(source, kind if kind in OFFICIAL_HEAD_KEYS else 'retinanet', src)
    for key, shape in OFFICIAL_HEAD_KEYS.get(kind, {}).items():
        assert tuple(official[key].shape) == shape, key  # our heads use mmdet 2.x names
    assert is_whole_model(official)
    out = convert(src, tmp_path / 'converted.pth', config)
    assert set(out['state_dict']) == set(source.state_dict())

    target = build_config_model(config)  # fresh random weights
    missing, unexpected = target.load_state_dict(out['state_dict'], strict=True)
    assert not missing and not unexpected
    assert_identical_predictions(predict(source, config), predict(target, config),
                                 'sem_fpn' if kind == 'sem_fpn' else 'det')


def test_meta_records_classes_and_source(tmp_path):
    config = write_test_config('sem_fpn', tmp_path)
    model = build_config_model(config)
    src = tmp_path / 'official.pth'
    write_official(model, 'sem_fpn', src)
    meta = convert(src, tmp_path / 'out.pth', config)['meta']
    from mmseg.datasets import ADE20KDataset
    assert meta['dataset_meta']['classes'] == tuple(ADE20KDataset.METAINFO['classes'])
    assert meta['dataset_meta']['palette'] == [list(c) for c in ADE20KDataset.METAINFO['palette']]
    assert meta['source_meta']['mmcv_version'] == '1.3.13'
    assert meta['source_meta']['mmseg_version'] == '0.20.2'
    assert meta['converted_from'] == str(src) and meta['config'] == config
    assert meta['family'] == 'quadtree'
    assert 'config' not in meta['source_meta'] and 'env_info' not in meta['source_meta']


def test_whole_model_against_the_wrong_config_names_the_mismatches(tmp_path, capsys):
    # a b0 Mask R-CNN file against the b0 RetinaNet config: heads differ
    mask_cfg = write_test_config('mask_rcnn', tmp_path)
    src = tmp_path / 'mask.pth'
    write_official(build_config_model(mask_cfg), 'mask_rcnn', src)
    retina_cfg = write_test_config('retinanet', tmp_path)
    assert convert_checkpoint.main([str(src), str(tmp_path / 'x.pth'), '--config', retina_cfg]) == 2
    err = capsys.readouterr().err
    assert 'does not match the model of' in err
    assert re.search(r'missing keys \(\d+\): .*bbox_head\.', err)
    assert re.search(r'unexpected keys \(\d+\): .*(rpn_head|roi_head)\.', err)
    assert not osp.exists(tmp_path / 'x.pth')
    # the same file against the b1 Mask R-CNN config: the same keys, other widths
    b1 = osp.join(REPO_ROOT, f'{QT}/mask-rcnn_quadtree-b-pvt-v2-b1_fpn_1x_coco.py')
    assert convert_checkpoint.main([str(src), str(tmp_path / 'y.pth'), '--config', b1]) == 2
    err = capsys.readouterr().err
    assert 'shape mismatches' in err and 'backbone.stages.0.patch_embed.proj.weight' in err


def test_whole_model_file_needs_config_or_backbone_only(tmp_path, capsys):
    config = write_test_config('retinanet', tmp_path)
    model = build_config_model(config)
    src = tmp_path / 'official.pth'
    write_official(model, 'retinanet', src)
    assert convert_checkpoint.main([str(src), str(tmp_path / 'a.pth')]) == 2
    assert '--config' in capsys.readouterr().err
    assert convert_checkpoint.main([str(src), str(tmp_path / 'b.pth'), '--backbone-only',
                                    '--arch', 'b0']) == 0
    sd = torch.load(str(tmp_path / 'b.pth'), weights_only=True)['state_dict']
    assert set(sd) == set(model.backbone.state_dict())
    # --whole-model on ImageNet weights is refused
    imagenet = tmp_path / 'in1k.pth'
    torch.save({'model': to_official_pvt_keys(model.backbone.state_dict())}, imagenet)
    assert convert_checkpoint.main([str(imagenet), str(tmp_path / 'c.pth'), '--whole-model']) == 2
    assert 'not a whole detector' in capsys.readouterr().err


def test_generated_backbone_layout_is_the_official_one():
    """The writer above produces exactly the official QuadTree dense-trunk keys and shapes
    (the classification listing without ``head.*``, spec/state_dict_keys)."""
    from flatten_mm.models import QuadTreePVTv2
    for arch, listing in (('b0', 'quadtree_b0'), ('a-b0', 'quadtreeA_b0')):
        official = {k: v for k, v in load_key_listing(listing).items()
                    if not k.startswith('head.')}
        ours = to_official_pvt_keys(QuadTreePVTv2(arch=arch).state_dict())
        assert set(ours) == set(official), arch
        assert all(ours[k].shape == official[k].shape for k in ours)


def test_convert_whole_model_is_pure_and_keeps_heads():
    sd = {'backbone.patch_embed1.proj.weight': torch.zeros(2),
          'backbone.head.weight': torch.zeros(1),
          'backbone.block1.0.attn.q_proj.weight': torch.zeros(1),
          'neck.lateral_convs.0.conv.weight': torch.ones(3)}
    out, dropped, family = convert_whole_model(sd)
    assert family == 'quadtree'
    assert dropped == ['backbone.head.weight']
    assert set(out) == {'backbone.stages.0.patch_embed.proj.weight',
                        'backbone.stages.0.blocks.0.attn.q_proj.weight',
                        'neck.lateral_convs.0.conv.weight'}
    assert out['neck.lateral_convs.0.conv.weight'] is sd['neck.lateral_convs.0.conv.weight']
    assert not is_whole_model({'backbone.x': 1, 'head.fc.weight': 2})  # a classifier


def run_tool(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run([sys.executable] + args, cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f'{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    return proc.stdout + proc.stderr


@pytest.mark.parametrize('kind,metrics', [
    ('mask_rcnn', ('coco/bbox_mAP', 'coco/segm_mAP')),
    ('retinanet', ('coco/bbox_mAP', )),
    ('sem_fpn', ('mIoU', )),
])
def test_tools_test_evaluates_converted_checkpoint(kind, metrics, tmp_path):
    """official-layout file -> tools/convert_checkpoint.py -> tools/test.py metric table."""
    config = write_test_config(kind, tmp_path)
    src = tmp_path / 'official.pth'
    write_official(build_config_model(config), kind, src)
    dst = tmp_path / 'converted.pth'
    run_tool(['tools/convert_checkpoint.py', str(src), str(dst), '--config', config])
    out = run_tool(['tools/test.py', config, str(dst), '--work-dir', str(tmp_path / 'work')])
    for name in metrics:
        assert re.search(rf'{re.escape(name)}: \d+\.\d+', out), (name, out[-3000:])
    if kind == 'sem_fpn':
        assert re.search(r'\|\s*wall\s*\|', out)  # the per-class IoU table
    else:
        assert 'Average Precision  (AP) @[ IoU=0.50:0.95' in out
    # the converted file loads without missing / unexpected keys
    assert 'missing keys' not in out and 'unexpected key' not in out
