# UperNet 160k, FLatten-Swin-S (paper: 48.14 mIoU); drop path 0.3 (Swin-S protocol)
_base_ = './upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='s',
        drop_path_rate=0.3,
        init_cfg=dict(checkpoint='checkpoints/flatten-swin-s_in1k.pth')))
