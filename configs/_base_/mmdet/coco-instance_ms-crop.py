# Shared fragment: COCO instance data with the multi-scale + crop training pipeline of the
# Swin / XCiT dense protocol (the Swin repository's `mstrain_480-800` configs and mmdet's
# `mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco`): flip 0.5, then one of two policies --
# (a) resize the short side to one of 480, 512, ..., 800 (long side <= 1333), or
# (b) resize the short side to 400 / 500 / 600, random absolute crop 384-600, then (a).
# It is a complete dataset base (mmdet's coco_instance.py with `train_pipeline` replaced):
# list it in `_base_` *instead of* 'mmdet::_base_/datasets/coco_instance.py'. The schedule
# (1x or 3x) is chosen separately.
_base_ = 'mmdet::_base_/datasets/coco_instance.py'

train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None),
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
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
