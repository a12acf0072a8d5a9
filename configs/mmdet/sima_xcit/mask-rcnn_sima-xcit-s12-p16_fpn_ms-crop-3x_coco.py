# Mask R-CNN 3x, SimA-XCiT-S12/16 backbone. Recipe = XCiT's official dense protocol
# (facebookresearch/xcit detection/): DETR-style multi-scale + crop training, AdamW
# lr 1e-4, wd 0.05, 36 epochs with steps at 27/33, batch 8 GPUs x 2 images.
# SimA's own COCO recipe is unverified (see README.md). SyncBN in the backbone as XCiT
# (mmengine's runner reverts it to BN in single-process runs); XCiT trained with fp16:
# add `--amp` for that.
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
        type='flatten_mm.SimAXCiT',
        arch='s12',
        patch_size=16,
        drop_path_rate=0.05,
        block_indices=(3, 5, 7, 11),  # the blocks feeding fpn1..fpn4 (XCiT's out_indices)
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        # no SimA weights are released: pretrain them (configs/mmpretrain/sima_xcit), or
        # convert an ImageNet checkpoint of the official code:
        # python tools/convert_checkpoint.py sima_small_12_p16.pth \
        #     checkpoints/sima-xcit-s12-p16_in1k.pth --family sima_xcit --arch s12-p16
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/sima-xcit-s12-p16_in1k.pth')),
    neck=dict(in_channels=[384, 384, 384, 384]))

train_dataloader = dict(batch_size=2)

# XCiT: no weight decay on the LayerNorms
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
