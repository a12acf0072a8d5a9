# Mask R-CNN 3x, QuadTree-B-PVTv2-b0 backbone. Recipe of the official config
# (detection/configs/quadtree/mask_rcnn_quadtree_b0_fpn_3x_coco.py; no published numbers):
# AdamW lr 1e-4, wd 0.05 with no decay on norms, 36 epochs (steps 27/33, 500-iteration
# warmup), flip 0.5 + the DETR-style multi-scale / crop augmentation, pad 32,
# 2 images per GPU (8 GPUs assumed), no fp16.
_base_ = './mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco.py'

train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    dict(
        type='RandomChoice',
        transforms=[[
            dict(
                type='RandomChoiceResize',
                scales=[(480, 1333), (512, 1333), (544, 1333), (576, 1333), (608, 1333),
                        (640, 1333), (672, 1333), (704, 1333), (736, 1333), (768, 1333),
                        (800, 1333)],
                keep_ratio=True)
        ], [
            dict(
                type='RandomChoiceResize',
                scales=[(400, 1333), (500, 1333), (600, 1333)],
                keep_ratio=True),
            dict(
                type='RandomCrop',
                crop_type='absolute_range',
                crop_size=(384, 600),
                allow_negative_crop=True),
            dict(
                type='RandomChoiceResize',
                scales=[(480, 1333), (512, 1333), (544, 1333), (576, 1333), (608, 1333),
                        (640, 1333), (672, 1333), (704, 1333), (736, 1333), (768, 1333),
                        (800, 1333)],
                keep_ratio=True)
        ]]),
    dict(type='PackDetInputs')
]
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))

max_epochs = 36
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(
        type='MultiStepLR',
        begin=0,
        end=max_epochs,
        by_epoch=True,
        milestones=[27, 33],
        gamma=0.1)
]

# official: decay_mult 0 for keys containing absolute_pos_embed, relative_position_bias_table
# or norm; only 'norm' exists in this backbone
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
