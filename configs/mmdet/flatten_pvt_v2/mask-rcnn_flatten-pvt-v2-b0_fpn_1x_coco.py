# Mask R-CNN 1x, FLatten-PVTv2-b0 backbone. Recipe inferred (no published result): PVT
# protocol as the PVT repository's mask_rcnn_pvt_v2_b0_fpn_1x_coco -- AdamW lr 2e-4 (the
# PVT-family rule: Mask R-CNN 2e-4, RetinaNet 1e-4, as the PVT repository's configs),
# weight decay 1e-4, batch 16 (8 GPUs x 2), 12 epochs (steps 8/11), single scale
# 1333x800, drop path 0.1. See README.md.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenPVTv2',
        arch='b0',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        # the official ImageNet weights, downloaded and converted on first use; to fetch
        # them ahead (e.g. on a login node): python tools/download_weights.py flatten-pvt-v2-b0
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-pvt-v2-b0')),
    neck=dict(in_channels=[32, 64, 160, 256]))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'attn.scale': dict(decay_mult=0.),
    }))
