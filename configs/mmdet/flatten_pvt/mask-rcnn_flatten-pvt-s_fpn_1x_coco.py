_base_ = './mask-rcnn_flatten-pvt-t_fpn_1x_coco.py'

model = dict(
    backbone=dict(
        arch='small',
        init_cfg=dict(checkpoint='checkpoints/flatten-pvt-s_in1k.pth')))
