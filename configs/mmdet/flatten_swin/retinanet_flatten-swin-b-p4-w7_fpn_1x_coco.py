# No published result. Recipe of the T config; drop path 0.3 as Swin-B in the Swin
# repository's detection configs.
_base_ = './retinanet_flatten-swin-t-p4-w7_fpn_1x_coco.py'

model = dict(
    backbone=dict(
        arch='b',
        drop_path_rate=0.3,
        init_cfg=dict(checkpoint='flatten_mm://flatten-swin-b')),
    neck=dict(in_channels=[256, 512, 1024]))
