# FLatten-CSwin-B-384 on ImageNet-1k (384x384 fine-tuning of FLatten-CSwin-B).
# Recipe: FLatten cfgs/flatten_cswin_b_384.yaml + config.py defaults
# (LeapLabTHU/FLatten-Transformer @ abdb115) and main_ema.py.
# 20 epochs + 10 at the final lr, batch 256 (8 GPUs x 32), AdamW lr 2.5e-06 (5e-06 x 256 / 512),
# weight decay 1e-08, warmup 0 epochs, drop path 0.7, EMA 0.99982.
# No official ImageNet weights were released for this variant: this config produces them.
_base_ = ['../_base_/in1k_adamw_deit-aug.py']

model = dict(
    backbone=dict(
        type='flatten_mm.FLattenCSWin',
        arch='b-384',
        drop_path_rate=0.7,
        out_indices=(3,)),
    head=dict(in_channels=768))

# 384x384: random-resized crops for training; the test image is resized to 384 without
# a center crop (TEST.CROP False)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=384, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='RandAugment', policies='timm_increasing', num_policies=2, total_level=10,
         magnitude_level=9, magnitude_std=0.5,
         hparams=dict(pad_val=[104, 116, 124], interpolation='bicubic')),
    dict(type='RandomErasing', erase_prob=0.25, mode='rand', min_area_ratio=0.02,
         max_area_ratio=1 / 3, fill_color=[103.53, 116.28, 123.675],
         fill_std=[57.375, 57.12, 58.395]),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(384, 384), backend='pillow', interpolation='bicubic'),
    dict(type='PackInputs'),
]
train_dataloader = dict(batch_size=32, dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = dict(dataset=dict(pipeline=test_pipeline))

optim_wrapper = dict(
    optimizer=dict(lr=2.5e-06, weight_decay=1e-08))

# cosine to the final lr over the first 20 epochs, then 10 epochs at it
param_scheduler = [
    dict(type='CosineAnnealingLR', eta_min=2.5e-07, by_epoch=True, begin=0, end=20,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=30)
auto_scale_lr = dict(base_batch_size=256)

custom_hooks = [dict(type='EMAHook', momentum=0.00018, priority='ABOVE_NORMAL')]

# start from the 224 model, as the official fine-tuning does: your training of
# flatten-cswin-b_8xb64_in1k.py (no official FLatten-CSwin-B weights were released)
load_from = 'work_dirs/flatten-cswin-b_8xb64_in1k/epoch_310.pth'
