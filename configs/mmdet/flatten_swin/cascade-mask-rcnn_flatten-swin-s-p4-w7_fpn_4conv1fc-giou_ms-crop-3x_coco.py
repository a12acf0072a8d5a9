# Cascade Mask R-CNN 3x, FLatten-Swin-S (paper: 52.2 box AP / 45.4 mask AP); drop path 0.3
_base_ = './cascade-mask-rcnn_flatten-swin-t-p4-w7_fpn_4conv1fc-giou_ms-crop-3x_coco.py'

model = dict(
    backbone=dict(
        arch='s',
        drop_path_rate=0.3,
        init_cfg=dict(checkpoint='checkpoints/flatten-swin-s_in1k.pth')))
