# Shared fragment of the "3x, multi-scale + crop" COCO recipe (Swin / XCiT dense
# protocol: DETR-style augmentation, 36 epochs with steps at 27 and 33). The keys have
# names no mmdet base uses, so a config can list this file beside its other bases and
# pick the pieces with {{_base_.ms_crop_train_pipeline}} and {{_base_.schedule_3x}}.
ms_crop_train_pipeline = [
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

schedule_3x_max_epochs = 36
schedule_3x = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=36, by_epoch=True, milestones=[27, 33], gamma=0.1)
]
