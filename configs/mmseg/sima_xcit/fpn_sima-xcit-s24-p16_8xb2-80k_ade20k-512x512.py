_base_ = './fpn_sima-xcit-s12-p16_8xb2-80k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='s24',
        drop_path_rate=0.1,
        block_indices=(7, 11, 15, 23),
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-s24-p16_in1k.pth')),
    neck=dict(in_channels=[384, 384, 384, 384], out_channels=384),
    decode_head=dict(in_channels=[384, 384, 384, 384]))
