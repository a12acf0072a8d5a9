"""Every attention operator works in every stage of the PVT skeleton (``PVTv2``).

Issue #5 §5: hybrids such as QuadTree in stages 1-2 + softmax SR in 3-4, or FLA in 1-2
+ SimA in 3-4, are configured with ``attn_cfg`` alone. Each operator is placed in each
stage position of a tiny PVTv2 (the other stages keep the default SR attention), run at
an odd, non-square size, and checked against the backbone's declared channels/strides;
gradients must reach every parameter of the placed operators.
"""
import copy

import pytest
import torch

from flatten_mm.models.backbones import PVTv2
from flatten_mm.models.backbones.pvt_hybrid import PVT_V2_SRA
from flatten_mm.models.layers import (ATTENTIONS, CrossShapedAttention, FocusedLinearAttention,
                                      FocusedLinearAttentionQKV, QuadTreeAttention,
                                      ShiftedWindowAttention, SimAAttention,
                                      SpatialReductionAttention)

TINY = dict(embed_dims=(16, 16, 32, 32), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2),
            mlp_ratios=(2, 2, 2, 2))
HW = (65, 97)  # stage grids 17x25, 9x13, 5x7, 3x4

#: name -> (config, class it must build)
OPERATORS = {
    'fla': (dict(type='FocusedLinearAttention'), FocusedLinearAttention),
    'fla-sr2': (dict(type='FocusedLinearAttention', sr_ratio=2), FocusedLinearAttention),
    'sra': (dict(type='SpatialReductionAttention', sr_ratio=2), SpatialReductionAttention),
    'sra-global': (dict(type='SpatialReductionAttention', sr_ratio=1),
                   SpatialReductionAttention),
    'sima': (dict(type='SimAAttention'), SimAAttention),
    'quadtree-b': (dict(type='QuadTreeAttention', num_levels=2, topk=2), QuadTreeAttention),
    'quadtree-a': (dict(type='QuadTreeAttention', attn_type='A', num_levels=2, topk=2),
                   QuadTreeAttention),
    'fla-qkv-global': (dict(type='FocusedLinearAttentionQKV'), FocusedLinearAttentionQKV),
    'fla-qkv-window': (dict(type='FocusedLinearAttentionQKV', window_size=4, shift=True),
                       FocusedLinearAttentionQKV),
    'swin-window': (dict(type='ShiftedWindowAttention', window_size=4, shift=True),
                    ShiftedWindowAttention),
    'cswin-stripes': (dict(type='CrossShapedAttention', split_size=2), CrossShapedAttention),
    'cswin-fla': (dict(type='CrossShapedAttention',
                       branch_cfg=dict(type='FocusedLinearQKV', lepe=True)),
                  CrossShapedAttention),
}


def test_every_registered_operator_is_covered():
    covered = {cls.__name__ for _, cls in OPERATORS.values()}
    assert covered == set(ATTENTIONS), f'untested operators: {set(ATTENTIONS) - covered}'


def test_default_is_plain_pvt_v2():
    model = PVTv2(arch=TINY, pretrain_img_size=64)
    for stage, sr in zip(model.stages, (8, 4, 2, 1)):
        attn = stage.blocks[0].attn
        assert type(attn) is SpatialReductionAttention and attn.sr_ratio == sr
    assert [c['sr_ratio'] for c in PVT_V2_SRA] == [8, 4, 2, 1]


def _check(model, placed_stages, cls):
    model.train()
    x = torch.randn(1, 3, *HW)
    outs = model(x)
    assert [o.shape[1] for o in outs] == list(model.out_channels)
    for o, s in zip(outs, model.out_strides):
        assert tuple(o.shape[-2:]) == (-(-HW[0] // s), -(-HW[1] // s))
        assert torch.isfinite(o).all()
    sum(o.square().mean() for o in outs).backward()
    for i in placed_stages:
        attn = model.stages[i].blocks[0].attn
        assert isinstance(attn, cls), f'stage {i}: {type(attn).__name__}'
        missing = [n for n, p in attn.named_parameters() if p.grad is None]
        assert not missing, f'stage {i}: no gradient for {missing}'


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
@pytest.mark.parametrize('op', sorted(OPERATORS))
def test_operator_in_stage(op, stage):
    cfg, cls = OPERATORS[op]
    attn_cfg = [dict() for _ in range(4)]  # no type: the default SR attention
    attn_cfg[stage] = copy.deepcopy(cfg)
    model = PVTv2(arch=TINY, attn_cfg=attn_cfg, pretrain_img_size=64, drop_path_rate=0.)
    for i, stage_mod in enumerate(model.stages):
        if i != stage:
            assert type(stage_mod.blocks[0].attn) is SpatialReductionAttention
    _check(model, [stage], cls)


@pytest.mark.parametrize('op', sorted(OPERATORS))
def test_operator_in_all_stages(op):
    cfg, cls = OPERATORS[op]
    model = PVTv2(arch=TINY, attn_cfg=copy.deepcopy(cfg), pretrain_img_size=64)
    _check(model, [0, 1, 2, 3], cls)


@pytest.mark.parametrize('stages12,stages34,cls12,cls34', [
    (dict(type='QuadTreeAttention', num_levels=2, topk=2), dict(),
     QuadTreeAttention, SpatialReductionAttention),
    (dict(type='FocusedLinearAttention'), dict(type='SimAAttention'),
     FocusedLinearAttention, SimAAttention),
])
def test_issue_examples(stages12, stages34, cls12, cls34):
    """The two hybrids of the issue (as in configs/*/hybrid, at a tiny size)."""
    model = PVTv2(arch=TINY, attn_cfg=[stages12, stages12, stages34, stages34],
                  pretrain_img_size=64)
    _check(model, [0, 1], cls12)
    for i in (2, 3):
        assert isinstance(model.stages[i].blocks[0].attn, cls34)
    # the stage 3-4 default keeps PVTv2's reduction ratios 2 and 1
    if cls34 is SpatialReductionAttention:
        assert [model.stages[i].blocks[0].attn.sr_ratio for i in (2, 3)] == [2, 1]
