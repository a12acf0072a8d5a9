# Semantic FPN, FLatten-PVTv2-b0, ADE20K 512x512 (PVT protocol: AdamW 1e-4, wd 1e-4,
# poly 0.9, 80k iterations, batch 16; recipe inferred, see README.md).
_base_ = '../../_base_/mmseg/fpn-pvt-80k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenPVTv2',
        arch='b0',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-pvt-v2-b0')),
    neck=dict(in_channels=[32, 64, 160, 256]))
