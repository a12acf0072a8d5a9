# UperNet 160k, FLatten-CSwin-T, ADE20K 512x512. No published result. Recipe inferred:
# the Swin/CSWin UperNet protocol -- AdamW lr 6e-5, weight decay 0.01 (none on norms /
# FLA positional encodings / FLA `scale`), 1500-iteration linear warmup (ratio 1e-6), poly
# power 1.0, 160k iterations, batch 16 (8 GPUs x 2), FCN auxiliary head (loss 0.4) on
# stage 3, drop path 0.2 (the ImageNet pretraining value). See README.md.
_base_ = [
    'mmseg::_base_/models/upernet_swin.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenCSWin',
        arch='t',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/flatten-cswin-t_in1k.pth')),
    decode_head=dict(in_channels=[64, 128, 256, 512], num_classes=150),
    auxiliary_head=dict(in_channels=256, in_index=2, num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    clip_grad=None,
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'branches.0.scale': dict(decay_mult=0.),
        'branches.1.scale': dict(decay_mult=0.),
    }))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False)
]

train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
