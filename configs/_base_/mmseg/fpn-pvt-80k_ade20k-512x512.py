# Shared fragment: the PVT paper's Semantic FPN protocol on ADE20K 512x512, used by the
# FLatten-PVT, FLatten-PVTv2 and hybrid PVTv2 configs -- AdamW lr 1e-4, weight decay 1e-4
# (none on norms / FLA positional encodings / FLA `scale`), poly power 0.9, 80k
# iterations, batch 16 (4 GPUs x 4). Test: keep-ratio resize to 2048x512, then stretch to
# the next multiple of 32 in each dimension (`flatten_mm.AlignResize`, mmseg 0.x's
# `AlignResize` of the PVT repository's segmentation/configs/_base_/datasets/ade20k.py).
# A config using it sets `model.backbone` (with `_delete_=True`) and
# `model.neck.in_channels`, and may add `custom_keys`.
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_80k.py',
]
custom_imports = dict(imports=['flatten_mm.models', 'flatten_mm.datasets'],
                      allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
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

test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='flatten_mm.AlignResize', scale=(2048, 512), keep_ratio=True, size_divisor=32),
    # annotations are loaded after the resize: the metric compares at the original size
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
train_dataloader = dict(batch_size=4)
val_dataloader = dict(batch_size=1, dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

auto_scale_lr = dict(enable=False, base_batch_size=16)
