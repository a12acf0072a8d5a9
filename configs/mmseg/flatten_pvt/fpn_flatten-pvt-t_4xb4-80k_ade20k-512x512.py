# Semantic FPN, FLatten-PVT-T, ADE20K 512x512 (paper: 37.21 mIoU). Recipe inferred (the
# paper gives none; its baseline row is the PVT paper's): PVT paper protocol -- AdamW
# lr 1e-4, weight decay 1e-4 (none on norms / position tables / FLA `scale`), poly power
# 0.9, 80k iterations, batch 16 (4 GPUs x 4), drop path 0.1; test: keep-ratio resize to
# 2048x512 then AlignResize to multiples of 32. See README.md.
_base_ = '../../_base_/mmseg/fpn-pvt-80k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenPVT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-pvt-t')),
    neck=dict(in_channels=[64, 128, 320, 512]))

# PVT (v1) keeps absolute position tables as `pos_embed`
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'pos_embed': dict(decay_mult=0.)}))
