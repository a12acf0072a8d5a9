# UperNet 160k, FLatten-CSwin-T, ADE20K 512x512. No published result. Recipe inferred:
# the Swin/CSWin UperNet protocol -- AdamW lr 6e-5, weight decay 0.01 (none on norms /
# FLA positional encodings / FLA `scale`), 1500-iteration linear warmup (ratio 1e-6), poly
# power 1.0, 160k iterations, batch 16 (8 GPUs x 2), FCN auxiliary head (loss 0.4) on
# stage 3, drop path 0.3 (CSWin's segmentation/configs/cswin/upernet_cswin_tiny.py).
# See README.md.
_base_ = '../../_base_/mmseg/upernet-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenCSWin',
        arch='t',
        drop_path_rate=0.3,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-cswin-t')),
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256))

optim_wrapper = dict(paramwise_cfg=dict(custom_keys={
    'positional_encoding': dict(decay_mult=0.),
    'branches.0.scale': dict(decay_mult=0.),
    'branches.1.scale': dict(decay_mult=0.),
}))
