# UperNet 160k, FLatten-Swin-T, ADE20K 512x512 (paper: 44.82 mIoU). Recipe inferred (the
# paper gives none; its baseline rows are the Swin paper's): Swin protocol -- AdamW lr
# 6e-5, weight decay 0.01 (none on norms / relative position bias tables / FLA positional
# encodings / FLA `scale`), 1500-iteration linear warmup (ratio 1e-6), poly power 1.0,
# 160k iterations, batch 16 (8 GPUs x 2), FCN auxiliary head (loss 0.4) on stage 3,
# drop path 0.3 (Swin-Seg upernet_swin_tiny_patch4_window7_512x512_160k_ade20k). See README.md.
_base_ = '../../_base_/mmseg/upernet-160k_ade20k-512x512.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='flatten_mm.FLattenSwin',
        arch='t',
        drop_path_rate=0.3,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='flatten_mm://flatten-swin-t')),
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384))

optim_wrapper = dict(paramwise_cfg=dict(custom_keys={
    'positional_encoding': dict(decay_mult=0.),
    'relative_position_bias_table': dict(decay_mult=0.),
    'attn.scale': dict(decay_mult=0.),
}))
