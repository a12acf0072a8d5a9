_base_ = './retinanet_flatten-cswin-t_fpn_1x_coco.py'

model = dict(
    backbone=dict(
        arch='b',
        drop_path_rate=0.5,
        init_cfg=dict(checkpoint='checkpoints/flatten-cswin-b_in1k.pth')),
    neck=dict(in_channels=[192, 384, 768]))
