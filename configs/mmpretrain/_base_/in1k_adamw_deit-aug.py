# ImageNet-1k classification with the training recipe all three papers build on (DeiT's, as
# written by mmpretrain's Swin configs): RandAugment rand-m9-mstd0.5-inc1, random erasing
# 0.25, Mixup 0.8 / CutMix 1.0, label smoothing 0.1, random-resized crops of 224 (bicubic),
# test resize 256 + center crop 224, AdamW (no weight decay on norms, biases and other 1-d
# parameters), cosine schedule. Each model's config sets its batch, learning rate, warmup,
# epochs, gradient clipping and drop path from its paper's code (see ../README.md).
_base_ = [
    'mmpretrain::_base_/datasets/imagenet_bs64_swin_224.py',
    'mmpretrain::_base_/schedules/imagenet_bs1024_adamw_swin.py',
    'mmpretrain::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

# backbone and neck: flatten_mm.models.classification describes, per family, what the
# official classifier has after its last stage
model = dict(
    type='ImageClassifier',
    neck=dict(type='GlobalAveragePooling'),
    head=dict(
        type='LinearClsHead',
        num_classes=1000,
        # the official heads' initialisation
        init_cfg=dict(type='TruncNormal', layer='Linear', std=0.02, bias=0.),
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
        cal_acc=False),
    train_cfg=dict(augments=[dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]),
)
