# RetinaNet 1x, FLatten-Swin-T backbone (no published result; the FLatten paper has no
# RetinaNet rows). Model as mmdet's retinanet_swin-t-p4-w7_fpn_1x_coco: stages 2-4 into the
# FPN (start_level 0, extra levels on the input), drop path 0.2, mmdet's 1x schedule
# (12 epochs, steps 8/11) and single-scale 1333x800 pipeline, batch 16. Optimizer: mmdet's
# config keeps schedule_1x's SGD and only sets lr 0.01; we use the AdamW setting of the Swin
# detection protocol that every published Swin / FLatten-Swin detector uses (lr 1e-4,
# weight decay 0.05, none on norms / position tables / FLA `scale`), so that all
# FLatten-Swin detectors share one optimizer. Not tuned.
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
        type='flatten_mm.FLattenSwin',
        arch='t',
        drop_path_rate=0.2,
        out_indices=(1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-swin-t')),
    neck=dict(in_channels=[192, 384, 768], start_level=0, num_outs=5))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'relative_position_bias_table': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'attn.scale': dict(decay_mult=0.),
    }))
