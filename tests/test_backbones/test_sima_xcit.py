"""SimAXCiT dense backbone with tiny archs: output contract, gradients, freezing, options."""
import copy
import math

import pytest
import torch
import torch.nn as nn

from flatten_mm.models import SimAXCiT
from flatten_mm.models.backbones.sima_xcit import default_block_indices
from flatten_mm.models.layers import SimAAttention

TINY = dict(embed_dims=32, depth=3, num_heads=2)
TINY_BLOCKS = (0, 1, 1, 2)
BatchNorm = nn.modules.batchnorm._BatchNorm


def tiny(patch_size=16, **kwargs):
    kwargs.setdefault('block_indices', TINY_BLOCKS)
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
    applied to the block maps (fpn_k on the map of block_indices[k])."""
    model = tiny(patch_size).eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        outs = model(x)
        maps = model.forward_blocks(x)
    fpns = [model.fpn1, model.fpn2, model.fpn3, model.fpn4]
    for out, fpn, idx in zip(outs, fpns, TINY_BLOCKS):
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
    bns = [m for m in model.modules() if isinstance(m, BatchNorm)]
    assert bns and not any(m.training for m in bns)
    assert model.blocks[0].norm1.training


def test_norm_cfg():
    model = tiny(norm_cfg=dict(type='SyncBN', momentum=0.2))
    bns = [m for m in model.modules() if isinstance(m, BatchNorm)]
    # patch embed (4 convs) + LPI per block + fpn1
    assert len(bns) == 4 + TINY['depth'] + 1
    assert all(isinstance(m, nn.SyncBatchNorm) and m.momentum == 0.2 for m in bns)
    # default: SyncBN (XCiT / SimA recipes); BN on request
    default = [m for m in tiny().modules() if isinstance(m, BatchNorm)]
    assert len(default) == len(bns) and all(type(m) is nn.SyncBatchNorm for m in default)
    assert tiny().norm_cfg == dict(type='SyncBN', requires_grad=True)
    assert all(type(m) is nn.BatchNorm2d for m in tiny(norm_cfg=dict(type='BN')).modules()
               if isinstance(m, BatchNorm))
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
        SimAXCiT(arch=dict(embed_dims=30, depth=2, num_heads=4), block_indices=(0, 0, 1, 1))


@pytest.mark.parametrize('block_indices,match', [((0, 1, 2), '4 block indices'),
                                                 ((0, 1, 2, 3), 'out of range'),
                                                 ((0, 2, 1, 2), 'non-decreasing'),
                                                 (2, '4 block indices')])
def test_block_indices_errors(block_indices, match):
    with pytest.raises(ValueError, match=match):
        tiny(block_indices=block_indices)


@pytest.mark.parametrize('out_indices,match', [
    # XCiT-style block indices passed as out_indices: never a silently different model
    ((3, 5, 7, 11), r'out of range for the 4 output maps.*XCiT block indices.*use '
                    r'block_indices=\(3, 5, 7, 11\), out_indices=\(0, 1, 2, 3\)'),
    ((7, 11, 15, 23), r'out of range.*block_indices=\(7, 11, 15, 23\)'),
    ((1, 4), r'out of range.*use block_indices=\(4 block indices'),
    ((0, 0, 1, 2), 'increasing map indices'),
    ((2, 1), 'increasing map indices'),
    ((-5, ), 'increasing map indices'),
    ((), 'increasing map indices')])
def test_out_indices_errors(out_indices, match):
    with pytest.raises(ValueError, match=match):
        tiny(out_indices=out_indices)


def test_index_defaults_and_negative():
    assert default_block_indices(12) == (3, 5, 7, 11)
    assert default_block_indices(24) == (7, 11, 15, 23)
    assert tiny(block_indices=(0, 0, -2, -1)).block_indices == (0, 0, 1, 2)
    m12 = SimAXCiT(arch=dict(embed_dims=32, depth=12, num_heads=2))
    assert m12.block_indices == (3, 5, 7, 11) and m12.out_indices == (0, 1, 2, 3)
    assert tiny(out_indices=(-3, -1)).out_indices == (1, 3)
    assert tiny(out_indices=2).out_indices == (2, )


@pytest.mark.parametrize('patch_size', [16, 8])
@pytest.mark.parametrize('out_indices', [(1, 2, 3), (0, 2), (3, )])
def test_out_indices_select_maps_and_build_only_their_adapters(patch_size, out_indices):
    """``out_indices`` picks maps like every other backbone: the outputs are exactly
    the selected maps of the 4-map model with the same weights, ``out_channels`` /
    ``out_strides`` follow, and adapters of unselected maps do not exist."""
    full = tiny(patch_size).eval()
    part = tiny(patch_size, out_indices=out_indices).eval()
    missing, unexpected = part.load_state_dict(full.state_dict(), strict=False)
    dropped = {f'fpn{k + 1}' for k in range(4) if k not in out_indices}
    assert not missing and {k.split('.')[0] for k in unexpected} <= dropped
    assert part.out_strides == tuple((4, 8, 16, 32)[k] for k in out_indices)
    assert part.out_channels == (32, ) * len(out_indices)
    for k in range(4):
        assert hasattr(part, f'fpn{k + 1}') == (k in out_indices)
    x = torch.randn(2, 3, 70, 45)
    with torch.no_grad():
        ref, outs = full(x), part(x)
    assert len(outs) == len(out_indices)
    for k, out in zip(out_indices, outs):
        torch.testing.assert_close(out, ref[k], rtol=0, atol=0)


def test_blocks_after_the_deepest_needed_block_are_frozen_and_not_run():
    """Maps 0, 1 come from blocks 0, 0: blocks 1, 2 are built (checkpoints keep their
    keys) but never run and frozen (no gradient, eval mode, kept frozen by ``train()``);
    every trainable parameter gets a gradient (DDP without find_unused_parameters)."""
    model = tiny(block_indices=(0, 0, 1, 2), out_indices=(0, 1))
    model.train()
    assert model.last_block == 0
    calls = []
    for block in model.blocks[1:]:
        block.register_forward_hook(lambda *args: calls.append(1))
        assert not block.training and not any(p.requires_grad for p in block.parameters())
    assert all(p.requires_grad for p in model.blocks[0].parameters())
    outs = model(torch.randn(2, 3, 32, 48))
    assert not calls
    sum(o.square().mean() for o in outs).backward()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith(('patch_embed', 'pos_embeder', 'blocks.0.', 'fpn1.',
                                           'fpn2.')) for n in trainable)
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    # (1, 2, 3) from XCiT's default blocks needs every block
    assert tiny(out_indices=(1, 2, 3)).last_block == 2


def test_subset_model_loads_full_checkpoints_checked(tmp_path):
    """The checked Pretrained loader accepts the full 4-map model's checkpoint (all
    blocks, all adapters) in a model returning fewer maps, and vice versa."""
    src = tiny().eval()
    path = tmp_path / 'full.pth'
    torch.save({'state_dict': src.state_dict()}, path)
    dst = tiny(out_indices=(2, 3), block_indices=(0, 0, 0, 1),
               init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    dst.init_weights()
    for k, v in dst.state_dict().items():
        torch.testing.assert_close(v, src.state_dict()[k], rtol=0, atol=0, msg=k)
    assert 'blocks.2.attn.qkv.weight' in dst.state_dict()
    back = tmp_path / 'part.pth'
    torch.save({'state_dict': dst.state_dict()}, back)
    tiny(init_cfg=dict(type='Pretrained', checkpoint=str(back))).init_weights()


def test_default_sync_bn_runs_in_a_plain_process_and_reverts_to_bn():
    """Default SyncBN without a process group: trains like BN (local batch statistics,
    same outputs, gradients and running statistics as ``norm_cfg=dict(type='BN')``);
    mmengine's ``revert_sync_batchnorm`` (used by its runner in non-distributed runs)
    turns every SyncBatchNorm into BN with the same parameters."""
    import torch.distributed as dist
    from mmengine.model import revert_sync_batchnorm
    assert not (dist.is_available() and dist.is_initialized())
    torch.manual_seed(0)
    sync = tiny().train()
    bn = tiny(norm_cfg=dict(type='BN', requires_grad=True)).train()
    bn.load_state_dict(sync.state_dict())
    x = torch.randn(2, 3, 48, 64)
    outs_sync, outs_bn = sync(x), bn(x)
    for a, b in zip(outs_sync, outs_bn):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    sum(o.square().mean() for o in outs_sync).backward()
    sum(o.square().mean() for o in outs_bn).backward()
    grads = dict(bn.named_parameters())
    for name, p in sync.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=0, msg=name)
    for name, buf in sync.named_buffers():
        torch.testing.assert_close(buf, dict(bn.named_buffers())[name], rtol=0, atol=0)
    weight = sync.blocks[0].local_mp.bn.weight
    reverted = revert_sync_batchnorm(sync)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in reverted.modules())
    assert reverted.blocks[0].local_mp.bn.weight is weight


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
        model = MODELS.build(dict(type='flatten_mm.SimAXCiT', arch=TINY,
                                  block_indices=TINY_BLOCKS, out_indices=(1, 2, 3),
                                  patch_size=8))
    assert isinstance(model, SimAXCiT) and model.patch_size == 8
    assert model.out_strides == (8, 16, 32)
