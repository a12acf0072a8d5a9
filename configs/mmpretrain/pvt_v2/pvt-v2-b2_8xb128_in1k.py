# PVTv2-b2 on ImageNet-1k.
# Recipe: PVTv2 repository classification configs (whai362/PVT, v2 branch: DeiT main.py defaults,
# warmup 5, cooldown 10); drop path 0.1 (b0-b2) / 0.3 (b3-b5), clip 1.0 for b3-b5 as
# FLatten-PVTv2 (inferred where the spec does not record it).
# 300 epochs + 10 at the final lr, batch 1024 (8 GPUs x 128), AdamW lr 0.001 (0.0005 x 1024 /
# 512), weight decay 0.05, warmup 5 epochs, drop path 0.1.
# No official ImageNet weights were released for this variant: this config produces them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.PVTv2',
        arch='b2',
        drop_path_rate=0.1,
        out_indices=(3,)),
    head=dict(in_channels=512))

train_dataloader = dict(batch_size=128)

optim_wrapper = dict(
    optimizer=dict(lr=0.001))

# cosine to the final lr over the first 300 epochs, then 10 epochs at it
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=True, end=5,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-05, by_epoch=True, begin=5, end=300,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=310)
auto_scale_lr = dict(base_batch_size=1024)
