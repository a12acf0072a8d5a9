# FLatten-PVT-B on ImageNet-1k.
# Recipe: FLatten cfgs/flatten_pvt_b.yaml + config.py defaults (LeapLabTHU/FLatten-Transformer @
# abdb115).
# 300 epochs + 10 at the final lr, batch 256 (8 GPUs x 32), AdamW lr 0.00025 (0.0005 x 256 /
# 512), weight decay 0.05, warmup 5 epochs, drop path 0.3, grad clip 1.
# No official ImageNet weights were released for this variant: this config produces them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.FLattenPVT',
        arch='b',
        drop_path_rate=0.3,
        out_indices=(3,)),
    head=dict(in_channels=512))

train_dataloader = dict(batch_size=32)

optim_wrapper = dict(
    optimizer=dict(lr=0.00025),
    clip_grad=dict(max_norm=1),
    paramwise_cfg=dict(custom_keys={'.pos_embed': dict(decay_mult=0.0)}))

# cosine to the final lr over the first 300 epochs, then 10 epochs at it
param_scheduler = [
    dict(type='LinearLR', start_factor=0.002, by_epoch=True, end=5,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=5e-06, by_epoch=True, begin=5, end=300,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=310)
auto_scale_lr = dict(base_batch_size=256)
