# Mask R-CNN 1x, FLatten-Swin-T backbone (global focused linear attention in stages 1-2,
# 7x7 shifted windows in stages 3-4). Recipe inferred (the paper gives none; its baseline
# row, 43.7 box / 39.8 mask AP, is the Swin repository's
# mask_rcnn_swin_tiny_patch4_window7_mstrain_480-800_adamw_1x_coco): Swin protocol --
# multi-scale training (short side 480-800, long side <= 1333) with the DETR-style
# random-crop policy, AdamW lr 1e-4, weight decay 0.05 (none on norms, relative position
# bias tables, FLA positional encodings and FLA `scale`), batch 16 (8 GPUs x 2),
# 12 epochs (steps 8/11), single-scale test 1333x800, drop path 0.1.
# See README.md (training recipe).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    '../../_base_/mmdet/coco-instance_ms-crop.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenSwin',
        arch='t',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        # the official ImageNet weights, downloaded and converted on first use; to fetch
        # them ahead (e.g. on a login node): python tools/download_weights.py flatten-swin-t
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-swin-t')),
    neck=dict(in_channels=[96, 192, 384, 768]))

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
