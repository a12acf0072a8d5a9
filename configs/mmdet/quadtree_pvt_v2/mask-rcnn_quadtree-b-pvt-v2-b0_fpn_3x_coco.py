# Mask R-CNN 3x, QuadTree-B-PVTv2-b0 backbone. Recipe of the official config
# (detection/configs/quadtree/mask_rcnn_quadtree_b0_fpn_3x_coco.py; no published numbers):
# AdamW lr 1e-4, wd 0.05 with no decay on norms, 36 epochs (steps 27/33, 500-iteration
# warmup), flip 0.5 + the DETR-style multi-scale / crop augmentation, pad 32,
# 2 images per GPU (8 GPUs assumed), no fp16.
_base_ = ['./mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco.py', '../../_base_/mmdet/ms-crop-3x.py']

train_dataloader = dict(batch_size=2, dataset=dict(pipeline={{_base_.ms_crop_train_pipeline}}))

train_cfg = dict(max_epochs={{_base_.schedule_3x_max_epochs}})
param_scheduler = {{_base_.schedule_3x}}

# official: decay_mult 0 for keys containing absolute_pos_embed, relative_position_bias_table
# or norm; only 'norm' exists in this backbone
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
