"""Official FLatten-Swin / FLatten-CSwin key layouts convert to exactly our state dict keys
(all released variants, 224 and 384), wrappers are handled, conversion is idempotent."""
import pytest
import torch

from flatten_mm.checkpoints.converters import CONVERTERS, guess_family
from flatten_mm.models import FLattenCSWin, FLattenSwin
from flatten_mm.checkpoints.convert import ConversionError, convert_checkpoint

CASES = [('flatten_swin_T_224', FLattenSwin, 't'), ('flatten_swin_S_224', FLattenSwin, 's'),
         ('flatten_swin_B_224', FLattenSwin, 'b'), ('flatten_swin_B_384', FLattenSwin, 'b-384'),
         ('FLatten_CSWin_64_24181_tiny_224', FLattenCSWin, 't'),
         ('FLatten_CSWin_64_24322_small_224', FLattenCSWin, 's'),
         ('FLatten_CSWin_96_36292_base_224', FLattenCSWin, 'b'),
         ('FLatten_CSWin_96_36292_base_384', FLattenCSWin, 'b-384')]
FAMILY = {FLattenSwin: 'flatten_swin', FLattenCSWin: 'flatten_cswin'}


@pytest.mark.parametrize('listing,cls,arch', CASES)
def test_key_coverage(official_listing, listing, cls, arch):
    official = official_listing(listing)
    family = FAMILY[cls]
    assert guess_family(official) == [family]
    converted, dropped = CONVERTERS[family](official)
    expected = {k: v for k, v in cls(arch=arch).state_dict().items()
                if not k.startswith(cls.dense_only_prefixes)}
    assert set(converted) == set(expected)
    for k, v in expected.items():
        assert converted[k].shape == v.shape, k
    # dropped: classifier, final norm and (Swin) the recomputed buffers
    allowed = ('head.', 'norm.', 'relative_position_index', 'attn_mask')
    assert all(any(a in k for a in allowed) for k in dropped)
    assert {'head.weight', 'head.bias', 'norm.weight', 'norm.bias'} <= set(dropped)
    again, dropped_again = CONVERTERS[family](converted)
    assert set(again) == set(converted) and not dropped_again


@pytest.mark.parametrize('listing,arch', [('flatten_swin_T_224', 't'),
                                          ('FLatten_CSWin_64_24181_tiny_224', 't')])
@pytest.mark.parametrize('wrap', [
    lambda sd: {'model': sd, 'epoch': 1},
    lambda sd: {'model': {}, 'state_dict_ema': sd},
    lambda sd: {'state_dict': {f'module.{k}': v for k, v in sd.items()}},
    lambda sd: sd,
])
def test_wrappers_are_unwrapped(official_listing, listing, arch, wrap):
    official = dict(official_listing(listing))
    ckpt = wrap(official)
    use_ema = 'state_dict_ema' in ckpt
    sd, _, family = convert_checkpoint(ckpt, arch=arch, use_ema=use_ema)
    assert family in ('flatten_swin', 'flatten_cswin')


def test_swin_buffers_are_dropped(official_listing):
    official = official_listing('flatten_swin_T_224')
    assert any(k.endswith('attn_mask') for k in official)
    converted, dropped = CONVERTERS['flatten_swin'](official)
    assert not any('relative_position_index' in k or 'attn_mask' in k for k in converted)
    assert sum('attn_mask' in k for k in dropped) == 3  # odd blocks of stage 3 (6 blocks)


def test_wrong_variant_names_keys(official_listing):
    with pytest.raises(ConversionError, match='unexpected keys|missing keys|shape'):
        convert_checkpoint(official_listing('flatten_swin_S_224'), arch='t')
    with pytest.raises(ConversionError, match='shape'):
        convert_checkpoint(official_listing('FLatten_CSWin_96_36292_base_384'), arch='b')


def test_384_weights_load_into_224_model_by_resizing_tables():
    """A square positional table / bias table of another grid is resized at load."""
    src = FLattenSwin(arch=dict(embed_dims=8, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4)),
                      pretrain_img_size=96, window_size=6)
    dst = FLattenSwin(arch=dict(embed_dims=8, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4)),
                      pretrain_img_size=64, window_size=4)
    dst.load_state_dict(src.state_dict())
    assert dst.stages[0].blocks[0].attn.positional_encoding.shape == (1, 256, 8)
    assert torch.isfinite(dst(torch.randn(1, 3, 64, 64))[0]).all()
