# UperNet 160k, FLatten-Swin-S (paper: 48.14 mIoU); recipe of the T config, drop path 0.3
# (Swin-Seg upernet_swin_small_patch4_window7_512x512_160k_ade20k)
_base_ = './upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        arch='s',
        drop_path_rate=0.3,
        init_cfg=dict(checkpoint='flatten_mm://flatten-swin-s')))
