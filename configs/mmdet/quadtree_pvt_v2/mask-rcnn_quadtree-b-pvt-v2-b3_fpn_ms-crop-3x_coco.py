_base_ = './mask-rcnn_quadtree-b-pvt-v2-b0_fpn_ms-crop-3x_coco.py'

model = dict(
    backbone=dict(
        arch='b3',
        init_cfg=dict(checkpoint='flatten_mm://quadtree-b-pvt-v2-b3')),
    neck=dict(in_channels=[64, 128, 320, 512]))
