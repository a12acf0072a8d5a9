"""Bad input gives a clear error, for every registered backbone (tiny archs).

Parametrised over ``flatten_mm.registry.MODELS``: a new backbone is covered as soon as it
is registered (and fails here until ``backbone_specs.TINY_ARCHS`` has a tiny arch for it).
Each outcome is recorded for ``docs/reports/bad_inputs.md`` (see ``reliability_report``).
"""
import math

import pytest
import torch

from backbone_specs import TINY_ARCHS, build, build_variant, num_stages, registered_backbones, spec
from reliability_report import describe, record

NAMES = registered_backbones()


def expected_shapes(model, hw, batch=1):
    return [(batch, c, math.ceil(hw[0] / s), math.ceil(hw[1] / s))
            for c, s in zip(model.out_channels, model.out_strides)]


def run(model, x):
    with torch.no_grad():
        return model(x)


def test_every_registered_backbone_has_a_tiny_arch():
    missing = [n for n in NAMES if n not in TINY_ARCHS]
    assert not missing, f'add TINY_ARCHS entries in backbone_specs.py for {missing}'


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('hw', [(33, 47), (47, 33), (95, 65)])
def test_odd_and_non_square_sizes(name, hw):
    model = build(name)
    outs = run(model, torch.randn(1, 3, *hw))
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, hw)
    record('sizes', name, f'{hw[0]}x{hw[1]} input',
           'ok: ' + ', '.join('x'.join(map(str, o.shape[2:])) for o in outs),
           title='Odd and non-square sizes (work; maps are ceil(H / stride))')


@pytest.mark.parametrize('name', NAMES)
def test_smallest_input_works_and_below_names_the_minimum(name):
    model = build(name)
    assert hasattr(model, 'min_input_size'), f'{name} must declare min_input_size()'
    S = model.min_input_size()[0]
    assert model.min_input_size() == (S, S) and S >= 1
    # the minimum works, square and non-square, in eval and (batch 2) in train mode
    for hw in [(S, S), (S, S + 7), (S + 7, S)]:
        outs = run(model, torch.randn(1, 3, *hw))
        assert [tuple(o.shape) for o in outs] == expected_shapes(model, hw)
    model.train()
    outs = model(torch.randn(2, 3, S, S))
    sum(o.sum() for o in outs).backward()
    model.eval()
    record('min_size', name, f'{S}x{S} input (min_input_size())', 'ok',
           title='Smallest input (min_input_size()) works')
    below = (S - 1, S - 1)
    with pytest.raises(ValueError, match=rf'{S}x{S}') as err:
        run(model, torch.randn(1, 3, *below))
    record('below_min', name, f'{below[0]}x{below[1]} input', describe(err.value),
           title='Below the smallest input: ValueError naming the minimum')


@pytest.mark.parametrize('name', NAMES)
def test_single_pixel_batch_of_one_in_train_mode(name):
    """Batch norm (SimA's conv stem / LPI) cannot train on one value per channel: torch's
    ValueError, documented; other families train at 1x1."""
    model = build(name).train()
    S = model.min_input_size()[0]
    try:
        model(torch.randn(1, 3, S, S))
        outcome = 'ok'
    except ValueError as err:  # anything else (an op crash) fails the test
        assert 'Expected more than 1 value per channel' in str(err)
        assert any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        outcome = describe(err)
    record('train_1px', name, f'train mode, batch 1, {S}x{S} input', outcome,
           title='Train mode with one sample of the minimum size')


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('channels', [1, 4])
def test_wrong_channel_count(name, channels):
    model = build(name)
    S = max(model.min_input_size()[0], 32)
    kind = 'grayscale' if channels == 1 else 'RGBA'
    with pytest.raises(ValueError, match=rf'built for 3 input channels, got an input with '
                                         rf'{channels}') as err:
        run(model, torch.randn(1, channels, S, S))
    record('channels', name, f'{kind} ({channels}-channel) input, in_channels=3',
           describe(err.value), title='Wrong channel count (grayscale / 4-channel)')
    # ... and a model built for that many channels takes it
    matching = build(name, in_channels=channels)
    outs = run(matching, torch.randn(1, channels, S, S))
    assert [tuple(o.shape) for o in outs] == expected_shapes(matching, (S, S))


@pytest.mark.parametrize('name', NAMES)
def test_not_a_batch_of_images(name):
    model = build(name)
    with pytest.raises(ValueError, match=r'\(B, C, H, W\)') as err:
        run(model, torch.randn(3, 40, 40))
    record('ndim', name, '(3, 40, 40) tensor (no batch dimension)', describe(err.value),
           title='Not a (B, C, H, W) batch')


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('bad', ['nan', 'inf', '-inf'])
def test_nan_inf_input_does_not_crash_or_leak_across_the_batch(name, bad):
    """No exception inside an op; the corrupt sample's maps turn NaN (global attention
    spreads one bad pixel over the whole map), the clean sample of the batch is unaffected
    (eval mode)."""
    model = build(name)
    S = max(model.min_input_size()[0], 40)
    x = torch.randn(2, 3, S, S)
    clean = run(model, x[1:])
    x[0, 0, 5, 7] = float(bad)
    outs = run(model, x)
    assert [tuple(o.shape) for o in outs] == expected_shapes(model, (S, S), batch=2)
    for out, ref in zip(outs, clean):
        torch.testing.assert_close(out[1:], ref, rtol=1e-4, atol=1e-5)
    frac = [float((~torch.isfinite(o[0])).float().mean()) for o in outs]
    assert max(frac) > 0, 'a non-finite pixel vanished without a trace'
    record('nan', name, f'one {bad} pixel in sample 0 of a batch of 2 ({S}x{S}, eval)',
           'no exception; non-finite share of sample-0 maps per stage: '
           + ', '.join(f'{f:.0%}' for f in frac) + '; sample 1 identical to a clean run',
           title='NaN / inf pixels (no error: documented behaviour)')


@pytest.mark.parametrize('name', NAMES)
def test_unknown_arch_lists_the_valid_ones(name):
    cls = type(build(name))
    with pytest.raises(ValueError, match='unknown arch') as err:
        cls(arch='no-such-arch')
    for arch in cls.arch_zoo:
        assert arch in str(err.value)
    record('arch', name, f"{name}(arch='no-such-arch')", describe(err.value),
           title="Unknown arch (the error lists the valid ones)")


@pytest.mark.parametrize('name', NAMES)
def test_custom_arch_with_wrong_keys(name):
    cls = type(build(name))
    with pytest.raises(ValueError, match='missing') as err:
        cls(arch=dict(embed_dims=8))
    record('arch_dict', name, f'{name}(arch=dict(embed_dims=8))', describe(err.value),
           title='Custom arch dict with missing keys')


@pytest.mark.parametrize('name', NAMES)
def test_out_indices_out_of_range(name):
    model = build(name)
    n = num_stages(model)
    bad = (0, 1, 2, n + 5)
    with pytest.raises(ValueError, match='out of range') as err:
        build(name, out_indices=bad)
    record('out_indices', name, f'out_indices={bad}', describe(err.value),
           title='out_indices out of range')


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('which', ['too_large', 'negative'])
def test_frozen_stages_out_of_range(name, which):
    model = build(name)
    bad = num_stages(model) + 5 if which == 'too_large' else -2
    with pytest.raises(ValueError, match='frozen_stages') as err:
        build(name, frozen_stages=bad)
    record('frozen', name, f'frozen_stages={bad}', describe(err.value),
           title='frozen_stages out of range')


@pytest.mark.parametrize('name', NAMES)
def test_spec_variant_has_the_same_layout(name):
    """Guard of the checkpoint tests: the declared variant differs only in shapes."""
    a, b = build(name).state_dict(), build_variant(name).state_dict()
    assert a.keys() == b.keys()
    assert any(a[k].shape != b[k].shape for k in a)
    assert spec(name)['kwargs'] != spec(name)['variant']
