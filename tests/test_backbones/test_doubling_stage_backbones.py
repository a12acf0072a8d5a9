"""Behaviour shared by the doubling-width four-stage backbones (FLattenSwin, FLattenCSWin;
``DoublingStageBackbone``), tested on tiny archs of each: output contract at any input
size, out_indices / output norms, gradients, checkpointing, positional-table
bookkeeping, pretrained loading, autocast and float64 parity with the official code
(``frozen_stages``: test_freezing_and_loading.py, every family). Family-specific
structure is tested in ``test_flatten_swin.py`` / ``test_flatten_cswin.py``."""
import math
from typing import NamedTuple, Tuple

import pytest
import torch

import flatten_mm.models.layers.focused_linear_attention as fla_module
from flatten_mm.models import FLattenCSWin, FLattenSwin
from dev.parity import find_adapter

from conftest import assert_checkpointing_matches, requires_shared, shared_fixtures


class Family(NamedTuple):
    cls: type
    tiny: dict  # arch of the tiny model
    geometry: dict  # tiny pretraining grid and window / stripe width
    norm_offset: int  # stage i is normalised by `norm{i + norm_offset}`
    grad_hw: Tuple[int, int]  # input for the gradient test
    pe_calls: list  # positional-table resizes of the tiny model at a 100x36 input
    bf16_arch: dict  # realistic widths (of the -T variant), fewer blocks: see the bf16 test
    released_geometry: dict  # the official 224 grid and window / stripe width
    fixtures: str  # golden fixture pattern in ../shared/fixtures


FAMILIES = {
    'flatten-swin': Family(
        FLattenSwin, dict(embed_dims=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)),
        dict(pretrain_img_size=64, window_size=4), 0,
        (160, 96),  # stage 3 is 10x6: several shifted windows
        [((16, 16), (25, 9))] * 2 + [((8, 8), (13, 5))] * 2,
        dict(embed_dims=96, depths=(1, 1, 2, 1), num_heads=(3, 6, 12, 24)),
        dict(pretrain_img_size=224, window_size=7), 'flatten_swin_*.pt'),
    'flatten-cswin': Family(
        FLattenCSWin, dict(embed_dims=8, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4)),
        dict(pretrain_img_size=64, split_size=2), 1,
        (112, 80),
        [((16, 16), (25, 9))] * 1 + [((8, 8), (13, 5))] * 2,
        dict(embed_dims=64, depths=(1, 1, 2, 1), num_heads=(2, 4, 8, 16)),
        dict(pretrain_img_size=224, split_size=7), 'flatten_cswin_*.pt'),
}
family_param = pytest.mark.parametrize('fam', list(FAMILIES.values()), ids=list(FAMILIES))


def build(fam: Family, **kwargs):
    kwargs.setdefault('arch', fam.tiny)
    for k, v in fam.geometry.items():
        kwargs.setdefault(k, v)
    return fam.cls(**kwargs)


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


def output_norm(model, fam: Family, i: int):
    return getattr(model, f'norm{i + fam.norm_offset}')


@family_param
@pytest.mark.parametrize('hw', [(33, 47), (224, 224), (227, 353), (511, 385), (1, 1), (5, 3),
                                (225, 226)])
def test_shapes_follow_declared_strides(fam, hw):
    model = build(fam).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *hw))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, hw)
    assert all(torch.isfinite(o).all() for o in outs)


@family_param
@pytest.mark.parametrize('out_indices', [(0, 1, 2, 3), (1, 3), (2, )])
def test_out_indices_select_normalised_maps(fam, out_indices):
    full = perturb(build(fam)).eval()
    part = build(fam, out_indices=out_indices).eval()
    part.load_state_dict(full.state_dict(), strict=False)
    assert {n.split('.')[0] for n in part.state_dict() if n[:4] == 'norm'} == \
        {f'norm{i + fam.norm_offset}' for i in out_indices}
    x = torch.randn(1, 3, 70, 50)
    with torch.no_grad():
        ref, outs = full(x), part(x)
    assert len(outs) == len(out_indices) == len(part.out_channels)
    for o, i in zip(outs, out_indices):
        torch.testing.assert_close(o, ref[i])
    assert part.out_strides == tuple(4 * 2**i for i in out_indices)


@family_param
def test_raw_stage_outputs_are_before_output_norms(fam):
    model = perturb(build(fam)).eval()
    x = torch.randn(2, 3, 64, 40)
    with torch.no_grad():
        raw, outs = model.forward_raw(x), model(x)
    for i, (r, o) in enumerate(zip(raw, outs)):
        norm = output_norm(model, fam, i)
        torch.testing.assert_close(o, norm(r.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


@family_param
def test_gradients_reach_every_parameter(fam):
    model = perturb(build(fam, drop_path_rate=0.)).train()
    outs = model(torch.randn(2, 3, *fam.grad_hw))
    sum(o.square().mean() for o in outs).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


@family_param
def test_with_cp_is_output_identical(fam):
    ref = perturb(build(fam, drop_path_rate=0.)).train()
    cp = build(fam, drop_path_rate=0., with_cp=True).train()
    cp.load_state_dict(ref.state_dict())
    assert_checkpointing_matches(ref, cp, torch.randn(1, 3, 72, 56, requires_grad=True))


@family_param
def test_positional_tables_are_used_as_stored_at_the_pretraining_size(fam, monkeypatch):
    """At the pretraining grid the stored table is used as is (the parameter itself, no
    interpolation); at other grids it is resized from the stored grid to the map's grid."""
    import flatten_mm.models.layers.pos_embed as pe_module
    calls = []
    original = pe_module.resize_pos_table

    def spy(table, src, dst, mode='bilinear'):
        out = original(table, src, dst, mode)
        if out is not table:  # an interpolation happened
            calls.append((tuple(src), tuple(dst)))
        return out

    monkeypatch.setattr(pe_module, 'resize_pos_table', spy)
    monkeypatch.setattr(fla_module, 'resize_pos_table', spy)
    model = build(fam).eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    assert calls == []
    calls.clear()
    with torch.no_grad():
        model(torch.randn(1, 3, 100, 36))
    assert calls == fam.pe_calls


@family_param
def test_pretrained_init_cfg_roundtrip(fam, tmp_path):
    src = perturb(build(fam))
    path = str(tmp_path / 'converted.pth')
    torch.save({'state_dict': src.state_dict()}, path)
    dst = build(fam, init_cfg=dict(type='Pretrained', checkpoint=path))
    dst.init_weights()
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v)


@family_param
def test_bf16_autocast_large_input_close_to_fp32(fam):
    # realistic widths: tiny ones (8 channels) amplify the rounding of the CPU's bf16
    # kernels by a machine-dependent amount (see tests/test_reliability/test_mixed_precision.py)
    model = perturb(build(fam, arch=fam.bf16_arch, **fam.released_geometry)).eval()
    x = torch.randn(1, 3, 1024, 1024)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = model(x)
    for o, r in zip(out, ref):
        assert torch.isfinite(o).all()
        # bf16 has 8 mantissa bits: ~1% of the output range after 5 blocks
        assert (o.float() - r).abs().max() <= 3e-2 * r.abs().max()


FIXTURE_CASES = [(name, path) for name, fam in FAMILIES.items()
                 for path in (shared_fixtures(fam.fixtures) or ['missing'])]


@requires_shared()
@pytest.mark.parametrize('name,path', FIXTURE_CASES,
                         ids=[f'{n}-{p.rsplit("/", 1)[-1]}' for n, p in FIXTURE_CASES])
def test_float64_parity_with_official(name, path):
    """In float64 the converted model reproduces the official float64 stage outputs to
    rounding (the float32 check is dev/check_parity.py / tests/test_parity.py)."""
    if path == 'missing':
        pytest.skip(f'no {FAMILIES[name].fixtures} fixtures')
    fx = torch.load(path, weights_only=True)
    adapter = find_adapter(fx)
    model = adapter.build(fx)
    adapter.load(model, adapter.convert(fx), adapter.dense_only_prefixes)
    model = model.double().eval()
    with torch.no_grad():
        outs = adapter.stage_outputs(model, fx['input'].double())
    for out, ref in zip(outs, fx['stage_outputs_f64']):
        torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
