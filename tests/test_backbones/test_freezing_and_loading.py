"""Behaviour every backbone shares with mmdet/mmseg and mmengine (issue #15):

* ``frozen_stages`` follows mmdet's Swin / ResNet convention in every family;
* ``init_cfg`` is read as mmengine's ``BaseModule`` reads it (a dict or a list, other
  initialisers first, ``Pretrained`` last, ``prefix``), with the checked loader;
* positional tables stored for another grid are resized when a checkpoint loads through
  ``init_cfg`` (and logged), while another variant is still refused;
* stages after the deepest ``out_indices`` entry take no part in training, so DDP
  without ``find_unused_parameters`` works.
"""
import os
from typing import Callable, Dict, List, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models import (FLattenCSWin, FLattenPVT, FLattenPVTv2, FLattenSwin, PVTv2,
                               QuadTreePVTv2, SimAXCiT)
from flatten_mm.models.layers import resize_pos_table

PVT_TINY = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                mlp_ratios=(2, 2, 2, 2))
SWIN_TINY = dict(embed_dims=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))
CSWIN_TINY = dict(embed_dims=8, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4))


class Family(NamedTuple):
    build: Callable  # (**kwargs) -> tiny model
    num_stages: int  # frozen_stages = num_stages freezes everything
    stem: List[str]  # parameter-name prefixes frozen with frozen_stages >= 0
    stage: Callable  # i -> parameter-name prefixes of stage i (frozen with k > i)
    hw: tuple  # input size of the gradient tests


def _pvt(cls, **extra):
    return lambda **kw: cls(arch=PVT_TINY, **extra, **kw)


# PVT v1's dropout after the stage-1 position table is stem too (no parameters)
PVT_STEM = ['stages.0.patch_embed.', 'stages.0.pos_embed', 'stages.0.pos_drop.']


def pvt_stage(i):
    return [f'stages.{i}.']


FAMILIES: Dict[str, Family] = {
    'FLattenPVTv2': Family(_pvt(FLattenPVTv2), 4, PVT_STEM, pvt_stage, (64, 64)),
    'FLattenPVT': Family(_pvt(FLattenPVT), 4, PVT_STEM, pvt_stage, (64, 64)),
    'PVTv2': Family(_pvt(PVTv2), 4, PVT_STEM, pvt_stage, (64, 64)),
    'QuadTreePVTv2': Family(_pvt(QuadTreePVTv2, attn_cfg=dict(topk=4)), 4, PVT_STEM,
                            pvt_stage, (192, 192)),
    'FLattenSwin': Family(
        lambda **kw: FLattenSwin(arch=SWIN_TINY, pretrain_img_size=64, window_size=4, **kw),
        4, ['patch_embed.', 'pos_drop.'], lambda i: [f'stages.{i}.', f'norm{i}.'], (96, 64)),
    'FLattenCSWin': Family(
        lambda **kw: FLattenCSWin(arch=CSWIN_TINY, pretrain_img_size=64, split_size=2, **kw),
        4, ['stages.0.patch_embed.'], lambda i: [f'stages.{i}.', f'norm{i + 1}.'], (64, 64)),
    # SimA: "stage" 0 is the patch embedding + positional encoding, stage k block k-1
    'SimAXCiT': Family(
        lambda **kw: SimAXCiT(arch=dict(embed_dims=32, depth=12, num_heads=2), **kw),
        12, ['patch_embed.', 'pos_embeder.'], lambda i: [f'blocks.{i}.'], (64, 64)),
}
PYRAMIDS = [n for n in FAMILIES if n != 'SimAXCiT']  # PVT family, Swin, CSwin


def frozen_prefixes(fam: Family, k: int) -> tuple:
    return tuple((fam.stem if k >= 0 else []) + [p for i in range(k) for p in fam.stage(i)])


def expected_frozen(model, fam: Family, k: int) -> set:
    return {n for n, _ in model.named_parameters() if n.startswith(frozen_prefixes(fam, k))}


# ---------------------------------------------------------------------------- frozen_stages
@pytest.mark.parametrize('name', list(FAMILIES))
@pytest.mark.parametrize('k', [-1, 0, 1, 2, 'all'])
def test_frozen_stages_follow_mmdet(name, k):
    """Exactly the mmdet set has ``requires_grad=False`` (stem for 0, stem + stages 0..k-1
    for k >= 1, everything for num_stages), and after ``train()`` every module of the
    frozen part (dropouts and drop paths included) stays in eval mode while every module
    with only trainable parameters, or none outside the frozen part, trains."""
    fam = FAMILIES[name]
    k = fam.num_stages if k == 'all' else k
    model = fam.build(frozen_stages=k)
    model.train()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    expected = expected_frozen(model, fam, k)
    assert frozen == expected
    if k == -1:
        assert not frozen
    if k == 0:
        assert frozen and all(n.startswith(tuple(fam.stem)) for n in frozen)
    if k >= 1:
        assert {n for n in frozen if not n.startswith(tuple(fam.stem))}
    if k == fam.num_stages and name != 'SimAXCiT':  # SimA's fpn adapters never freeze
        assert frozen == {n for n, _ in model.named_parameters()}
    prefixes = frozen_prefixes(fam, k)
    for mod_name, module in model.named_modules():
        if prefixes and (mod_name + '.').startswith(prefixes):
            assert not module.training, mod_name
        elif all(p.requires_grad for p in module.parameters()):
            assert module.training, mod_name


@pytest.mark.parametrize('name', list(FAMILIES))
def test_frozen_stages_range(name):
    fam = FAMILIES[name]
    fam.build(frozen_stages=fam.num_stages)
    with pytest.raises(ValueError, match=rf'frozen_stages must be in \[-1, {fam.num_stages}\]'):
        fam.build(frozen_stages=fam.num_stages + 1)


# ---------------------------------------------------------------------------- init_cfg
def perturbed_state(model) -> Dict[str, torch.Tensor]:
    """A state dict with every entry random (no zero tables), as a trained model has."""
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in model.state_dict().items()}


def save(state, path) -> str:
    torch.save(state, str(path))
    return str(path)


def assert_state_equal(model, state):
    own = model.state_dict()
    assert own.keys() == state.keys()
    for k in own:
        torch.testing.assert_close(own[k], state[k], rtol=0, atol=0, msg=k)


def test_init_cfg_list_with_pretrained_loads(tmp_path):
    state = perturbed_state(FLattenPVTv2(arch=PVT_TINY))
    path = save(state, tmp_path / 'ckpt.pth')
    # a non-Pretrained entry first: mmengine applies it, then Pretrained overwrites (last)
    model = FLattenPVTv2(arch=PVT_TINY, init_cfg=[
        dict(type='Constant', layer='Linear', val=0.5, bias=0.),
        dict(type='Pretrained', checkpoint=path)])
    model.init_weights()
    assert_state_equal(model, state)
    # the order is mmengine's whatever the list order: Pretrained still wins
    model = FLattenPVTv2(arch=PVT_TINY, init_cfg=[
        dict(type='Pretrained', checkpoint=path),
        dict(type='Constant', layer='Linear', val=0.5, bias=0.)])
    model.init_weights()
    assert_state_equal(model, state)


def test_init_cfg_list_without_pretrained_applies_the_initialisers():
    model = FLattenSwin(arch=SWIN_TINY, pretrain_img_size=64, window_size=4, init_cfg=[
        dict(type='Constant', layer='Linear', val=0.25, bias=0.5),
        dict(type='Constant', layer='LayerNorm', val=2., bias=0.,
             override=dict(name='norm0', type='Constant', val=3., bias=1.))])
    model.init_weights()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(bool((m.weight == 0.25).all()) for m in linears)
    assert all(bool((m.bias == 0.5).all()) for m in linears if m.bias is not None)
    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    for n, m in norms:
        assert bool((m.weight == (3. if n == 'norm0' else 2.)).all()), n


@pytest.mark.parametrize('as_list', [False, True])
def test_pretrained_with_prefix_loads_the_backbone_of_a_detector_checkpoint(tmp_path, as_list):
    state = perturbed_state(FLattenSwin(arch=SWIN_TINY, pretrain_img_size=64, window_size=4))
    detector = {f'backbone.{k}': v for k, v in state.items()}
    detector['neck.conv.weight'] = torch.randn(4, 4)
    path = save({'meta': {}, 'state_dict': detector}, tmp_path / 'det.pth')
    cfg = dict(type='Pretrained', checkpoint=path, prefix='backbone.')
    model = FLattenSwin(arch=SWIN_TINY, pretrain_img_size=64, window_size=4,
                        init_cfg=[cfg] if as_list else cfg)
    model.init_weights()
    assert_state_equal(model, state)


def test_init_cfg_list_with_a_wrong_family_checkpoint_raises(tmp_path):
    path = save(FLattenSwin(arch=SWIN_TINY).state_dict(), tmp_path / 'swin.pth')
    model = FLattenPVTv2(arch=PVT_TINY, init_cfg=[dict(type='Pretrained', checkpoint=path)])
    with pytest.raises(ValueError, match='does not fit FLattenPVTv2.*FLattenSwin'):
        model.init_weights()


def test_init_cfg_entries_are_checked():
    with pytest.raises(TypeError, match='init_cfg'):
        FLattenPVTv2(arch=PVT_TINY, init_cfg=['Pretrained']).init_weights()
    with pytest.raises(ValueError, match='checkpoint'):
        FLattenPVTv2(arch=PVT_TINY, init_cfg=[dict(type='Pretrained')]).init_weights()


# ---------------------------------------------------------------------------- table resizing
def swin_geometry(pretrain, window, **arch):
    return dict(SWIN_TINY, pretrain_img_size=pretrain, window_size=window, **arch)


def capture_log(monkeypatch) -> list:
    """The messages the checked Pretrained loader logs."""
    from flatten_mm.models import pretrained
    messages = []
    original = pretrained.print_log

    def spy(msg, *args, **kwargs):
        messages.append(str(msg))
        return original(msg, *args, **kwargs)

    monkeypatch.setattr(pretrained, 'print_log', spy)
    return messages


def bicubic_bias_table(table: torch.Tensor, window: int) -> torch.Tensor:
    side, new = int(table.shape[0]**0.5), 2 * window - 1
    grid = table.t().reshape(1, -1, side, side)
    grid = F.interpolate(grid, size=(new, new), mode='bicubic', align_corners=False)
    return grid.reshape(-1, new * new).t()


def check_resized_load(model, state, tables, messages, path):
    """Every key of ``state`` is loaded: tables as ``tables[key]`` (expected), the rest as
    is; the log names each resized key with its old and new shape."""
    own = model.state_dict()
    for k, v in state.items():
        if k in own:
            torch.testing.assert_close(own[k], tables.get(k, v), rtol=0, atol=0, msg=k)
    log = '\n'.join(messages)
    assert f'{len(tables)} positional tables of {path}' in log
    for k, v in tables.items():
        assert f'{k}: {tuple(state[k].shape)} -> {tuple(v.shape)}' in log


@pytest.mark.parametrize('src,dst', [((384, 12), (224, 7)), ((224, 7), (384, 12))],
                         ids=['b-384 into b', 'b into b-384'])
def test_swin_checkpoint_of_the_other_resolution_loads_resized(tmp_path, monkeypatch, src, dst):
    """The geometry of arch b-384 (384 grid, window 12) against b (224, 7), tiny widths:
    FLA tables resized bicubically by ``resize_pos_table``, bias tables bicubically."""
    state = perturbed_state(FLattenSwin(arch=swin_geometry(*src)))
    path = save(state, tmp_path / 'swin.pth')
    messages = capture_log(monkeypatch)
    model = FLattenSwin(arch=swin_geometry(*dst),
                        init_cfg=[dict(type='Pretrained', checkpoint=path)])
    model.init_weights()
    tables = {}
    for k, v in state.items():
        if k.endswith('positional_encoding'):
            stage = int(k.split('.')[1])
            grid = tuple(s // (4 * 2**stage) for s in model.pretrain_img_size)
            side = int(v.shape[1]**0.5)
            tables[k] = resize_pos_table(v, (side, side), grid, mode='bicubic')
        elif k.endswith('relative_position_bias_table'):
            tables[k] = bicubic_bias_table(v, dst[1])
    assert len(tables) == 2 * 2 + 2 * 2  # FLA in stages 1-2, windows in 3-4, 2 blocks each
    assert all(tables[k].shape != state[k].shape for k in tables)
    check_resized_load(model, state, tables, messages, path)
    # the run-time resize now starts from the new grid: a forward at the new size works
    model.eval()(torch.randn(1, 3, 64, 64))


def test_real_swin_b_384_checkpoint_loads_into_b(tmp_path, monkeypatch):
    """The real archs (a checkpoint written from 'b-384', loaded into 'b')."""
    src = FLattenSwin(arch='b-384')
    state = {k: (v + torch.randn_like(v) if k.endswith('positional_encoding') else v)
             for k, v in src.state_dict().items()}
    del src
    path = save(state, tmp_path / 'b384.pth')
    messages = capture_log(monkeypatch)
    model = FLattenSwin(arch='b', init_cfg=dict(type='Pretrained', checkpoint=path))
    model.init_weights()
    key = 'stages.0.blocks.0.attn.positional_encoding'
    torch.testing.assert_close(model.state_dict()[key],
                               resize_pos_table(state[key], (96, 96), (56, 56), mode='bicubic'),
                               rtol=0, atol=0)
    key = 'stages.2.blocks.1.attn.relative_position_bias_table'
    torch.testing.assert_close(model.state_dict()[key], bicubic_bias_table(state[key], 7),
                               rtol=0, atol=0)
    assert f'{key}: (529, 16) -> (169, 16)' in '\n'.join(messages)


def test_cswin_checkpoint_of_the_other_resolution_loads_resized(tmp_path, monkeypatch):
    arch = lambda p: dict(CSWIN_TINY, pretrain_img_size=p, split_size=2)  # noqa: E731
    state = perturbed_state(FLattenCSWin(arch=arch(384)))
    path = save(state, tmp_path / 'cswin.pth')
    messages = capture_log(monkeypatch)
    model = FLattenCSWin(arch=arch(224), init_cfg=dict(type='Pretrained', checkpoint=path))
    model.init_weights()
    tables = {}
    for k, v in state.items():
        if k.endswith('positional_encoding'):
            stage = int(k.split('.')[1])
            side, grid = int(v.shape[1]**0.5), 224 // (4 * 2**stage)
            tables[k] = resize_pos_table(v, (side, side), (grid, grid), mode='bicubic')
    assert len(tables) == 1 + 2  # the FLA stages (depths 1, 2)
    check_resized_load(model, state, tables, messages, path)


@pytest.mark.parametrize('cls', [FLattenPVT, FLattenPVTv2])
def test_pvt_checkpoint_of_another_pretrain_img_size_loads_resized(tmp_path, monkeypatch, cls):
    """224 -> 512: FLA tables bicubic (as FLatten's loader), PVT v1 absolute tables
    bilinear (as their run-time resize)."""
    state = perturbed_state(cls(arch=PVT_TINY, pretrain_img_size=224))
    path = save(state, tmp_path / 'pvt.pth')
    messages = capture_log(monkeypatch)
    model = cls(arch=PVT_TINY, pretrain_img_size=512,
                init_cfg=[dict(type='Pretrained', checkpoint=path)])
    model.init_weights()
    tables = {}
    for k, v in state.items():
        stage = int(k.split('.')[1]) if k.startswith('stages.') else None
        if k.endswith(('positional_encoding', 'pos_embed')):
            side, grid = int(v.shape[1]**0.5), 512 // (4 * 2**stage)
            mode = 'bicubic' if k.endswith('positional_encoding') else 'bilinear'
            tables[k] = resize_pos_table(v, (side, side), (grid, grid), mode=mode)
    assert len(tables) == (8 if cls is FLattenPVT else 4)
    check_resized_load(model, state, tables, messages, path)


@pytest.mark.parametrize('case', ['widths', 'heads'])
def test_another_variant_is_still_refused(tmp_path, case):
    """Other widths (with another grid too), or other heads of the bias tables only."""
    if case == 'widths':
        src = FLattenSwin(arch=swin_geometry(384, 12, embed_dims=16))
    else:
        src = FLattenSwin(arch=swin_geometry(224, 7, num_heads=(1, 2, 4, 4)))
    path = save(src.state_dict(), tmp_path / 'other.pth')
    model = FLattenSwin(arch=swin_geometry(224, 7),
                        init_cfg=[dict(type='Pretrained', checkpoint=path)])
    with pytest.raises(ValueError, match=r'parameters have other shapes \(another variant\?\)'):
        model.init_weights()


# ---------------------------------------------------------------------------- unused stages
@pytest.mark.parametrize('name', PYRAMIDS)
@pytest.mark.parametrize('out_indices', [(0, 1, 2), (1, )])
def test_stages_after_the_last_output_are_frozen_and_everything_else_learns(name, out_indices):
    fam = FAMILIES[name]
    model = fam.build(out_indices=out_indices, drop_path_rate=0.)
    model.init_weights()
    model.train()
    outs = model(torch.randn(2, 3, *fam.hw))
    sum(o.square().mean() for o in outs).backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    no_grad = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not no_grad
    unused = {n for n, p in model.named_parameters()
              if any(n.startswith(f'stages.{i}.') for i in range(max(out_indices) + 1, 4))}
    assert unused and not unused & trainable
    if name == 'FLattenSwin':  # the PatchMerging after the last returned stage is unused
        merge = f'stages.{max(out_indices)}.downsample.'
        assert not any(n.startswith(merge) for n in trainable)


@pytest.mark.parametrize('name', PYRAMIDS)
def test_full_checkpoint_loads_into_a_model_with_fewer_outputs(tmp_path, name):
    fam = FAMILIES[name]
    state = perturbed_state(fam.build())
    path = save(state, tmp_path / 'full.pth')
    model = fam.build(out_indices=(0, 1, 2), init_cfg=dict(type='Pretrained', checkpoint=path))
    model.init_weights()
    own = model.state_dict()
    # all of the checkpoint but the output norm of stage 4 (Swin / CSwin)
    assert set(own) <= set(state)
    assert all(k.startswith('norm') for k in set(state) - set(own))
    for k in own:
        torch.testing.assert_close(own[k], state[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize('name', ['FLattenSwin', 'FLattenPVTv2'])
def test_ddp_without_find_unused_parameters_trains_with_fewer_outputs(tmp_path, name):
    """What mmdet's tools/train.py does: DDP (gloo, one process) without
    find_unused_parameters; the second iteration raised 'Expected to have finished
    reduction in the prior iteration' when the unused stages required grad."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    if dist.is_initialized():
        pytest.fail('a process group is already initialised in this test process')
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=0,
                            world_size=1)
    try:
        fam = FAMILIES[name]
        model = DistributedDataParallel(fam.build(out_indices=(0, 1, 2)).train())
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            outs = model(torch.randn(1, 3, *fam.hw))
            sum(o.mean() for o in outs).backward()
            opt.step()
    finally:
        dist.destroy_process_group()
