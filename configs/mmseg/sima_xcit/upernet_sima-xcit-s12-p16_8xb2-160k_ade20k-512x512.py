# UperNet 160k, SimA-XCiT-S12/16, ADE20K 512x512. Recipe = XCiT's official
# segmentation protocol (facebookresearch/xcit semantic_segmentation/): AdamW lr 6e-5,
# wd 0.01, 1500-iteration linear warmup (ratio 1e-6), poly decay (power 1.0), 160k
# iterations, 8 GPUs x 2 images, FCN auxiliary head on the stride-16 map. SimA's own
# ADE20K recipe is unverified (see README.md). SyncBN in the backbone as
# XCiT (mmengine's runner reverts it to BN in single-process runs).
_base_ = '../../_base_/mmseg/upernet-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.SimAXCiT',
        arch='s12',
        patch_size=16,
        drop_path_rate=0.05,
        block_indices=(3, 5, 7, 11),  # the blocks feeding fpn1..fpn4 (XCiT's out_indices)
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/sima-xcit-s12-p16_in1k.pth')),
    decode_head=dict(in_channels=[384, 384, 384, 384]),
    auxiliary_head=dict(in_channels=384))
