# Semantic FPN 160k, QuadTree-B-PVTv2-b0, ADE20K 512x512. Recipe of the official config
# (Tangshitao/QuadTreeAttention segmentation/configs/sem_fpn/quadtree/
# fpn_pvt_v2_b0_quadtree_ade20k_160k.py): AdamW lr 6e-5, wd 0.01 (none on norms, 10x lr on
# the decode head), 1500-iteration linear warmup (ratio 1e-6), poly decay power 1.0,
# 160k iterations, 2 images per GPU (8 GPUs assumed); backbone top-k 32, ReLU value
# branches, drop path 0.1.
#
# Test time: as the official pipeline, a keep-ratio resize to (2048, 512) followed by a
# stretch to the next multiple of 32 (mmseg 0.x ``AlignResize``, here
# ``flatten_mm.AlignResize``).
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]
custom_imports = dict(imports=['flatten_mm.models', 'flatten_mm.datasets'],
                      allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
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
    neck=dict(in_channels=[32, 64, 160, 256]),
    decode_head=dict(num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    clip_grad=None,
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'head': dict(lr_mult=10.),
    }))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False)
]

test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='flatten_mm.AlignResize', scale=(2048, 512), keep_ratio=True, size_divisor=32),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1, dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

auto_scale_lr = dict(enable=False, base_batch_size=16)
