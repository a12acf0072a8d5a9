_base_ = './mask-rcnn_sima-xcit-s12-p16_fpn_ms-crop-3x_coco.py'

model = dict(
    backbone=dict(
        arch='m24',
        drop_path_rate=0.15,
        block_indices=(7, 11, 15, 23),
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-m24-p16_in1k.pth')),
    neck=dict(in_channels=[512, 512, 512, 512]))
