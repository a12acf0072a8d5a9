# FLatten-Swin-S on ImageNet-1k.
# Recipe: FLatten cfgs/flatten_swin_s.yaml + config.py defaults (LeapLabTHU/FLatten-Transformer @
# abdb115).
# 300 epochs, batch 1024 (8 GPUs x 128), AdamW lr 0.001 (0.0005 x 1024 / 512), weight decay 0.05,
# warmup 20 epochs, drop path 0.3, grad clip 5.
# Official weights exist (flatten_mm://flatten-swin-s, 83.5 top-1); this config reproduces them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.FLattenSwin',
        arch='s',
        drop_path_rate=0.3,
        out_indices=(3,)),
    head=dict(in_channels=768))

train_dataloader = dict(batch_size=128)

optim_wrapper = dict(
    optimizer=dict(lr=0.001),
    clip_grad=dict(max_norm=5))

# cosine to the final lr over the first 300 epochs
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=True, end=20,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-05, by_epoch=True, begin=20, end=300,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=300)
auto_scale_lr = dict(base_batch_size=1024)
