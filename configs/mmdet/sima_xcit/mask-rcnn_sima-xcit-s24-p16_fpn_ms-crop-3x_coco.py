_base_ = './mask-rcnn_sima-xcit-s12-p16_fpn_ms-crop-3x_coco.py'

model = dict(
    backbone=dict(
        arch='s24',
        drop_path_rate=0.1,
        block_indices=(7, 11, 15, 23),
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-s24-p16_in1k.pth')),
    neck=dict(in_channels=[384, 384, 384, 384]))
