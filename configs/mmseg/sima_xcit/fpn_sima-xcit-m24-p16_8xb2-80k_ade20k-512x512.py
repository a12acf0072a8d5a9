_base_ = './fpn_sima-xcit-s12-p16_8xb2-80k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='m24',
        drop_path_rate=0.2,
        block_indices=(7, 11, 15, 23),
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-m24-p16_in1k.pth')),
    neck=dict(in_channels=[512, 512, 512, 512], out_channels=512),
    decode_head=dict(in_channels=[512, 512, 512, 512]))
