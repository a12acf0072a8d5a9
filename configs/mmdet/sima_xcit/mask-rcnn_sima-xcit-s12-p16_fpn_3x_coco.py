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
    '../../_base_/mmdet/ms-crop-3x.py',
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

train_dataloader = dict(batch_size=2, dataset=dict(pipeline={{_base_.ms_crop_train_pipeline}}))

train_cfg = dict(max_epochs={{_base_.schedule_3x_max_epochs}})
param_scheduler = {{_base_.schedule_3x}}

# XCiT: no weight decay on the LayerNorms
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))

auto_scale_lr = dict(enable=False, base_batch_size=16)
