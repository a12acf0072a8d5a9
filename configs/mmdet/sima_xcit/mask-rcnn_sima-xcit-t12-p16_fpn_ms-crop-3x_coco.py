_base_ = './mask-rcnn_sima-xcit-s12-p16_fpn_ms-crop-3x_coco.py'

model = dict(
    backbone=dict(
        arch='t12',
        drop_path_rate=0.0,
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-t12-p16_in1k.pth')),
    neck=dict(in_channels=[192, 192, 192, 192]))
