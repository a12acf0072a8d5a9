"""Initialisation and dropout follow the official models (LeapLabTHU/FLatten-Transformer
@ abdb115, microsoft/CSWin-Transformer, microsoft/Swin-Transformer):

* FLatten-PVT (v1) initialises only Linear, LayerNorm and the position tables: its convs
  keep PyTorch's default init; FLatten-PVTv2 gives convs a fan-out normal init;
* FLatten-Swin applies ``pos_drop`` (``drop_rate``) after the patch embedding;
* the CSWin block applies no dropout after its attention projection;
* ``attn_drop_rate`` reaches the operators with attention dropout (softmax windows,
  LePE stripes, spatial reduction) and not the FLA stages, which have none (an explicit
  ``attn_drop`` in an FLA stage's ``attn_cfg`` is still refused).
"""
import pytest
import torch
import torch.nn as nn

from flatten_mm.models import FLattenCSWin, FLattenPVT, FLattenPVTv2, FLattenSwin
from flatten_mm.models.layers import (CrossShapedAttention, FocusedLinearAttention,
                                      FocusedLinearAttentionQKV, FocusedLinearQKV,
                                      LePEAttention, ShiftedWindowAttention,
                                      SpatialReductionAttention)

PVT_ARCH = dict(embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                mlp_ratios=(2, 2, 2, 2))
SWIN_ARCH = dict(embed_dims=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))
CSWIN_ARCH = dict(embed_dims=8, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4))


def swin(**kwargs):
    return FLattenSwin(arch=SWIN_ARCH, pretrain_img_size=64, window_size=3, **kwargs)


def cswin(**kwargs):
    return FLattenCSWin(arch=CSWIN_ARCH, pretrain_img_size=64, split_size=2, **kwargs)


def convs(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]


# --------------------------------------------------------------------------- init
def test_pvt_v1_init_leaves_convs_at_pytorch_default():
    model = FLattenPVT(arch=PVT_ARCH)
    before = {n: (m.weight.detach().clone(), m.bias.detach().clone())
              for n, m in convs(model)}
    assert any('dwc' in n for n in before) and any('patch_embed' in n for n in before)
    model.init_weights()
    for n, m in convs(model):
        assert torch.equal(m.weight, before[n][0]), n
        assert torch.equal(m.bias, before[n][1]), n
    # what the official model does initialise: linears (std 0.02, zero bias), position
    # tables (std 0.02, no longer the zeros of construction)
    fc = model.stages[0].blocks[0].mlp.fc1
    assert torch.count_nonzero(fc.bias) == 0 and 0.015 < fc.weight.std().item() < 0.025
    assert model.stages[0].pos_embed.abs().sum() > 0


def test_pvt_v2_init_gives_convs_fan_out_normal():
    torch.manual_seed(0)
    model = FLattenPVTv2(arch='b0')
    model.init_weights()
    sq_ratios = []
    for n, m in convs(model):
        k = m.kernel_size[0] * m.kernel_size[1]
        std = (2.0 / (k * m.out_channels // m.groups))**0.5
        ratio = (m.weight.detach() / std).pow(2).mean().item()  # E[w^2] / std^2 -> 1
        sq_ratios.append((ratio, m.weight.numel()))
        assert 0.7 < ratio < 1.3, (n, ratio)  # >= 288 weights per conv
        assert torch.count_nonzero(m.bias) == 0, n
    total = sum(r * c for r, c in sq_ratios) / sum(c for _, c in sq_ratios)
    assert abs(total - 1) < 0.03, total
    # PyTorch's default would give E[w^2] = 1 / (3 fan_in), far from this: e.g. the
    # stage-1 DWC (5x5, 32 channels shared) has 2/25 vs 1/75


# --------------------------------------------------------------------------- dropout
def test_swin_applies_pos_drop_after_the_patch_embedding():
    model = swin(drop_rate=0.3, drop_path_rate=0.)
    assert isinstance(model.pos_drop, nn.Dropout) and model.pos_drop.p == 0.3
    seen = []
    model.pos_drop.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    model.train()
    model(torch.randn(1, 3, 40, 40))
    (inp, out), = seen
    assert inp.shape == out.shape == (1, 100, 8)
    assert torch.count_nonzero(out == 0) > 0 and not torch.equal(inp, out)
    seen.clear()
    model.eval()
    model(torch.randn(1, 3, 40, 40))
    assert torch.equal(seen[0][0], seen[0][1])


def test_cswin_block_has_no_dropout_after_proj():
    """Official CSWinBlock: ``proj_drop`` is built but never applied."""
    model = cswin(drop_rate=0.5, drop_path_rate=0.).train()
    for i in (1, 2):  # an FLA stage and the stripe stage
        attn = model.stages[i].blocks[0].attn
        assert isinstance(attn, CrossShapedAttention)
        x = torch.randn(2, 6 * 5, attn.embed_dims)
        assert not any(isinstance(m, nn.Dropout) for m in attn.modules())
        torch.testing.assert_close(attn(x, (6, 5)), attn(x, (6, 5)), rtol=0, atol=0)


def _attn_ops(model):
    return [m for m in model.modules()
            if isinstance(m, (ShiftedWindowAttention, FocusedLinearAttentionQKV, LePEAttention,
                              FocusedLinearQKV, FocusedLinearAttention,
                              SpatialReductionAttention))]


@pytest.mark.parametrize('build,softmax_stages', [(swin, (2, 3)), (cswin, (2, 3))],
                         ids=['flatten-swin', 'flatten-cswin'])
def test_attn_drop_rate_reaches_only_softmax_stages(build, softmax_stages):
    model = build(attn_drop_rate=0.1, drop_rate=0., drop_path_rate=0.)
    for i, stage in enumerate(model.stages):
        for op in _attn_ops(stage):
            if i in softmax_stages:
                assert isinstance(op, (ShiftedWindowAttention, LePEAttention))
                assert op.attn_drop == 0.1
            else:
                assert isinstance(op, (FocusedLinearAttentionQKV, FocusedLinearQKV))
                assert not hasattr(op, 'attn_drop')
    # training runs; attention dropout makes only the softmax stages stochastic
    model.train()
    x = torch.randn(2, 3, 56, 50)
    torch.manual_seed(1)
    first = model.forward_raw(x)
    torch.manual_seed(2)
    second = model.forward_raw(x)
    for i, (a, b) in enumerate(zip(first, second)):
        if i < min(softmax_stages):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert not torch.equal(a, b), i
    sum(o.sum() for o in model(x)).backward()


def test_attn_drop_rate_in_pvt_family_skips_fla_and_reaches_sra():
    model = FLattenPVTv2(arch=PVT_ARCH, attn_drop_rate=0.1, attn_cfg=[
        dict(), dict(), dict(type='SpatialReductionAttention', sr_ratio=2), dict()])
    ops = [type(op) for op in _attn_ops(model)]
    assert ops == [FocusedLinearAttention, FocusedLinearAttention,
                   SpatialReductionAttention, FocusedLinearAttention]
    assert model.stages[2].blocks[0].attn.attn_drop == 0.1
    FLattenPVT(arch=PVT_ARCH, attn_drop_rate=0.1)  # all-FLA model builds


@pytest.mark.parametrize('build', [
    lambda: swin(attn_cfg=[dict(attn_drop=0.1), {}, {}, {}]),
    lambda: cswin(attn_cfg=[dict(attn_drop=0.1), {}, {}, {}]),
    lambda: FLattenPVTv2(arch=PVT_ARCH, attn_cfg=dict(attn_drop=0.1)),
], ids=['flatten-swin', 'flatten-cswin', 'flatten-pvt-v2'])
def test_explicit_attn_drop_on_an_fla_stage_is_refused(build):
    with pytest.raises(NotImplementedError, match='no attention.*dropout'):
        build()


@pytest.mark.parametrize('build', [swin, cswin], ids=['flatten-swin', 'flatten-cswin'])
def test_all_rates_stochastic_in_train_deterministic_in_eval(build):
    model = build(drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1)
    x = torch.randn(2, 3, 48, 40)
    model.train()
    a, b = model(x), model(x)
    assert all(not torch.equal(p, q) for p, q in zip(a, b))
    model.eval()
    with torch.no_grad():
        a, b = model(x), model(x)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
