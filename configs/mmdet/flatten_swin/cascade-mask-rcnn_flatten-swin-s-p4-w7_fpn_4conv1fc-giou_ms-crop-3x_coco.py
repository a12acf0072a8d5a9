# Cascade Mask R-CNN 3x, FLatten-Swin-S (paper: 52.2 box AP / 45.4 mask AP); recipe of the
# T config, drop path 0.2 as the Swin repository's Cascade Mask R-CNN Swin-S 3x config
_base_ = './cascade-mask-rcnn_flatten-swin-t-p4-w7_fpn_4conv1fc-giou_ms-crop-3x_coco.py'

model = dict(
    backbone=dict(
        arch='s',
        drop_path_rate=0.2,
        init_cfg=dict(checkpoint='flatten_mm://flatten-swin-s')))
