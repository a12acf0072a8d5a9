"""PVT-family skeleton: FLattenPVTv2 and FLattenPVT with tiny archs."""
import math

import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models import FLattenPVT, FLattenPVTv2

from conftest import assert_checkpointing_matches

TINY = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
            mlp_ratios=(2, 2, 2, 2))
CLASSES = [FLattenPVTv2, FLattenPVT]


def expected_shapes(model, hw, batch=1):
    return [(batch, c, math.ceil(hw[0] / s), math.ceil(hw[1] / s))
            for c, s in zip(model.out_channels, model.out_strides)]


@pytest.mark.parametrize('cls', CLASSES)
@pytest.mark.parametrize('hw', [(33, 47), (64, 64), (227, 353), (17, 9)])
def test_shapes_follow_declared_strides(cls, hw):
    model = cls(arch=TINY, pretrain_img_size=64).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *hw))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, hw)


@pytest.mark.parametrize('cls', CLASSES)
@pytest.mark.parametrize('out_indices', [(0, 1, 2, 3), (1, 3), (2, )])
def test_out_indices(cls, out_indices):
    model = cls(arch=TINY, out_indices=out_indices).eval()
    outs = model(torch.randn(1, 3, 64, 96))
    assert len(outs) == len(out_indices) == len(model.out_channels)
    assert model.out_strides == tuple(4 * 2**i for i in out_indices)


@pytest.mark.parametrize('cls', CLASSES)
def test_gradients_reach_every_parameter(cls):
    model = cls(arch=TINY, drop_path_rate=0.).train()
    model.init_weights()
    outs = model(torch.randn(2, 3, 48, 80))
    sum(o.square().mean() for o in outs).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


@pytest.mark.parametrize('cls', CLASSES)
def test_with_cp_is_output_identical(cls):
    torch.manual_seed(0)
    ref = cls(arch=TINY, drop_path_rate=0.).train()
    cp = cls(arch=TINY, drop_path_rate=0., with_cp=True).train()
    cp.load_state_dict(ref.state_dict())
    assert_checkpointing_matches(ref, cp, torch.randn(1, 3, 40, 56, requires_grad=True))


def test_attention_mix_per_stage():
    """Any attention op in any stage: FLA with SR, softmax SR, PVTv2-li."""
    cfgs = [dict(sr_ratio=2),
            dict(type='SpatialReductionAttention', sr_ratio=2),
            dict(type='flatten_mm.SpatialReductionAttention', sr_ratio=1),
            dict(type='FocusedLinearAttention', kernel_size=3)]
    model = FLattenPVTv2(arch=TINY, attn_cfg=cfgs).eval()
    kinds = [type(s.blocks[0].attn).__name__ for s in model.stages]
    assert kinds == ['FocusedLinearAttention', 'SpatialReductionAttention',
                     'SpatialReductionAttention', 'FocusedLinearAttention']
    assert model.stages[0].blocks[0].attn.sr_ratio == 2
    assert model.stages[3].blocks[0].attn.dwc.kernel_size == (3, 3)
    outs = model(torch.randn(1, 3, 70, 50))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, (70, 50))


def test_linear_mode():
    model = FLattenPVTv2(arch=TINY, linear=True, pretrain_img_size=224,
                         attn_cfg=[dict(sr_ratio=s) for s in (8, 4, 2, 1)]).eval()
    outs = model(torch.randn(1, 3, 100, 60))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, (100, 60))


def test_padding_of_pvt_v1_patch_embed_is_bottom_right_zeros():
    """PVT v1's non-overlapping patch embedding zero-pads to a multiple of its stride at the
    bottom / right, as the official code: a 66x70 input gives what the explicitly padded
    68x72 input gives (stage 1 pads it; stages 2-4 pad their 17x18 / 9x9 / 5x5 maps the
    same way in both runs), not what top / left padding gives; an input that is already a
    multiple is not padded."""
    model = FLattenPVT(arch=TINY).eval()
    x = torch.randn(1, 3, 66, 70)
    with torch.no_grad():
        out = model(x)
        bottom_right = model(F.pad(x, (0, 2, 0, 2)))
        top_left = model(F.pad(x, (2, 0, 2, 0)))
    assert [tuple(o.shape) for o in out] == expected_shapes(model, (66, 70))
    for a, b in zip(out, bottom_right):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(out[0], top_left[0], atol=1e-3)
    # every stage's embedding (stride 4, then 2) on an odd map: the padded cells are the
    # last row / column, and they see the input's last pixels next to zeros
    for stage in model.stages:
        embed = stage.patch_embed
        s, c = embed.stride, embed.proj.in_channels
        m = torch.randn(1, c, 2 * s + 1, 3 * s + 1)
        with torch.no_grad():
            tokens, hw = embed(m)
            ref, ref_hw = embed(F.pad(m, (0, s - 1, 0, s - 1)))
        assert hw == ref_hw == (3, 4)
        torch.testing.assert_close(tokens, ref, rtol=0, atol=0)
        with torch.no_grad():
            unpadded, _ = embed(torch.randn(1, c, 2 * s, 3 * s))
        assert unpadded.shape == (1, 6, embed.proj.out_channels)


@pytest.mark.parametrize('bad,match', [
    (dict(arch='b9'), 'valid archs: b0, b1'),
    (dict(arch=dict(embed_dims=(8, ) * 4)), 'missing'),
    (dict(out_indices=(0, 4)), 'out_indices entry 4'),
    (dict(frozen_stages=5), r'frozen_stages must be in \[-1, 4\]'),
    (dict(attn_cfg=[dict()] * 3), 'attn_cfg has 3 entries'),
    (dict(attn_cfg=dict(type='NoSuchAttention')), 'unknown attention type'),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    with pytest.raises((ValueError, KeyError), match=match):
        FLattenPVTv2(**{'arch': TINY, **bad})


def test_wrong_input_channels():
    model = FLattenPVTv2(arch=TINY)
    with pytest.raises(ValueError, match='3 input channels, got an input with 1'):
        model(torch.randn(1, 1, 32, 32))


def test_arch_aliases_and_param_count():
    # official counts without the classification head (spec backbones.md §1.1-1.2)
    assert abs(sum(p.numel() for p in FLattenPVTv2('b0').parameters()) / 1e6 - 3.34) < 0.01
    assert abs(sum(p.numel() for p in FLattenPVT('tiny').parameters()) / 1e6 - 11.64) < 0.02
    assert FLattenPVT('t').depths == FLattenPVT('tiny').depths


@pytest.mark.parametrize('attn', ['FocusedLinearAttention', 'SpatialReductionAttention'])
def test_reduced_key_stages_declare_their_minimum_input(attn):
    """Both PVT-style attentions share the key/value reduction: with sr_ratio 4 in stage 1
    the stage map must be at least 4x4, i.e. the input at least 13x13; smaller inputs get
    a ValueError naming the operator and the minimum before any computation."""
    model = FLattenPVTv2(arch=TINY, pretrain_img_size=64, attn_cfg=[
        dict(type=attn, sr_ratio=4), dict(type=attn), dict(type=attn), dict(type=attn)]).eval()
    assert model.min_input_size() == (13, 13)
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 13, 17))
    assert [tuple(o.shape[-2:]) for o in outs] == [(4, 5), (2, 3), (1, 2), (1, 1)]
    with pytest.raises(ValueError, match=rf'{attn}: a 3x5 map is smaller than the 4x4 '
                                         r'reduction conv.*smallest square input is 13x13'):
        model(torch.randn(1, 3, 12, 17))
