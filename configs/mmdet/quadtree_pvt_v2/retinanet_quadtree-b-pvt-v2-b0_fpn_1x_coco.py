# RetinaNet 1x, QuadTree-B-PVTv2-b0 backbone. Recipe of the official config
# (Tangshitao/QuadTreeAttention detection/configs/quadtree/retinanet_quadtree_b0_fpn_1x_coco.py):
# AdamW lr 1e-4, wd 1e-4 on all parameters (the official config has no paramwise rules),
# no grad clip, 12 epochs (steps 8/11, 500-iteration warmup), 1333x800, flip 0.5, pad 32,
# 2 images per GPU (8 GPUs assumed); backbone top-k 32, ReLU value branches, drop path 0.1.
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
        type='flatten_mm.QuadTreePVTv2',
        arch='b0',
        attn_cfg=dict(topk=32, value_act='relu'),  # official dense setting (also the default)
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        # the official ImageNet weights, downloaded and converted on first use; to fetch
        # them ahead (e.g. on a login node): python tools/download_weights.py quadtree-b-pvt-v2-b0
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://quadtree-b-pvt-v2-b0')),
    neck=dict(in_channels=[32, 64, 160, 256]))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4))

auto_scale_lr = dict(enable=False, base_batch_size=16)
