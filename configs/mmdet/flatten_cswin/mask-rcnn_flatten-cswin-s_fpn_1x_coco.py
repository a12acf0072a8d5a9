_base_ = './mask-rcnn_flatten-cswin-t_fpn_1x_coco.py'

model = dict(
    backbone=dict(
        arch='s',
        drop_path_rate=0.4,
        init_cfg=dict(checkpoint='checkpoints/flatten-cswin-s_in1k.pth')))
