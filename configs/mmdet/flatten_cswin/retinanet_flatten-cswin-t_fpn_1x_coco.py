# RetinaNet 1x, FLatten-CSwin-T backbone. No published result. Recipe inferred as the
# Swin RetinaNet protocol (mmdet's retinanet_swin-t-p4-w7_fpn_1x_coco): stages 2-4 into
# the FPN (start_level 0), AdamW lr 1e-4, weight decay 0.05, batch 16, 12 epochs (steps
# 8/11), single scale 1333x800; drop path = the ImageNet pretraining value.
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
        type='flatten_mm.FLattenCSWin',
        arch='t',
        drop_path_rate=0.2,
        out_indices=(1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/flatten-cswin-t_in1k.pth')),
    neck=dict(in_channels=[128, 256, 512], start_level=0, num_outs=5))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'branches.0.scale': dict(decay_mult=0.),
        'branches.1.scale': dict(decay_mult=0.),
    }))
