# Shared fragment: the Swin / XCiT UperNet protocol on ADE20K 512x512, used by the
# FLatten-Swin, FLatten-CSwin and SimA-XCiT configs -- AdamW lr 6e-5, weight decay 0.01
# (none on norms; each config adds its own keys, e.g. FLA `scale` and position tables),
# 1500-iteration linear warmup (ratio 1e-6), poly power 1.0, 160k iterations, batch 16
# (8 GPUs x 2), FCN auxiliary head (loss 0.4) on input index 2. A config using it sets
# `model.backbone` (with `_delete_=True`) and the decode / auxiliary head `in_channels`.
_base_ = [
    'mmseg::_base_/models/upernet_r50.py',
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
    decode_head=dict(num_classes=150),
    auxiliary_head=dict(in_index=2, num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    clip_grad=None,
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False)
]

train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader

auto_scale_lr = dict(enable=False, base_batch_size=16)
