"""FLattenSwin specifics with tiny archs: default LLSS attention, windowed linear stages,
per-stage attention, the arch table and argument / input errors. Behaviour shared with
FLattenCSWin is in test_doubling_stage_backbones.py."""
import math

import pytest
import torch

from flatten_mm.models import FLattenSwin
from flatten_mm.models.layers import FocusedLinearAttentionQKV, ShiftedWindowAttention

TINY = dict(embed_dims=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))


def build(**kwargs):
    kwargs.setdefault('arch', TINY)
    kwargs.setdefault('pretrain_img_size', 64)
    kwargs.setdefault('window_size', 4)
    return FLattenSwin(**kwargs)


def expected_shapes(model, hw, batch=1):
    return [(batch, c, math.ceil(hw[0] / s), math.ceil(hw[1] / s))
            for c, s in zip(model.out_channels, model.out_strides)]


def test_declared_contract_and_default_attention():
    model = build()
    assert model.out_channels == (8, 16, 32, 64)
    assert model.out_strides == (4, 8, 16, 32)
    kinds = [type(s.blocks[0].attn) for s in model.stages]
    assert kinds == [FocusedLinearAttentionQKV] * 2 + [ShiftedWindowAttention] * 2  # LLSS
    assert model.stages[0].blocks[0].attn.window_size is None  # global linear stages
    assert model.stages[0].blocks[0].attn.pe_hw_shape == (16, 16)  # stage grid at 64
    assert model.stages[1].blocks[0].attn.pe_hw_shape == (8, 8)
    assert [b.attn.shift for b in model.stages[2].blocks] == [False, True]
    assert model.stages[2].blocks[0].attn.window_size == 4


def test_windowed_linear_stages_option():
    """Official window_size=7 models: FLA inside shifted windows (no mask)."""
    model = build(attn_cfg=[dict(window_size=4), dict(window_size=4), {}, {}]).eval()
    attn = model.stages[0].blocks[1].attn
    assert (attn.window_size, attn.shift, attn.pe_hw_shape) == (4, True, (4, 4))
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 45, 70))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, (45, 70))


def test_any_attention_in_any_stage():
    softmax = dict(type='ShiftedWindowAttention')
    linear = dict(type='flatten_mm.FocusedLinearAttentionQKV', window_size=None)
    model = build(attn_cfg=[softmax, linear, linear, softmax]).eval()
    assert isinstance(model.stages[2].blocks[0].attn, FocusedLinearAttentionQKV)
    with torch.no_grad():
        assert len(model(torch.randn(1, 3, 50, 30))) == 4


def test_arch_zoo():
    b384 = FLattenSwin(arch='base-384', out_indices=(3, ))
    assert b384.window_size == 12 and b384.pretrain_img_size == (384, 384)
    assert b384.stages[0].blocks[0].attn.pe_hw_shape == (96, 96)
    assert b384.stages[2].blocks[0].attn.relative_position_bias_table.shape == (23 * 23, 16)
    assert b384.out_channels == (1024, )
    for name in ('t', 'tiny', 's', 'small', 'b', 'base', 'b-384'):
        assert name in FLattenSwin.arch_zoo


def test_bad_arguments_and_inputs():
    with pytest.raises(ValueError, match='valid archs'):
        FLattenSwin(arch='huge')
    with pytest.raises(ValueError, match='exactly the keys'):
        FLattenSwin(arch=dict(embed_dims=8, depths=(1, 1, 1, 1)))
    with pytest.raises(ValueError, match='4 entries'):
        FLattenSwin(arch=dict(embed_dims=8, depths=(1, 1, 1), num_heads=(1, 1, 1)))
    with pytest.raises(ValueError, match='out of range'):
        build(out_indices=(4, ))
    with pytest.raises(ValueError, match=r'frozen_stages must be in \[-1, 4\]'):
        build(frozen_stages=5)
    model = build()
    with pytest.raises(ValueError, match='3 input channels.*4'):
        model(torch.randn(1, 4, 32, 32))
    with pytest.raises(ValueError, match='at least 1x1'):
        model(torch.randn(1, 3, 0, 32))
    with pytest.raises(ValueError, match=r'\(B, C, H, W\)'):
        model(torch.randn(3, 32, 32))
