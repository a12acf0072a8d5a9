# FLatten-Swin-B on ImageNet-1k.
# Recipe: FLatten cfgs/flatten_swin_b.yaml + config.py defaults (LeapLabTHU/FLatten-Transformer @
# abdb115).
# 300 epochs, batch 512 (8 GPUs x 64), AdamW lr 0.0005 (0.0005 x 512 / 512), weight decay 0.05,
# warmup 20 epochs, drop path 0.5, grad clip 5.
# Official weights exist (flatten_mm://flatten-swin-b, 83.8 top-1); this config reproduces them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.FLattenSwin',
        arch='b',
        drop_path_rate=0.5,
        out_indices=(3,)),
    head=dict(in_channels=1024))

train_dataloader = dict(batch_size=64)

optim_wrapper = dict(
    optimizer=dict(lr=0.0005),
    clip_grad=dict(max_norm=5))

# cosine to the final lr over the first 300 epochs
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=True, end=20,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=5e-06, by_epoch=True, begin=20, end=300,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=300)
auto_scale_lr = dict(base_batch_size=512)
