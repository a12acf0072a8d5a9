# No published result for this combination (the paper's FLatten-Swin-S COCO row is
# Cascade Mask R-CNN 3x). Recipe of the T config (Swin protocol, multi-scale + crop);
# drop path 0.2 as Swin-S in the Swin repository's detection configs.
_base_ = './mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py'

model = dict(
    backbone=dict(
        arch='s',
        drop_path_rate=0.2,
        init_cfg=dict(checkpoint='flatten_mm://flatten-swin-s')))
