"""QuadTreePVTv2 with tiny archs: declared shapes, size limits, variants, training hooks."""
import math

import pytest
import torch

from flatten_mm.models import QuadTreePVTv2
from flatten_mm.models.layers import QuadTreeAttention

from conftest import assert_checkpointing_matches

TINY = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
            mlp_ratios=(2, 2, 2, 2))


def expected_shapes(model, hw, batch=1):
    return [(batch, c, math.ceil(hw[0] / s), math.ceil(hw[1] / s))
            for c, s in zip(model.out_channels, model.out_strides)]


def attn_modules(model):
    return [[blk.attn for blk in stage.blocks] for stage in model.stages]


@pytest.mark.parametrize('hw', [(227, 353), (511, 385), (192, 192), (256, 200)])
def test_shapes_follow_declared_strides(hw):
    model = QuadTreePVTv2(arch=TINY).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *hw))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, hw)
    assert all(torch.isfinite(o).all() for o in outs)


def test_detection_sized_input():
    model = QuadTreePVTv2(arch=TINY, out_indices=(1, 3)).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 800, 1333))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, (800, 1333))


@pytest.mark.parametrize('topk,side', [(32, 161), (8, 65)])  # ceil(S/32)**2 >= topk
def test_too_small_input_names_the_minimum(topk, side):
    model = QuadTreePVTv2(arch=TINY, attn_cfg=dict(topk=topk)).eval()
    assert model.min_input_size() == (side, side)
    with torch.no_grad():
        model(torch.randn(1, 3, side, side))  # the minimum works
        with pytest.raises(ValueError, match=rf'smallest square input is {side}x{side}'):
            model(torch.randn(1, 3, side - 32, side))


def test_default_and_classification_attention_settings():
    model = QuadTreePVTv2(arch=TINY)
    for levels, stage in zip((4, 3, 2, 1), attn_modules(model)):
        for attn in stage:
            assert isinstance(attn, QuadTreeAttention)
            assert (attn.attn_type, attn.num_levels, attn.topks[0], attn.value_act) == \
                ('B', levels, 32, 'relu')
    cls_model = QuadTreePVTv2(arch=TINY, attn_cfg=dict(topk=8, value_act='gelu'))
    for levels, stage in zip((4, 3, 2, 1), attn_modules(cls_model)):
        for attn in stage:
            assert (attn.num_levels, attn.topks[0], attn.value_act) == (levels, 8, 'gelu')
            if levels > 1:
                assert isinstance(attn.value_branchs[0][1], torch.nn.GELU)


def test_a_variant_by_name():
    model = QuadTreePVTv2(arch='a-b0')
    assert model.out_channels == (32, 64, 160, 256)
    assert {a.attn_type for stage in attn_modules(model) for a in stage} == {'A'}
    assert not any('value_branchs' in k or 'py_att' in k for k in model.state_dict())
    b0 = QuadTreePVTv2(arch='b0')
    assert {a.attn_type for stage in attn_modules(b0) for a in stage} == {'B'}


def test_unknown_arch_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown arch 'b9'.*a-b0, b0, b1, b2, b3, b4"):
        QuadTreePVTv2(arch='b9')


@pytest.mark.parametrize('attn_type', ['A', 'B'])
def test_gradients_reach_every_parameter(attn_type):
    model = QuadTreePVTv2(arch=TINY, attn_cfg=dict(attn_type=attn_type, topk=4),
                          drop_path_rate=0.).train()
    model.init_weights()
    outs = model(torch.randn(2, 3, 72, 104))
    sum(o.square().mean() for o in outs).backward()
    # stage 4 has one level: its level weight gets an exact zero gradient (softmax of 1
    # entry); k_proj.bias only shifts all scores of a query (zero gradient up to rounding)
    single_level = [f'stages.3.blocks.{j}.attn.py_att.weight' for j in range(TINY['depths'][3])]
    missing = [n for n, p in model.named_parameters()
               if p.grad is None or (not p.grad.any() and n not in single_level
                                     and not n.endswith('attn.k_proj.bias'))]
    assert not missing


def test_with_cp_is_output_and_gradient_identical():
    """Block checkpointing recomputes each block in the backward: same outputs and the
    same gradient for every parameter as without it."""
    ref = QuadTreePVTv2(arch=TINY, attn_cfg=dict(topk=4), drop_path_rate=0.).train()
    cp = QuadTreePVTv2(arch=TINY, attn_cfg=dict(topk=4), drop_path_rate=0., with_cp=True).train()
    cp.load_state_dict(ref.state_dict())
    assert_checkpointing_matches(ref, cp, torch.randn(1, 3, 64, 96, requires_grad=True))


def test_wrong_channel_count():
    model = QuadTreePVTv2(arch=TINY)
    with pytest.raises(ValueError, match='3 input channels.*4'):
        model(torch.randn(1, 4, 192, 192))
