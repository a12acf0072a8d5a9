# Quick start (CPU, a few minutes): Semantic FPN with a randomly initialised
# FLatten-PVTv2-b0 trains for 40 iterations on 256x256 crops of the 3 bundled ADE20K
# validation images (the only ones bundled) and is evaluated (mIoU) on the same 3 images
# at 512x256. A pipeline demo on real data, not a benchmark.
_base_ = '../mmseg/flatten_pvt_v2/fpn_flatten-pvt-v2-b0_4xb4-80k_ade20k-512x512.py'

data_root = 'demo/data/ade_mini/ADEChallengeData2016'
crop_size = (256, 256)

model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(init_cfg=None))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(512, 256), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(512, 256), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
train_dataloader = dict(
    batch_size=2,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        data_root=data_root,
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        data_root=data_root,
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader

train_cfg = dict(type='IterBasedTrainLoop', max_iters=40, val_interval=40)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=10),
]
optim_wrapper = dict(optimizer=dict(lr=3e-4))
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=5, log_metric_by_epoch=False),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=20, max_keep_ckpts=2))
log_processor = dict(by_epoch=False, window_size=5)
randomness = dict(seed=0)
env_cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend='gloo'))
