# RetinaNet 1x, SimA-XCiT-S12/16 backbone. Inferred recipe (neither SimA nor XCiT
# published RetinaNet runs): mmdet 1x schedule and single-scale 1333x800 pipeline with
# XCiT's AdamW settings (lr 1e-4, wd 0.05, no decay on LayerNorms), batch 8 x 2, SyncBN
# in the backbone. As mmdet's Swin RetinaNet, the FPN reads the stride-8/16/32 maps
# (`out_indices=(1, 2, 3)`, `start_level=0`, P6/P7 from the input): fpn1 (stride 4) is
# not built, so every parameter gets a gradient under DDP.
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    'mmdet::_base_/datasets/coco_detection.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm.models'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.SimAXCiT',
        arch='s12',
        patch_size=16,
        drop_path_rate=0.05,
        out_indices=(1, 2, 3),  # maps at strides 8, 16, 32 (fpn2..fpn4)
        block_indices=(3, 5, 7, 11),  # the blocks feeding fpn1..fpn4 (XCiT's out_indices)
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/sima-xcit-s12-p16_in1k.pth')),
    neck=dict(in_channels=[384, 384, 384], start_level=0, num_outs=5))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
