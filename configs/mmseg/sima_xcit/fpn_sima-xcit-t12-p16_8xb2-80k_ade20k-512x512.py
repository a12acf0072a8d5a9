_base_ = './fpn_sima-xcit-s12-p16_8xb2-80k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='t12',
        drop_path_rate=0.0,
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-t12-p16_in1k.pth')),
    neck=dict(in_channels=[192, 192, 192, 192], out_channels=192),
    decode_head=dict(in_channels=[192, 192, 192, 192]))
