# RetinaNet 1x, FLatten-CSwin-T backbone. No published result; recipe inferred. Model as
# mmdet's retinanet_swin-t-p4-w7_fpn_1x_coco (stages 2-4 into the FPN, start_level 0),
# mmdet's 1x schedule (12 epochs, steps 8/11) and single-scale 1333x800 pipeline, batch 16.
# Optimizer: not mmdet's SGD lr 0.01 of that config but the AdamW setting of the Swin /
# CSWin detection protocol (lr 1e-4, weight decay 0.05, none on norms / positional
# encodings / FLA `scale`), as in our other FLatten-Swin / CSwin detectors. Drop path =
# the ImageNet pretraining value. Not tuned.
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
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-cswin-t')),
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
