# Semantic FPN 80k, SimA-XCiT-S12/16, ADE20K 512x512. Recipe = XCiT's official
# segmentation protocol (facebookresearch/xcit semantic_segmentation/): AdamW lr 6e-5,
# wd 0.01, 1500-iteration linear warmup (ratio 1e-6), poly decay (power 1.0), 80k
# iterations, 8 GPUs x 2 images, FPN neck with C output channels. SimA's own ADE20K
# recipe is unverified (see README.md). SyncBN in the backbone as
# XCiT (mmengine's runner reverts it to BN in single-process runs).
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_80k.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
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
    neck=dict(in_channels=[384, 384, 384, 384], out_channels=384),
    decode_head=dict(in_channels=[384, 384, 384, 384], num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    clip_grad=None,
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=80000, by_epoch=False)
]

train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader

auto_scale_lr = dict(enable=False, base_batch_size=16)
