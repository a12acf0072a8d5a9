"""``dev/export_sweep.py`` (the per-family export record behind
docs/reports/deploy_support.csv): it picks one config per family and model kind, the smallest
arch, and shrinks the backbone with necks and heads following its channels."""
import os.path as osp
import sys

from mmengine.config import Config

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, osp.join(ROOT, 'dev'))
import export_sweep  # noqa: E402


def test_one_smallest_config_per_family_and_kind():
    picked = export_sweep.representatives()
    keys = [(osp.dirname(rel), kind) for rel, kind in picked]
    assert len(keys) == len(set(keys))
    picked = dict(picked)
    assert 'configs/mmdet/flatten_pvt_v2/mask-rcnn_flatten-pvt-v2-b0_fpn_1x_coco.py' in picked
    assert 'configs/mmdet/flatten_swin/mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py' \
        in picked
    families = {rel.split('/')[2] for rel in picked}
    assert {'flatten_pvt', 'flatten_pvt_v2', 'flatten_swin', 'flatten_cswin', 'sima_xcit',
            'quadtree_pvt_v2', 'hybrid'} <= families
    assert {kind for kind in picked.values()} == set(export_sweep.KINDS)
    assert export_sweep.representatives(only='sima_xcit/retinanet') == [
        ('configs/mmdet/sima_xcit/retinanet_sima-xcit-s12-p16_fpn_1x_coco.py', 'retinanet')]


def test_tiny_overrides_follow_the_backbone_channels():
    cfg = Config.fromfile(osp.join(
        ROOT, 'configs/mmseg/sima_xcit/upernet_sima-xcit-t12-p16_8xb2-160k_ade20k-512x512.py'))
    name, over = export_sweep._tiny_overrides(cfg)
    assert name == 'SimAXCiT'
    from flatten_mm.registry import MODELS
    bb = {k: v for k, v in over['model.backbone'].items() if k != '_delete_'}
    chans = list(MODELS.build(bb).out_channels)
    assert over['model.decode_head.in_channels'] == chans
    assert over['model.auxiliary_head.in_channels'] == chans[cfg.model.auxiliary_head.in_index]


def test_heads_behind_a_neck_keep_their_channels():
    cfg = Config.fromfile(osp.join(
        ROOT, 'configs/mmseg/flatten_pvt_v2/fpn_flatten-pvt-v2-b0_4xb4-80k_ade20k-512x512.py'))
    _, over = export_sweep._tiny_overrides(cfg)
    assert over['model.neck.in_channels'] == [8, 16, 24, 32]
    assert not any(k.startswith('model.decode_head') for k in over)  # it reads the FPN
