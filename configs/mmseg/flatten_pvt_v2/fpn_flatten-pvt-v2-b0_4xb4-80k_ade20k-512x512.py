# Semantic FPN, FLatten-PVTv2-b0, ADE20K 512x512 (PVT protocol: AdamW 1e-4, wd 1e-4,
# poly 0.9, 80k iterations, batch 16; recipe inferred, see README.md).
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_80k.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenPVTv2',
        arch='b0',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/flatten-pvt-v2-b0_in1k.pth')),
    neck=dict(in_channels=[32, 64, 160, 256]),
    decode_head=dict(num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    clip_grad=None,
    paramwise_cfg=dict(custom_keys={
        'norm': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'attn.scale': dict(decay_mult=0.),
    }))
param_scheduler = [
    dict(type='PolyLR', eta_min=0.0, power=0.9, begin=0, end=80000, by_epoch=False)
]
