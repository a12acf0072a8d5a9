# RetinaNet 1x with a hybrid PVTv2-b1: QuadTree-B attention in stages 1-2 (4 / 3 pyramid
# levels, top-k 32, ReLU value branches as in the official dense QuadTree models) and
# PVTv2's softmax spatial-reduction attention in stages 3-4 (reduction 2 / 1). Built from
# the generic `flatten_mm.PVTv2` skeleton through `attn_cfg`; no new class. No published
# result exists for this combination. Recipe = the official QuadTree RetinaNet 1x recipe
# (AdamW lr 1e-4, wd 1e-4, 12 epochs, steps 8/11, 1333x800, batch 16).
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
        type='flatten_mm.PVTv2',
        arch='b1',
        attn_cfg=[
            dict(type='QuadTreeAttention', attn_type='B', num_levels=4, topk=32,
                 value_act='relu'),
            dict(type='QuadTreeAttention', attn_type='B', num_levels=3, topk=32,
                 value_act='relu'),
            dict(type='SpatialReductionAttention', sr_ratio=2),
            dict(type='SpatialReductionAttention', sr_ratio=1),
        ],
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        # Partial initialisation from the official QuadTree-B-b1 ImageNet weights (by name,
        # downloaded and converted on first use): patch embeddings,
        # MLPs, norms and the stage 1-2 attention load; the stage 3-4 softmax attention
        # (q / kv / sr / norm) has no counterpart and starts from scratch: strict=False
        # (flatten_mm refuses partial matches otherwise; the missing keys are logged).
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://quadtree-b-pvt-v2-b1',
                      strict=False)),
    neck=dict(in_channels=[64, 128, 320, 512]))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))

auto_scale_lr = dict(enable=False, base_batch_size=16)
