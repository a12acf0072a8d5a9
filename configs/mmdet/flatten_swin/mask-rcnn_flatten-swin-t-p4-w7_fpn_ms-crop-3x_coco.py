# Mask R-CNN 3x, FLatten-Swin-T backbone. Recipe inferred (Swin protocol): 36 epochs
# (steps 27/33), multi-scale training (short side 480-800, long side <= 1333) with the
# DETR-style random-crop policy, AdamW lr 1e-4, weight decay 0.05, batch 16, drop path 0.2.
_base_ = ['./mask-rcnn_flatten-swin-t-p4-w7_fpn_1x_coco.py', '../../_base_/mmdet/ms-crop-3x.py']

train_dataloader = dict(dataset=dict(pipeline={{_base_.ms_crop_train_pipeline}}))

train_cfg = dict(max_epochs={{_base_.schedule_3x_max_epochs}})
param_scheduler = {{_base_.schedule_3x}}
