# Mask R-CNN 3x, SimA-XCiT-S12/16 backbone. Recipe = XCiT's official dense protocol
# (facebookresearch/xcit detection/): DETR-style multi-scale + crop training, AdamW
# lr 1e-4, wd 0.05, 36 epochs with steps at 27/33, batch 8 GPUs x 2 images.
# SimA's own COCO recipe is unverified (see README.md). XCiT trained with fp16 and
# SyncBN: add `--amp` and `--cfg-options model.backbone.norm_cfg.type=SyncBN` for that.
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
        type='flatten_mm.SimAXCiT',
        arch='s12',
        patch_size=16,
        drop_path_rate=0.05,
        out_indices=(3, 5, 7, 11),
        norm_cfg=dict(type='BN', requires_grad=True),
        # no SimA weights are released; convert your own ImageNet checkpoint first:
        # python tools/convert_checkpoint.py sima_small_12_p16.pth \
        #     checkpoints/sima-xcit-s12-p16_in1k.pth --family sima_xcit --arch s12-p16
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/sima-xcit-s12-p16_in1k.pth')),
    neck=dict(in_channels=[384, 384, 384, 384]))

# augmentation strategy of XCiT / Swin 3x (originates from DETR / Sparse R-CNN)
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

# XCiT: no weight decay on the LayerNorms
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))

auto_scale_lr = dict(enable=False, base_batch_size=16)
