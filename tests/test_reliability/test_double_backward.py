"""Double backward (``create_graph=True``: gradient penalties, meta-learning) through every
custom autograd function and every backbone family.

The memory-lean and fused backwards are written for one differentiation; under
``create_graph`` each differentiates its op-by-op formula instead
(``ops.autograd_paths.differentiate_reference``), so second derivatives are exact: each
function passes ``gradgradcheck`` in float64 (the Triton ops, float32 only, against the
PyTorch path), and every family's gradient penalty gives the same gradients on every path.
torch's own ``scaled_dot_product_attention`` has no double backward in its fused CPU /
CUDA kernels; the softmax layers that call it (window attention, CSwin stripes, QuadTree's
coarsest level) need ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`` around the
forward, as in any PyTorch model (docs/advanced/kernels.md).
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import backbone_specs as specs
from conftest import import_interpreted

import_interpreted('flatten_mm.models.ops.fla_triton', 'flatten_mm.models.ops.quadtree_triton')
from flatten_mm.models.layers import LPI, PVTMlp  # noqa: E402
from flatten_mm.models.layers.conv import DepthwiseConvCPU  # noqa: E402
from flatten_mm.models.layers.quadtree_attention import (_level_reference,  # noqa: E402
                                                         gathered_messages, gathered_scores)
from flatten_mm.models.ops import dispatch  # noqa: E402
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels  # noqa: E402


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=dtype).requires_grad_()


# --------------------------------------------------------------------------- functions
@pytest.mark.parametrize('dwconv', [False, True])
def test_mlp_recomputed_activation_gradgradcheck(dwconv):
    """``PVTMlp(recompute_act=True)`` (the default; before: "matmul(): functions with
    out=... arguments don't support automatic differentiation")."""
    torch.manual_seed(0)
    mlp = PVTMlp(4, 6, dwconv=dwconv).double()
    x = _rand(1, 6, 4)
    assert mlp._recomputes_act(x)
    params = tuple(mlp.parameters())

    def f(x, *p):
        return torch.func.functional_call(mlp, dict(zip(dict(mlp.named_parameters()), p)),
                                          (x, (2, 3)))

    assert torch.autograd.gradgradcheck(f, (x, ) + params)


def test_lpi_recomputed_activation_gradgradcheck():
    torch.manual_seed(0)
    lpi = LPI(3).double().train()
    x = _rand(2, 6, 3)
    assert lpi._recomputes_act(torch.randn(2, 3, 2, 3, dtype=torch.float64,
                                           requires_grad=True))
    names = [n for n, _ in lpi.named_parameters()]

    def f(x, *p):
        return torch.func.functional_call(lpi, dict(zip(names, p)), (x, (2, 3)))

    assert torch.autograd.gradgradcheck(f, (x, ) + tuple(lpi.parameters()))


def test_depthwise_conv_cpu_gradgradcheck():
    img, weight, bias = _rand(1, 3, 5, 6), _rand(3, 1, 5, 5, seed=1), _rand(3, seed=2)
    assert torch.autograd.gradgradcheck(
        lambda i, w, b: DepthwiseConvCPU.apply(i, w, b, (2, 2)), (img, weight, bias))


@pytest.mark.parametrize('scores', [True, False])
def test_gathered_ops_gradgradcheck(scores):
    B, h, L, M, K, d = 1, 2, 3, 8, 4, 3
    a = _rand(B, h, L, 4, d if scores else K)
    src = _rand(B, h, M, d, seed=1)
    index = torch.randint(0, M, (B, h, L, K), generator=torch.Generator().manual_seed(2))
    fn = gathered_scores if scores else gathered_messages
    assert torch.autograd.gradgradcheck(lambda a, s: fn(a, s, index, use_triton=False),
                                        (a, src))


@pytest.mark.parametrize('variant', ['A', 'B'])
def test_quadtree_cpu_level_double_backward(variant):
    """The CPU training kernel's level (float32): a gradient penalty through it equals one
    through its op-by-op formula for the same selection."""
    cpu_kernels.quadtree_level_kernel()
    if not cpu_kernels.enabled() or cpu_kernels.quadtree_level_kernel() is None:
        pytest.fail(f'the QuadTree CPU kernel did not build: {cpu_kernels.status()}')
    BH, H, W, d, Kp, topk = 2, 4, 6, 4, 3, 2
    M = H * W
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BH, M, d, generator=g).requires_grad_() for _ in range(3))
    prev_idx = torch.stack([torch.randperm(M // 4, generator=g)[:Kp]
                            for _ in range(BH * M // 4)]).view(BH, M // 4, Kp)
    prev = (torch.rand(BH, M // 4, Kp, generator=g).requires_grad_() if variant == 'A'
            else None)
    leaves = [t for t in (q, k, v, prev) if t is not None]
    msg, idx, score = cpu_kernels.level(q, k, v, prev_idx, prev, W, d ** -0.5, topk)
    ref_msg, ref_score = _level_reference(q, k, v, prev_idx, prev, idx, W, d ** -0.5)
    results = []
    for m, s in ((msg, score), (ref_msg, ref_score)):
        loss = (m * torch.linspace(-1, 1, m.numel()).view_as(m)).sum()
        if s is not None:
            loss = loss + s.square().sum()
        first = torch.autograd.grad(loss, leaves, create_graph=True)
        results.append(torch.autograd.grad(sum(t.square().sum() for t in first), leaves))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- families
FAMILIES = ['FLattenPVT', 'FLattenPVTv2', 'FLattenSwin', 'FLattenCSWin', 'SimAXCiT',
            'QuadTreePVTv2']


def _penalty_grads(model, x):
    """Parameter gradients of a gradient penalty ``||d loss / d x||^2``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    x = x.clone().requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        outs = model(x)
    gen = torch.Generator().manual_seed(2)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o)).sum() for o in outs)
    gx, = torch.autograd.grad(loss, x, create_graph=True)
    gx.square().sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _relative(a, b):
    num = sum(((a[n].double() - b[n].double()) ** 2).sum() for n in b)
    return float((num / sum((b[n].double() ** 2).sum() for n in b)).sqrt())


@pytest.mark.timeout(900)
@pytest.mark.parametrize('name', FAMILIES)
def test_gradient_penalty_through_every_family(monkeypatch, name):
    """Float32 on the default paths (CPU kernels; the Triton kernels in emulated auto mode)
    equals the float64 PyTorch path's: relative difference of all parameter gradients
    within 3e-4 (float32 rounding of a second derivative; measured 1e-6 - 1.3e-4, the
    largest for FLatten-Swin, the same on both paths), with no warning."""
    torch.manual_seed(0)
    model = specs.build(name).train()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    reference = _penalty_grads(copy.deepcopy(model).double(), x.double())
    assert _relative(_penalty_grads(model, x), reference) <= 3e-4
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    monkeypatch.setattr(dispatch, 'AUTO_DEVICE_TYPES', ('cuda', 'cpu'))
    dispatch.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('error', RuntimeWarning)
            got = _penalty_grads(model, x)
        assert all(dispatch.verdicts().values())
    finally:
        dispatch.reset()
    assert _relative(got, reference) <= 3e-4
