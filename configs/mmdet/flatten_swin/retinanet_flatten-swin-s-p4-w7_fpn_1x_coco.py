# No published result. Recipe of the T config; drop path 0.2 as Swin-S in the Swin
# repository's detection configs.
_base_ = './retinanet_flatten-swin-t-p4-w7_fpn_1x_coco.py'

model = dict(
    backbone=dict(
        arch='s',
        drop_path_rate=0.2,
        init_cfg=dict(checkpoint='flatten_mm://flatten-swin-s')))
