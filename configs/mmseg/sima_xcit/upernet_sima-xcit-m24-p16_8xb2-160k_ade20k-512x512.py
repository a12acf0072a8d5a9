_base_ = './upernet_sima-xcit-s12-p16_8xb2-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='m24',
        drop_path_rate=0.15,
        block_indices=(7, 11, 15, 23),
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-m24-p16_in1k.pth')),
    decode_head=dict(in_channels=[512, 512, 512, 512]),
    auxiliary_head=dict(in_channels=512))
