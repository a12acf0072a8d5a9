# Semantic FPN 80k, ADE20K 512x512, with a hybrid PVTv2-b1: Focused Linear Attention
# (FLatten; p=3, 5x5 DWC) in stages 1-2 and SimA (softmax-free, L1-normalised q/k) in
# stages 3-4. Built from the generic `flatten_mm.PVTv2` skeleton through `attn_cfg`; no
# new class. No published result exists for this combination. Recipe = the FLatten-PVTv2
# Semantic FPN recipe (configs/_base_/mmseg/fpn-pvt-80k; PVT protocol: AdamW 1e-4, wd 1e-4,
# poly 0.9, 80k iterations, batch 16).
_base_ = '../../_base_/mmseg/fpn-pvt-80k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.PVTv2',
        arch='b1',
        attn_cfg=[
            dict(type='FocusedLinearAttention', focusing_factor=3, kernel_size=5),
            dict(type='FocusedLinearAttention', focusing_factor=3, kernel_size=5),
            dict(type='SimAAttention'),
            dict(type='SimAAttention'),
        ],
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        # Partial initialisation from FLatten-PVTv2-b1 ImageNet weights (none are released:
        # pretrain them with configs/mmpretrain/flatten_pvt_v2/flatten-pvt-v2-b1_8xb128_in1k.py
        # and load the classifier with prefix='backbone.', docs/user_guides/pretrain.md): patch
        # embeddings, MLPs, norms and the stage 1-2 attention load; in stages 3-4 only
        # the output projection `proj` has a counterpart, SimA's `qkv` starts from scratch:
        # strict=False (flatten_mm refuses partial matches otherwise; missing keys logged).
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/flatten-pvt-v2-b1_in1k.pth',
                      strict=False)),
    neck=dict(in_channels=[64, 128, 320, 512]))
