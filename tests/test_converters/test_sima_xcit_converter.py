"""Official SimA key layouts convert to exactly the SimAXCiT state dict (minus fpn1..4)."""
import pytest
import torch

from conftest import requires_shared, shared_fixtures
from flatten_mm.checkpoints.converters import CONVERTERS, guess_family
from flatten_mm.models import SimAXCiT

VARIANTS = [('nano_12', 'n12'), ('tiny_12', 't12'), ('small_12', 's12'), ('tiny_24', 't24'),
            ('small_24', 's24'), ('medium_24', 'm24'), ('large_24', 'l24')]
CASES = [(f'sima_{name}_p{p}', arch, p) for name, arch in VARIANTS for p in (16, 8)]


def dense_only(key: str) -> bool:
    return key.startswith(SimAXCiT.dense_only_prefixes)


@pytest.mark.parametrize('listing,arch,patch_size', CASES)
def test_key_coverage(official_listing, listing, arch, patch_size):
    official = official_listing(listing)
    assert guess_family(official) == ['sima_xcit']
    converted, dropped = CONVERTERS['sima_xcit'](official)
    with torch.device('meta'):  # shapes only; large_24 has 180M parameters
        model = SimAXCiT(arch=f'{arch}-p{patch_size}')
    expected = {k: v for k, v in model.state_dict().items() if not dense_only(k)}
    assert set(converted) == set(expected)
    for k, v in expected.items():
        assert converted[k].shape == v.shape, k
        assert converted[k].dtype == v.dtype, k
    assert set(dropped) == {k for k in official if k == 'cls_token' or k.startswith(
        ('cls_attn_blocks.', 'norm.', 'head.'))}
    assert any(k.startswith('cls_attn_blocks.') for k in dropped)
    again, dropped_again = CONVERTERS['sima_xcit'](converted)
    assert list(again) == list(converted) and not dropped_again


def test_signature_tells_sima_from_xcit(official_listing):
    official = official_listing('sima_tiny_12_p16')
    xcit_like = dict(official, **{'blocks.0.attn.temperature': torch.zeros(4, 1, 1)})
    assert 'sima_xcit' not in guess_family(xcit_like)
    pvt = official_listing('flatten_pvt_v2_b0')
    assert 'sima_xcit' not in guess_family(pvt)


@requires_shared()
@pytest.mark.parametrize('path', shared_fixtures('sima_xcit*.pt'))
def test_fixture_state_dict_loads_strictly_but_for_fpn(path):
    from dev.parity import find_adapter
    fx = torch.load(path, weights_only=True)
    adapter = find_adapter(fx)
    model = adapter.build(fx)
    missing, unexpected = model.load_state_dict(adapter.convert(fx), strict=False)
    assert not unexpected
    assert missing and all(dense_only(k) for k in missing)


@pytest.mark.parametrize('arch,ok', [('n12-p8', True), ('n12', False)])
def test_convert_checkpoint_workflow_checks_patch_size(official_listing, arch, ok):
    from flatten_mm.checkpoints.convert import ConversionError, convert_checkpoint
    ckpt = {'model': official_listing('sima_nano_12_p8')}
    if ok:
        converted, dropped, family = convert_checkpoint(ckpt, arch=arch)
        assert family == 'sima_xcit' and 'head.weight' in dropped
    else:  # a p8 checkpoint does not fit the default p16 patch embedding
        with pytest.raises(ConversionError, match='patch_embed'):
            convert_checkpoint(ckpt, arch=arch)
