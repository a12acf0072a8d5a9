"""An empty batch (B = 0: a user's sampler, a batch emptied by filtering) on every path of
every backbone: the outputs have the shapes of a non-empty batch with 0 samples, a
backward gives finite (zero) gradients, in training and inference, on the PyTorch path,
in the kernels' auto mode (emulated on the CPU) and with ``use_triton=True``."""
import warnings

import pytest
import torch

import backbone_specs as specs
from conftest import import_interpreted

import_interpreted('flatten_mm.models.ops.fla_triton', 'flatten_mm.models.ops.quadtree_triton')
from flatten_mm.models.layers import FocusedLinearAttention, QuadTreeAttention  # noqa: E402
from flatten_mm.models.ops import dispatch  # noqa: E402

CASES = {name: {} for name in specs.registered_backbones()}
CASES['QuadTreePVTv2-A'] = dict(attn_cfg=dict(topk=4, attn_type='A'))


@pytest.mark.parametrize('mode', ['pytorch', 'auto'])
@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('case', sorted(CASES))
def test_empty_batch(monkeypatch, case, training, mode):
    if mode == 'auto':
        monkeypatch.setenv('TRITON_INTERPRET', '1')
        monkeypatch.setattr(dispatch, 'AUTO_DEVICE_TYPES', ('cuda', 'cpu'))
    else:
        monkeypatch.setenv(dispatch.TRITON_ENV, '0')
    dispatch.reset()
    name = case.split('-')[0]
    torch.manual_seed(0)
    model = specs.build(name, **CASES[case]).train(training)
    x = torch.randn(0, 3, 64, 48, requires_grad=training)
    reference = model(torch.randn(1, 3, 64, 48)) if not training else None
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        with torch.set_grad_enabled(training):
            outs = model(x)
        if training:
            sum(o.sum() for o in outs).backward()
    if reference is not None:
        assert [o.shape[1:] for o in outs] == [r.shape[1:] for r in reference]
    assert all(o.shape[0] == 0 for o in outs)
    if training:
        assert x.grad is not None and x.grad.shape == x.shape
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()
                   if p.grad is not None)
    dispatch.reset()


@pytest.mark.parametrize('op', ['fla', 'quadtree'])
def test_forced_kernels_take_an_empty_batch(monkeypatch, op):
    """``use_triton=True`` with B = 0: nothing to compute, the PyTorch path, no error."""
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    m = (FocusedLinearAttention(16, 2, pretrain_hw_shape=(8, 8), use_triton=True) if op == 'fla'
         else QuadTreeAttention(16, 2, num_levels=3, topk=4, use_triton=True))
    x = torch.randn(0, 16 * 16, 16, requires_grad=True)
    out = m(x, (16, 16))
    out.sum().backward()
    assert out.shape == (0, 256, 16) and x.grad.shape == x.shape
