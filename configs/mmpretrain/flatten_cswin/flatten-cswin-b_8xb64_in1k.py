# FLatten-CSwin-B on ImageNet-1k.
# Recipe: FLatten cfgs/flatten_cswin_b.yaml + config.py defaults (LeapLabTHU/FLatten-Transformer
# @ abdb115) and main_ema.py; EMA decay of the FLatten README training commands.
# 300 epochs + 10 at the final lr, batch 512 (8 GPUs x 64), AdamW lr 0.0005 (0.0005 x 512 / 512),
# weight decay 0.1, warmup 20 epochs, drop path 0.5, EMA 0.99982.
# No official ImageNet weights were released for this variant: this config produces them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.FLattenCSWin',
        arch='b',
        drop_path_rate=0.5,
        out_indices=(3,)),
    head=dict(in_channels=768))

train_dataloader = dict(batch_size=64)

optim_wrapper = dict(
    optimizer=dict(lr=0.0005, weight_decay=0.1))

# cosine to the final lr over the first 300 epochs, then 10 epochs at it
param_scheduler = [
    dict(type='LinearLR', start_factor=0.002, by_epoch=True, end=20,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-05, by_epoch=True, begin=20, end=300,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=310)
auto_scale_lr = dict(base_batch_size=512)

custom_hooks = [dict(type='EMAHook', momentum=0.00018, priority='ABOVE_NORMAL')]
