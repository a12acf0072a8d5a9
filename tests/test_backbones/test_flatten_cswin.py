"""FLattenCSWin specifics with tiny archs: stem padding, default LLSS attention, the arch
table and argument / input errors. Behaviour shared with FLattenSwin is in
test_doubling_stage_backbones.py."""
import pytest
import torch

from flatten_mm.models import FLattenCSWin
from flatten_mm.models.layers import FocusedLinearQKV, LePEAttention

TINY = dict(embed_dims=8, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4))


def build(**kwargs):
    kwargs.setdefault('arch', TINY)
    kwargs.setdefault('pretrain_img_size', 64)
    kwargs.setdefault('split_size', 2)
    return FLattenCSWin(**kwargs)


def test_stem_padding_keeps_the_other_outputs():
    """The extra bottom/right padding for ceil sizes does not change existing outputs."""
    embed = build().stages[0].patch_embed
    x = torch.randn(1, 3, 224, 224)
    x_odd = torch.cat([x, torch.randn(1, 3, 1, 224)], dim=2)  # 225 rows -> 57 outputs
    with torch.no_grad():
        a, hw_a = embed(x)
        b, hw_b = embed(x_odd)
    assert hw_a == (56, 56) and hw_b == (57, 56)
    b = b.reshape(1, 57, 56, -1)[:, :55].reshape(1, -1, a.shape[-1])
    torch.testing.assert_close(b, a.reshape(1, 56, 56, -1)[:, :55].reshape(1, -1, a.shape[-1]))


def test_declared_contract_and_default_attention():
    model = build()
    assert model.out_channels == (8, 16, 32, 64)
    assert model.out_strides == (4, 8, 16, 32)
    attns = [s.blocks[0].attn for s in model.stages]
    assert [len(a.branches) for a in attns] == [1, 1, 2, 1]  # LLSS: global, global, cross, global
    assert [type(a.branches[0]) for a in attns] == [FocusedLinearQKV] * 2 + [LePEAttention] * 2
    assert attns[0].branches[0].pe_hw_shape == (16, 16)  # stage grid at 64
    assert attns[1].branches[0].pe_hw_shape == (8, 8)
    assert attns[2].split_size == 2


def test_arch_zoo():
    b384 = FLattenCSWin(arch='b-384', out_indices=(3, ))
    assert b384.split_size == 12 and b384.pretrain_img_size == (384, 384)
    assert b384.stages[0].blocks[0].attn.branches[0].pe_hw_shape == (96, 96)
    assert b384.stages[2].blocks[0].attn.split_size == 12
    assert b384.out_channels == (768, )
    for name in ('t', 'tiny', 's', 'small', 'b', 'base', 'b-384', 'base-384'):
        assert name in FLattenCSWin.arch_zoo


def test_bad_arguments_and_inputs():
    with pytest.raises(ValueError, match='valid archs'):
        FLattenCSWin(arch='huge')
    with pytest.raises(ValueError, match='exactly the keys'):
        FLattenCSWin(arch=dict(embed_dims=8, num_heads=(2, 2, 2, 2)))
    with pytest.raises(ValueError, match='out of range'):
        build(out_indices=(-5, ))
    with pytest.raises(ValueError, match='even'):
        build(arch=dict(embed_dims=8, depths=(1, 1, 1, 1), num_heads=(2, 2, 3, 4)))
    model = build()
    with pytest.raises(ValueError, match='3 input channels.*1'):
        model(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match='at least 1x1'):
        model(torch.randn(1, 3, 32, 0))
