# SimA-XCiT-t12-p8 on ImageNet-1k.
# Recipe: SimA README (UCDvision/sima: 8 GPUs x 128, 400 epochs, AdamW lr 5e-4 x batch / 512, wd
# 0.05, warmup 5, AMP, repeated augmentation; DeiT main.py for the rest); drop path: XCiT's
# per-size value (facebookresearch/xcit).
# 400 epochs + 10 at the final lr, batch 1024 (8 GPUs x 128), AdamW lr 0.001 (0.0005 x 1024 /
# 512), weight decay 0.05, warmup 5 epochs, drop path 0, AMP, repeated augmentation.
# No official ImageNet weights were released for this variant: this config produces them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.SimAXCiT',
        arch='t12',
        patch_size=8,
        drop_path_rate=0.0,
        out_indices=(1,),
        block_indices=(11, 11, 11, 11)),
    neck=dict(
        type='flatten_mm.SimAClassAttentionNeck',
        embed_dims=192,
        num_heads=4,
        layer_scale_init_value=1.0,
        tokens_norm=True),
    head=dict(in_channels=192))

train_dataloader = dict(batch_size=128, sampler=dict(type='RepeatAugSampler', shuffle=True))

optim_wrapper = dict(
    type='AmpOptimWrapper',
    optimizer=dict(lr=0.001),
    paramwise_cfg=dict(custom_keys={'.cls_token': dict(decay_mult=0.0)}),
    loss_scale='dynamic')

# cosine to the final lr over the first 400 epochs, then 10 epochs at it
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=True, end=5,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-05, by_epoch=True, begin=5, end=400,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=410)
auto_scale_lr = dict(base_batch_size=1024)
