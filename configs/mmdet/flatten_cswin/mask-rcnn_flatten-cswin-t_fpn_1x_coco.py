# Mask R-CNN 1x, FLatten-CSwin-T backbone (global focused linear attention in stages 1-2,
# cross-shaped 7-wide stripes in stage 3, global softmax in stage 4). No published result
# (no FLatten-CSwin downstream numbers exist; the CSWin repository has no detection
# configs). Recipe inferred: the Swin AdamW detection settings -- lr 1e-4, weight decay
# 0.05 (none on norms, FLA positional encodings and FLA `scale`), batch 16 (8 GPUs x 2) --
# on mmdet's 1x schedule (12 epochs, steps 8/11) with single-scale 1333x800 training (not
# the Swin repository's multi-scale + crop 1x pipeline); drop path = the ImageNet
# pretraining value (0.2 T, 0.4 S, 0.5 B). Not tuned.
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
        type='flatten_mm.FLattenCSWin',
        arch='t',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        # the official ImageNet weights, downloaded and converted on first use; to fetch
        # them ahead (e.g. on a login node): python tools/download_weights.py flatten-cswin-t
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-cswin-t')),
    neck=dict(in_channels=[64, 128, 256, 512]))

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
