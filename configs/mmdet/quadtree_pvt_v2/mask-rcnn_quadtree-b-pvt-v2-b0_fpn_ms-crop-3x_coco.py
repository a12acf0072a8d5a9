# Mask R-CNN 3x, QuadTree-B-PVTv2-b0 backbone. Recipe of the official config
# (detection/configs/quadtree/mask_rcnn_quadtree_b0_fpn_3x_coco.py; no published numbers):
# AdamW lr 1e-4, wd 0.05 with no decay on norms, 36 epochs (steps 27/33, 500-iteration
# warmup), flip 0.5 + the DETR-style multi-scale / crop augmentation, pad 32,
# 2 images per GPU (8 GPUs assumed), no fp16; backbone as the 1x config (top-k 32, ReLU
# value branches, drop path 0.1).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    '../../_base_/mmdet/coco-instance_ms-crop.py',
    '../../_base_/mmdet/schedule_3x.py',
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
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://quadtree-b-pvt-v2-b0')),
    neck=dict(in_channels=[32, 64, 160, 256]))

train_dataloader = dict(batch_size=2)

# official: decay_mult 0 for keys containing absolute_pos_embed, relative_position_bias_table
# or norm; only 'norm' exists in this backbone
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
