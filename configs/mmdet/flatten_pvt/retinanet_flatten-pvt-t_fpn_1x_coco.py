# RetinaNet 1x, FLatten-PVT-T backbone (no published result; the FLatten paper has no
# RetinaNet rows). Recipe inferred: PVT protocol as mmdet's retinanet_pvt-t_fpn_1x_coco --
# AdamW lr 1e-4, weight decay 1e-4, batch 16, 12 epochs (steps 8/11), single scale
# 1333x800, drop path 0.1. See README.md.
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    'mmdet::_base_/datasets/coco_detection.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenPVT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-pvt-t')),
    neck=dict(in_channels=[64, 128, 320, 512]))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'pos_embed': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'attn.scale': dict(decay_mult=0.),
    }))
