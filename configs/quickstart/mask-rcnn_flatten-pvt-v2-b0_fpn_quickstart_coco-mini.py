# Quick start (CPU, a few minutes): Mask R-CNN with a randomly initialised
# FLatten-PVTv2-b0 trains for 40 iterations on the 6 bundled COCO train2017 images and
# is evaluated (COCO bbox + segm mAP, pycocotools) on the 32 bundled val2017 images.
# Images are resized to at most 256x192 to keep it fast on 2 CPU cores. The metrics of such a short run
# from scratch are near zero; the point is the full pipeline on real data.
_base_ = '../mmdet/flatten_pvt_v2/mask-rcnn_flatten-pvt-v2-b0_fpn_1x_coco.py'

data_root = 'demo/data/coco_mini/'

# fewer proposals / sampled RoIs than the 1x recipe: the RoI heads dominate CPU time
model = dict(
    backbone=dict(init_cfg=None),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=1000, max_per_img=256),
        rcnn=dict(sampler=dict(num=128))),
    test_cfg=dict(
        rpn=dict(nms_pre=500, max_per_img=200),
        rcnn=dict(max_per_img=50)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(256, 192), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(256, 192), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(
    batch_size=2,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    batch_sampler=None,
    dataset=dict(
        data_root=data_root,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        filter_cfg=dict(filter_empty_gt=True, min_size=8),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        data_root=data_root,
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator

train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=40, val_interval=40)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=10),
]
optim_wrapper = dict(optimizer=dict(lr=2e-4), clip_grad=dict(max_norm=10.0, norm_type=2))
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=5),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=20, max_keep_ckpts=2))
log_processor = dict(by_epoch=False, window_size=5)
randomness = dict(seed=0)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
