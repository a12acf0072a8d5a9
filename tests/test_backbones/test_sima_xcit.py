"""SimAXCiT dense backbone with tiny archs: output contract, gradients, freezing, options."""
import copy
import math

import pytest
import torch
import torch.nn as nn

from flatten_mm.models import SimAXCiT
from flatten_mm.models.backbones.sima_xcit import default_out_indices
from flatten_mm.models.layers import SimAAttention

TINY = dict(embed_dims=32, depth=3, num_heads=2)
TINY_OUT = (0, 1, 1, 2)


def tiny(patch_size=16, **kwargs):
    kwargs.setdefault('out_indices', TINY_OUT)
    return SimAXCiT(arch=TINY, patch_size=patch_size, **kwargs)


def expected_shapes(model, hw, batch=1):
    return [(batch, c, math.ceil(hw[0] / s), math.ceil(hw[1] / s))
            for c, s in zip(model.out_channels, model.out_strides)]


@pytest.mark.parametrize('patch_size', [16, 8])
@pytest.mark.parametrize('hw', [(33, 47), (227, 353), (511, 385), (64, 96)])
def test_shapes_follow_declared_strides(patch_size, hw):
    model = tiny(patch_size).eval()
    assert model.out_strides == (4, 8, 16, 32)
    assert model.out_channels == (32, ) * 4
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *hw))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, hw)


@pytest.mark.parametrize('patch_size', [16, 8])
def test_matches_xcit_wrapper_on_multiples_of_32(patch_size):
    """Where no padding/cropping is involved the outputs are exactly XCiT's adapters
    applied to the block maps (fpn_k on the map of out_indices[k])."""
    model = tiny(patch_size).eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        outs = model(x)
        maps = model.forward_blocks(x)
    fpns = [model.fpn1, model.fpn2, model.fpn3, model.fpn4]
    for out, fpn, idx in zip(outs, fpns, TINY_OUT):
        torch.testing.assert_close(out, fpn(maps[idx]), rtol=0, atol=0)
    if patch_size == 16:
        assert isinstance(model.fpn1[3], nn.ConvTranspose2d) and isinstance(model.fpn3, nn.Identity)
    else:
        assert isinstance(model.fpn2, nn.Identity) and model.fpn4.kernel_size == 4


def test_forward_blocks_returns_every_block():
    model = tiny().eval()
    x = torch.randn(1, 3, 50, 70)
    with torch.no_grad():
        maps = model.forward_blocks(x)
        tokens, hw = model.embed(x)
        for i, block in enumerate(model.blocks):
            tokens = block(tokens, hw)
            ref = tokens.transpose(1, 2).reshape(1, 32, *hw)
            torch.testing.assert_close(maps[i], ref)
    assert len(maps) == TINY['depth'] and hw == (4, 5)


@pytest.mark.parametrize('patch_size', [16, 8])
def test_gradients_reach_every_parameter(patch_size):
    model = tiny(patch_size, drop_path_rate=0.).train()
    model.init_weights()
    outs = model(torch.randn(2, 3, 48, 80))
    sum(o.square().mean() for o in outs).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def test_with_cp_is_output_identical():
    ref = tiny(drop_path_rate=0.).train()
    cp_model = copy.deepcopy(ref)
    cp_model.with_cp = True
    x = torch.randn(2, 3, 40, 56, requires_grad=True)
    out_ref = ref(x)
    out_cp = cp_model(x)
    for a, b in zip(out_ref, out_cp):
        torch.testing.assert_close(a, b)
    sum(o.sum() for o in out_ref).backward()
    sum(o.sum() for o in out_cp).backward()
    grads_cp = dict(cp_model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads_cp[name].grad, p.grad, msg=name)


@pytest.mark.parametrize('frozen_stages', [-1, 0, 1, 3])
def test_frozen_stages(frozen_stages):
    model = tiny(frozen_stages=frozen_stages)
    model.train()
    stem = list(model.patch_embed.parameters()) + list(model.pos_embeder.parameters())
    assert all(p.requires_grad == (frozen_stages < 0) for p in stem)
    assert model.patch_embed.training == (frozen_stages < 0)
    for i, block in enumerate(model.blocks):
        frozen = i < frozen_stages
        assert all(p.requires_grad != frozen for p in block.parameters()), i
        assert block.local_mp.bn.training != frozen
    for fpn in (model.fpn1, model.fpn2):
        assert all(p.requires_grad for p in fpn.parameters())
    if frozen_stages >= 0:  # frozen BN statistics do not move in training
        mean = model.patch_embed.proj[0][1].running_mean.clone()
        model(torch.randn(2, 3, 32, 32))
        torch.testing.assert_close(model.patch_embed.proj[0][1].running_mean, mean)


@pytest.mark.parametrize('bad', [-2, 4])
def test_frozen_stages_out_of_range(bad):
    with pytest.raises(ValueError, match='frozen_stages'):
        tiny(frozen_stages=bad)


def test_norm_eval_keeps_batch_norms_in_eval():
    model = tiny(norm_eval=True).train()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and not any(m.training for m in bns)
    assert model.blocks[0].norm1.training


def test_norm_cfg():
    model = tiny(norm_cfg=dict(type='SyncBN', momentum=0.2))
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    # patch embed (4 convs) + LPI per block + fpn1
    assert len(bns) == 4 + TINY['depth'] + 1
    assert all(isinstance(m, nn.SyncBatchNorm) and m.momentum == 0.2 for m in bns)
    assert all(isinstance(m, nn.BatchNorm2d) for m in tiny().modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm))
    frozen_bn = tiny(norm_cfg=dict(type='BN', requires_grad=False))
    assert not frozen_bn.blocks[0].local_mp.bn.weight.requires_grad
    with pytest.raises(ValueError, match='norm_cfg type'):
        tiny(norm_cfg=dict(type='GN'))


def test_unknown_arch_and_bad_custom_arch():
    with pytest.raises(ValueError, match='unknown arch'):
        SimAXCiT(arch='huge_48')
    with pytest.raises(ValueError, match='exactly the keys'):
        SimAXCiT(arch=dict(embed_dims=32, depth=2))
    with pytest.raises(ValueError, match='divisible'):
        SimAXCiT(arch=dict(embed_dims=30, depth=2, num_heads=4), out_indices=(0, 0, 1, 1))


@pytest.mark.parametrize('out_indices,match', [((0, 1, 2), '4 block indices'),
                                               ((0, 1, 2, 3), 'out of range'),
                                               ((0, 2, 1, 2), 'non-decreasing'),
                                               (2, '4 block indices')])
def test_out_indices_errors(out_indices, match):
    with pytest.raises(ValueError, match=match):
        tiny(out_indices=out_indices)


def test_out_indices_defaults_and_negative():
    assert default_out_indices(12) == (3, 5, 7, 11)
    assert default_out_indices(24) == (7, 11, 15, 23)
    assert tiny(out_indices=(0, 0, -2, -1)).out_indices == (0, 0, 1, 2)
    assert SimAXCiT(arch=dict(embed_dims=32, depth=12, num_heads=2)).out_indices == (3, 5, 7, 11)


def test_blocks_after_last_out_index_are_not_run():
    model = tiny(out_indices=(0, 0, 1, 1)).eval()
    calls = []
    model.blocks[2].register_forward_hook(lambda *args: calls.append(1))
    model(torch.randn(1, 3, 32, 32))
    assert not calls


def test_patch_size_argument_and_arch_suffix():
    assert SimAXCiT._split_patch_suffix('s12-p8', None) == ('s12', 8)
    assert SimAXCiT._split_patch_suffix('small_12_p16', None) == ('small_12', 16)
    assert SimAXCiT._split_patch_suffix('s12', None) == ('s12', 16)
    assert SimAXCiT._split_patch_suffix('s12', 8) == ('s12', 8)
    with pytest.raises(ValueError, match='contradicts'):
        SimAXCiT._split_patch_suffix('s12-p8', 16)
    with pytest.raises(ValueError, match='patch_size'):
        tiny(patch_size=12)


def test_layer_scale_and_drop_path_defaults():
    shallow = tiny(drop_path_rate=0.2)
    deep = SimAXCiT(arch=dict(embed_dims=16, depth=24, num_heads=2))
    assert torch.all(shallow.blocks[0].gamma1 == 1.0)
    assert torch.all(deep.blocks[5].gamma3 == 1e-5)
    # stochastic depth is the same in every block (upstream SimA/XCiT)
    assert [b.drop_path.drop_prob for b in shallow.blocks] == [0.2] * TINY['depth']
    assert torch.all(tiny(layer_scale_init_value=0.5).blocks[1].gamma2 == 0.5)


def test_attn_cfg_updates_or_replaces_the_default():
    model = tiny(attn_cfg=dict(order='kv_first'))
    assert all(isinstance(b.attn, SimAAttention) and b.attn.order == 'kv_first'
               for b in model.blocks)


def test_wrong_input_channels():
    with pytest.raises(ValueError, match='3 input channels.*4'):
        tiny()(torch.randn(1, 4, 32, 32))


def test_pretrained_init_cfg_round_trip(tmp_path):
    src = tiny().eval()
    path = tmp_path / 'ckpt.pth'
    torch.save({'state_dict': src.state_dict()}, path)
    dst = tiny(init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    dst.init_weights()
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v, msg=k)


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg'])
def test_builds_from_registry(scope):
    from mmengine.registry import DefaultScope

    from flatten_mm.registry import MODELS
    with DefaultScope.overwrite_default_scope(scope):
        model = MODELS.build(dict(type='flatten_mm.SimAXCiT', arch=TINY, out_indices=TINY_OUT,
                                  patch_size=8))
    assert isinstance(model, SimAXCiT) and model.patch_size == 8
