"""FLattenSwin with tiny archs: output contract, any input size, gradients, checkpointing,
freezing, arguments, pretrained loading, positional-table bookkeeping and autocast."""
import math

import pytest
import torch

import flatten_mm.models.layers.focused_linear_attention as fla_module
from flatten_mm.models import FLattenSwin
from flatten_mm.models.layers import FocusedLinearAttentionQKV, ShiftedWindowAttention
from flatten_mm.parity import find_adapter

from conftest import requires_shared, shared_fixtures

TINY = dict(embed_dims=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))


def build(**kwargs):
    kwargs.setdefault('arch', TINY)
    kwargs.setdefault('pretrain_img_size', 64)
    kwargs.setdefault('window_size', 4)
    return FLattenSwin(**kwargs)


def perturb(model):
    """Zero-initialised tables (FLA scale / positional encoding) get noise."""
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('.scale', '.positional_encoding')):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def expected_shapes(model, hw, batch=1):
    return [(batch, c, math.ceil(hw[0] / s), math.ceil(hw[1] / s))
            for c, s in zip(model.out_channels, model.out_strides)]


@pytest.mark.parametrize('hw', [(33, 47), (224, 224), (227, 353), (511, 385), (1, 1), (5, 3)])
def test_shapes_follow_declared_strides(hw):
    model = build().eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *hw))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, hw)
    assert all(torch.isfinite(o).all() for o in outs)


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


@pytest.mark.parametrize('out_indices', [(0, 1, 2, 3), (1, 3), (2, )])
def test_out_indices_select_normalised_maps(out_indices):
    full = perturb(build()).eval()
    part = build(out_indices=out_indices).eval()
    part.load_state_dict(full.state_dict(), strict=False)
    assert {n.split('.')[0] for n in part.state_dict() if n[:4] == 'norm'} == \
        {f'norm{i}' for i in out_indices}
    x = torch.randn(1, 3, 70, 50)
    with torch.no_grad():
        ref, outs = full(x), part(x)
    assert len(outs) == len(out_indices) == len(part.out_channels)
    for o, i in zip(outs, out_indices):
        torch.testing.assert_close(o, ref[i])
    assert part.out_strides == tuple(4 * 2**i for i in out_indices)


def test_raw_stage_outputs_are_before_output_norms():
    model = perturb(build()).eval()
    x = torch.randn(2, 3, 64, 40)
    with torch.no_grad():
        raw, outs = model.forward_raw(x), model(x)
    for i, (r, o) in enumerate(zip(raw, outs)):
        norm = getattr(model, f'norm{i}')
        expected = norm(r.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        torch.testing.assert_close(o, expected)


def test_gradients_reach_every_parameter():
    model = perturb(build(drop_path_rate=0.)).train()
    outs = model(torch.randn(2, 3, 160, 96))  # stage 3 is 10x6: several shifted windows
    sum(o.square().mean() for o in outs).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def test_with_cp_is_output_identical():
    ref = perturb(build(drop_path_rate=0.)).train()
    cp = build(drop_path_rate=0., with_cp=True).train()
    cp.load_state_dict(ref.state_dict())
    x = torch.randn(1, 3, 72, 56, requires_grad=True)
    out_ref, out_cp = ref(x), cp(x)
    for a, b in zip(out_ref, out_cp):
        torch.testing.assert_close(a, b)
    sum(o.sum() for o in out_cp).backward()
    g_cp = {n: p.grad.clone() for n, p in cp.named_parameters()}
    sum(o.sum() for o in out_ref).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, g_cp[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('frozen', [-1, 0, 2])
def test_frozen_stages(frozen):
    model = build(frozen_stages=frozen)
    model.train()
    assert {p.requires_grad for p in model.patch_embed.parameters()} == {frozen < 0}
    for i, stage in enumerate(model.stages):
        trainable = i > frozen
        assert {p.requires_grad for p in stage.parameters()} == {trainable}
        assert stage.training == trainable
        norm = getattr(model, f'norm{i}')
        assert {p.requires_grad for p in norm.parameters()} == {trainable}


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


def test_positional_tables_are_used_as_stored_at_the_pretraining_size(monkeypatch):
    """At the pretraining grid the stored table is used as is (no interpolation call);
    at other grids it is resized from the stored grid to the map's grid."""
    import flatten_mm.models.layers.pos_embed as pe_module
    calls = []
    original = pe_module.resize_pos_table

    def spy(table, src, dst, mode='bilinear'):
        calls.append((tuple(src), tuple(dst)))
        return original(table, src, dst, mode)

    monkeypatch.setattr(pe_module, 'resize_pos_table', spy)
    monkeypatch.setattr(fla_module, 'resize_pos_table', spy)
    model = build().eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    assert calls == []
    calls.clear()
    with torch.no_grad():
        model(torch.randn(1, 3, 100, 36))
    assert calls == [((16, 16), (25, 9))] * 2 + [((8, 8), (13, 5))] * 2


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
    with pytest.raises(ValueError, match='frozen_stages'):
        build(frozen_stages=4)
    model = build()
    with pytest.raises(ValueError, match='3 input channels.*4'):
        model(torch.randn(1, 4, 32, 32))
    with pytest.raises(ValueError, match='at least 1x1'):
        model(torch.randn(1, 3, 0, 32))
    with pytest.raises(ValueError, match=r'\(B, C, H, W\)'):
        model(torch.randn(3, 32, 32))


def test_pretrained_init_cfg_roundtrip(tmp_path):
    src = perturb(build())
    path = str(tmp_path / 'converted.pth')
    torch.save({'state_dict': src.state_dict()}, path)
    dst = build(init_cfg=dict(type='Pretrained', checkpoint=path))
    dst.init_weights()
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v)


def test_bf16_autocast_large_input_close_to_fp32():
    model = perturb(build(arch=dict(embed_dims=8, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4)),
                          pretrain_img_size=224, window_size=7)).eval()
    x = torch.randn(1, 3, 1024, 1024)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = model(x)
    for o, r in zip(out, ref):
        assert torch.isfinite(o).all()
        # bf16 has 8 mantissa bits: ~1% of the output range after 5 blocks
        assert (o.float() - r).abs().max() <= 3e-2 * r.abs().max()


@requires_shared()
@pytest.mark.parametrize('path', shared_fixtures('flatten_swin_*.pt') or ['missing'])
def test_float64_parity_with_official(path):
    """In float64 the converted model reproduces the official float64 stage outputs to
    rounding (the float32 check is tools/check_parity.py / tests/test_parity.py)."""
    if path == 'missing':
        pytest.skip('no flatten_swin fixtures')
    fx = torch.load(path, weights_only=True)
    adapter = find_adapter(fx)
    model = adapter.build(fx)
    adapter.load(model, adapter.convert(fx), adapter.dense_only_prefixes)
    model = model.double().eval()
    with torch.no_grad():
        outs = adapter.stage_outputs(model, fx['input'].double())
    for out, ref in zip(outs, fx['stage_outputs_f64']):
        torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
