_base_ = './mask-rcnn_sima-xcit-s12-p16_fpn_ms-crop-3x_coco.py'

# patch 8: stride-8 tokens (4x the tokens of p16); fpn1 = one deconv, fpn2 = identity
model = dict(
    backbone=dict(
        patch_size=8,
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-s12-p8_in1k.pth')))
