_base_ = './fpn_quadtree-b-pvt-v2-b0_8xb2-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='b2',
        init_cfg=dict(checkpoint='flatten_mm://quadtree-b-pvt-v2-b2')),
    neck=dict(in_channels=[64, 128, 320, 512]))
