_base_ = './upernet_sima-xcit-s12-p16_8xb2-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='t12',
        drop_path_rate=0.0,
        init_cfg=dict(checkpoint='checkpoints/sima-xcit-t12-p16_in1k.pth')),
    decode_head=dict(in_channels=[192, 192, 192, 192]),
    auxiliary_head=dict(in_channels=192))
