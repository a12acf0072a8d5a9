# QuadTree-B-b3 on ImageNet-1k.
# Recipe: QuadTreeAttention classification configs (Tangshitao/QuadTreeAttention @ 549a1ef:
# model, drop path, clip) over the PVT training recipe (DeiT main.py defaults: lr 5e-4 x batch /
# 512, warmup-lr 1e-6, min-lr 1e-5, warmup 5, cooldown 10).
# 300 epochs + 10 at the final lr, batch 1024 (8 GPUs x 128), AdamW lr 0.001 (0.0005 x 1024 /
# 512), weight decay 0.05, warmup 5 epochs, drop path 0.3, grad clip 1.
# Official weights exist (flatten_mm://quadtree-b-pvt-v2-b3, 83.8 top-1); this config reproduces
# them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.QuadTreePVTv2',
        arch='b3',
        attn_cfg={'topk': 8, 'value_act': 'gelu'},
        drop_path_rate=0.3,
        out_indices=(3,)),
    head=dict(in_channels=512))

train_dataloader = dict(batch_size=128)

optim_wrapper = dict(
    optimizer=dict(lr=0.001),
    clip_grad=dict(max_norm=1))

# cosine to the final lr over the first 300 epochs, then 10 epochs at it
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=True, end=5,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-05, by_epoch=True, begin=5, end=300,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=310)
auto_scale_lr = dict(base_batch_size=1024)
