# Mask R-CNN 3x, FLatten-Swin-T backbone (paper: 46.5 box / 42.1 mask AP). Recipe inferred
# (Swin protocol, the Swin repository's mask_rcnn_swin_tiny_..._mstrain_480-800_adamw_3x):
# the 1x config's multi-scale + crop training, AdamW lr 1e-4, weight decay 0.05 and
# batch 16, trained 36 epochs (steps 27/33), drop path 0.2.
_base_ = './mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py'

model = dict(backbone=dict(drop_path_rate=0.2))

# = configs/_base_/mmdet/schedule_3x.py (a second base may not repeat these keys)
train_cfg = dict(max_epochs=36)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=36, by_epoch=True, milestones=[27, 33], gamma=0.1)
]
