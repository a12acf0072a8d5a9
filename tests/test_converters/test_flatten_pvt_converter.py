"""Official FLatten-PVT / -PVTv2 key layouts convert to exactly our state dict keys."""
import pytest
import torch

from flatten_mm.checkpoints.converters import CONVERTERS, guess_family, unwrap_checkpoint
from flatten_mm.models import FLattenPVT, FLattenPVTv2
from flatten_mm.checkpoints.convert import ConversionError, convert_checkpoint

CASES = [('flatten_pvt_v2_b0', FLattenPVTv2, 'b0'), ('flatten_pvt_v2_b1', FLattenPVTv2, 'b1'),
         ('flatten_pvt_v2_b2', FLattenPVTv2, 'b2'), ('flatten_pvt_v2_b3', FLattenPVTv2, 'b3'),
         ('flatten_pvt_v2_b4', FLattenPVTv2, 'b4'), ('flatten_pvt_tiny', FLattenPVT, 'tiny'),
         ('flatten_pvt_small', FLattenPVT, 'small'), ('flatten_pvt_medium', FLattenPVT, 'medium'),
         ('flatten_pvt_large', FLattenPVT, 'large')]


@pytest.mark.parametrize('listing,cls,arch', CASES)
def test_key_coverage(official_listing, listing, cls, arch):
    official = official_listing(listing)
    family = 'flatten_pvt_v2' if cls is FLattenPVTv2 else 'flatten_pvt'
    assert guess_family(official) == [family]
    converted, dropped = CONVERTERS[family](official)
    expected = cls(arch=arch).state_dict()
    assert set(converted) == set(expected)
    for k, v in expected.items():
        assert converted[k].shape == v.shape, k
    assert all(k.startswith('head.') or k.startswith('norm.') for k in dropped)
    assert any(k.startswith('head.') for k in dropped)
    # idempotent
    again, dropped_again = CONVERTERS[family](converted)
    assert set(again) == set(converted) and not dropped_again


@pytest.mark.parametrize('wrap', [
    lambda sd: {'model': sd, 'epoch': 1},
    lambda sd: {'state_dict': {f'module.{k}': v for k, v in sd.items()}},
    lambda sd: {'state_dict': {**{f'backbone.{k}': v for k, v in sd.items()},
                               'neck.lateral_convs.0.conv.weight': torch.zeros(1)}},
    lambda sd: sd,
])
def test_wrappers_are_unwrapped(official_listing, wrap):
    official = official_listing('flatten_pvt_v2_b0')
    sd, dropped, family = convert_checkpoint(wrap(dict(official)), arch='b0')
    assert family == 'flatten_pvt_v2'
    assert set(sd) == set(FLattenPVTv2('b0').state_dict())


def test_ema_weights_are_selected(official_listing):
    official = official_listing('flatten_pvt_v2_b0')
    ema = {k: torch.ones_like(v) for k, v in official.items()}
    sd = unwrap_checkpoint({'model': official, 'state_dict_ema': ema}, use_ema=True)
    assert all(v.eq(1).all() for v in sd.values())
    with pytest.raises(KeyError, match='no EMA weights'):
        unwrap_checkpoint({'model': official}, use_ema=True)


def test_wrong_variant_names_keys(official_listing):
    official = official_listing('flatten_pvt_v2_b2')
    with pytest.raises(ConversionError, match=r"arch='b0'.*\n.*(unexpected keys|shape)"):
        convert_checkpoint(official, arch='b0')


def test_wrong_family_names_the_family_it_looks_like(official_listing):
    official = official_listing('flatten_pvt_tiny')
    with pytest.raises(ConversionError, match=r"looks like \['flatten_pvt'\]"):
        convert_checkpoint(official, family='flatten_pvt_v2', arch='b1')
