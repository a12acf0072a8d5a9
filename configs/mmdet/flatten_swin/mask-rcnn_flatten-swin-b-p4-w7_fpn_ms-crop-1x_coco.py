# No published result. Recipe of the T config (Swin protocol, multi-scale + crop);
# drop path 0.3 as Swin-B in the Swin repository's detection configs.
_base_ = './mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py'

model = dict(
    backbone=dict(
        arch='b',
        drop_path_rate=0.3,
        init_cfg=dict(checkpoint='flatten_mm://flatten-swin-b')),
    neck=dict(in_channels=[128, 256, 512, 1024]))
