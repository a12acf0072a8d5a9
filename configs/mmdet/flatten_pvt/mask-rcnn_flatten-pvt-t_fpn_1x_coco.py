# Mask R-CNN 1x, FLatten-PVT-T backbone. Recipe inferred (the paper gives none; its
# baseline row is the PVT paper's): PVT protocol -- AdamW, weight decay 1e-4, batch 16
# (8 GPUs x 2), 12 epochs (steps 8/11, 500-iteration warmup), single scale 1333x800,
# flip 0.5, pad 32, drop path 0.1. lr 2e-4 as in the PVT repository's Mask R-CNN configs
# (the PVT paper says 1e-4). See README.md.
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
        type='flatten_mm.FLattenPVT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        # the official ImageNet weights, downloaded and converted on first use; to fetch
        # them ahead (e.g. on a login node): python tools/download_weights.py flatten-pvt-t
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-pvt-t')),
    neck=dict(in_channels=[64, 128, 320, 512]))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'pos_embed': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'attn.scale': dict(decay_mult=0.),
    }))
