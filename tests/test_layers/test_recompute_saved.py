"""Tensors not kept for the backward but recomputed there (``recomputed_when_saved``): the
LayerNorm outputs of ``PreNormBlock``, the q / k / v and resized positional table of
``FocusedLinearAttentionQKV``; and the depth-wise convolution's own backward on CPU
(``DepthwiseConvCPU``). Each gives the gradients of the plain computation; what is not
kept is checked by whether the tensor is still alive after the forward."""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.multiprocessing.reductions import StorageWeakRef

from flatten_mm.models.backbones import FLattenCSWin, FLattenPVTv2, FLattenSwin
from flatten_mm.models.layers import conv as conv_mod
from flatten_mm.models.layers import focused_linear_attention as fla_mod
from flatten_mm.models.layers.focused_linear_attention import FocusedLinearAttentionQKV
from flatten_mm.models.layers.transformer_block import PreNormBlock
from flatten_mm.models.layers.window_attention import ShiftedWindowAttention
from flatten_mm.models.ops.autograd_paths import observes_saved, recomputed_when_saved


def _counting(fn, calls):
    def run(*args):
        calls.append(1)
        return fn(*args)
    return run


def _ref(t):
    """Whether ``t``'s storage is still alive: ``not _ref(t).expired()``."""
    return StorageWeakRef(t.untyped_storage())


def _sin_mm_step(x, w, recompute, calls, hooks=contextlib.nullcontext()):
    """``(sin(x) @ w) * sin(x)`` (mm and mul keep ``sin(x)``; sin keeps ``x``), optionally
    not kept; returns whether ``sin(x)`` is alive after the forward, and the gradients."""
    with hooks:
        y = torch.sin(x)
        ref = _ref(y)
        ctx = (recomputed_when_saved(y, _counting(torch.sin, calls), x) if recompute
               else contextlib.nullcontext())
        with ctx:
            out = (y @ w) * y[:, :1]  # two views of y saved
        del y
    alive = not ref.expired()
    grads = torch.autograd.grad(out.square().sum(), (x, w))
    return alive, grads


def test_recomputed_tensor_is_not_kept_and_gradients_equal():
    """The tensor is freed after the forward (kept without the block: the check can
    fail), recomputed once for the two saves, and the gradients are bit-identical."""
    torch.manual_seed(0)
    x = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    calls = []
    kept, plain = _sin_mm_step(x, w, False, calls)
    freed, grads = _sin_mm_step(x, w, True, calls)
    assert kept and not freed
    assert len(calls) == 1
    for a, b in zip(grads, plain):
        assert torch.equal(a, b)


def test_recompute_stands_aside_under_other_hooks_but_not_observers():
    """Under non-reentrant checkpointing (other saved-tensor hooks) nothing is recomputed
    by the block (checkpointing recomputes the whole region itself); under a hook marked
    ``observes_saved`` the block applies and the observer sees only what is kept."""
    torch.manual_seed(0)
    x = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    _, plain = _sin_mm_step(x, w, False, [])

    calls = []

    def region(x, w):
        y = torch.sin(x)
        with recomputed_when_saved(y, _counting(torch.sin, calls), x):
            return (y @ w) * y[:, :1]
    out = cp.checkpoint(region, x, w, use_reentrant=False)
    grads = torch.autograd.grad(out.square().sum(), (x, w))
    assert calls == []  # (checkpointing ran region twice; the block stood aside)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))

    seen = []
    observer = observes_saved(lambda t: seen.append(t.data_ptr()) or t)
    hooks = torch.autograd.graph.saved_tensors_hooks(observer, lambda t: t)
    freed, grads = _sin_mm_step(x, w, True, calls, hooks)
    assert not freed and len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))
    assert w.data_ptr() in seen and x.data_ptr() in seen  # (kept: w by mm, x for recompute)


def test_recompute_nests_and_supports_double_backward():
    """An inner block whose recompute needs the outer block's tensor holds the outer
    recipe (both freed); a ``create_graph`` backward records the recomputation, so second
    derivatives equal the plain ones."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)

    def step(recompute):
        y = torch.sin(x)
        refs = [_ref(y)]
        outer = recomputed_when_saved(y, torch.sin, x) if recompute else contextlib.nullcontext()
        with outer:
            z = y @ w
            refs.append(_ref(z))
            inner = (recomputed_when_saved(z, torch.mm, y, w) if recompute
                     else contextlib.nullcontext())
            with inner:
                out = torch.tanh(z) * z
        del y, z
        alive = [not r.expired() for r in refs]
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
        return alive, g, torch.autograd.grad(g.square().sum(), (x, w))

    alive_plain, g_plain, gg_plain = step(False)
    alive, g, gg = step(True)
    assert all(alive_plain) and not any(alive)
    assert torch.allclose(g, g_plain, rtol=1e-13, atol=0)
    for a, b in zip(gg, gg_plain):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def _random_norms(model):
    """LayerNorms with random affine parameters (not the 1 / 0 of their initialisation,
    which a recomputation could get away with ignoring)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1, 0.2), m.bias.normal_(0, 0.2)
    return model


@pytest.mark.parametrize('attn', ['fla', 'fla-window', 'swin'])
def test_prenorm_block_recomputed_norms_and_projection(attn):
    """``PreNormBlock`` (float64): the norms' outputs -- and FLA's q, k, v (one storage) and
    its resized positional table -- are freed after the forward with the default
    recomputation and kept with ``recompute_norms=False`` / the FLA blocks' contexts
    disabled; output and every gradient equal within float64 rounding."""
    torch.manual_seed(0)
    C, h, hw = 12, 3, (7, 9)
    if attn == 'swin':
        op = ShiftedWindowAttention(C, h, window_size=4, shift=True)
    else:
        op = FocusedLinearAttentionQKV(C, h, window_size=4 if attn == 'fla-window' else None,
                                       pretrain_hw_shape=(5, 5), kernel_size=5)
    block = _random_norms(PreNormBlock(C, op).double())
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64, requires_grad=True)
    watched = {}

    def keep_ref(name):
        return lambda mod, args, out: watched.__setitem__(name, _ref(out))
    block.norm1.register_forward_hook(keep_ref('norm1'))
    block.norm2.register_forward_hook(keep_ref('norm2'))
    if attn != 'swin':
        op.qkv.register_forward_hook(keep_ref('qkv'))
    results = {}
    for lean in (True, False):
        block.recompute_norms = lean
        with contextlib.ExitStack() as stack:
            if not lean:  # (the FLA operator's own contexts off too)
                for name in ('_projection_recomputed', '_table_recomputed'):
                    stack.enter_context(_patched(fla_mod, name,
                                                 lambda *a: contextlib.nullcontext()))
            out = block(x, hw)
            alive = {k: not r.expired() for k, r in watched.items()}
            grads = torch.autograd.grad(out.square().sum(), [x] + list(block.parameters()))
        results[lean] = alive, [out.detach()] + list(grads)
    (alive_lean, lean), (alive_plain, plain) = results[True], results[False]
    # (windowed attention keeps its padded / partitioned copy, never norm1's output)
    assert alive_plain == dict(norm1=attn == 'fla', norm2=True,
                               **({} if attn == 'swin' else dict(qkv=True))), alive_plain
    assert not any(alive_lean.values()), alive_lean
    for a, b in zip(lean, plain):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-13)


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _backbone_grads(model, x):
    outs = model(x)
    loss = sum(o.square().mean() for o in outs)
    params = [p for p in model.parameters() if p.requires_grad]
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, [x] + params))


@pytest.mark.parametrize('with_cp', [False, True])
@pytest.mark.parametrize('cls', [FLattenSwin, FLattenCSWin, FLattenPVTv2])
def test_backbones_recompute_norms_same_gradients(cls, with_cp):
    """FLatten-Swin, FLatten-CSwin and FLatten-PVTv2, float32, with and without
    ``with_cp``: outputs and all gradients with the default recomputation (norms, FLA
    q / k / v and resized tables, the CPU depth-wise conv backward) equal those with
    ``recompute_norms=False`` (Swin, CSwin), the FLA contexts off and the plain depth-wise
    conv within float32 rounding."""
    torch.manual_seed(0)
    arch = dict(embed_dims=16, depths=(1, 2, 1, 1), num_heads=(2, 2, 4, 4))
    kwargs = dict(window_size=4) if cls is FLattenSwin else dict(split_size=4)
    plain_kwargs = dict(recompute_norms=False)
    if cls is FLattenPVTv2:
        arch = dict(embed_dims=(8, 16, 24, 32), depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4),
                    mlp_ratios=(2, 2, 2, 2))
        kwargs, plain_kwargs = {}, {}
    lean = _random_norms(cls(arch=arch, drop_path_rate=0., with_cp=with_cp, **kwargs))
    plain = cls(arch=arch, drop_path_rate=0., with_cp=with_cp, **plain_kwargs, **kwargs)
    plain.load_state_dict(lean.state_dict())
    lean.train(), plain.train()
    x = torch.randn(2, 3, 60, 52, requires_grad=True)
    a = _backbone_grads(lean, x)
    with _patched(fla_mod, '_projection_recomputed', lambda *a: contextlib.nullcontext()), \
            _patched(fla_mod, '_table_recomputed', lambda *a: contextlib.nullcontext()), \
            _patched(conv_mod, '_fast_depthwise', lambda *a: False):
        b = _backbone_grads(plain, x)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        scale = v.abs().max().clamp_min(1e-30)
        assert ((u - v).abs().max() / scale) < 2e-5


@pytest.mark.parametrize('kernel,repeat,batch', [(5, 3, 2), (7, 1, 1), (5, 1, 3)])
def test_depthwise_conv_cpu_backward(kernel, repeat, batch):
    """``token_conv`` on a recorded CPU step of a depth-wise conv above 3x3 runs
    ``DepthwiseConvCPU``: the same output and, in float64, the gradients of ``F.conv2d``
    (input, weight shared by ``repeat`` heads, bias) within float64 rounding; the bands
    of rows cover maps taller than one band. A 3x3 conv keeps torch's own backward."""
    torch.manual_seed(0)
    C, hw = 4, (conv_mod._BAND_ROWS * 2 + 3, 11)
    conv = nn.Conv2d(C, C, kernel, 1, kernel // 2, groups=C).double()
    x = torch.randn(batch, hw[0] * hw[1], C * repeat, dtype=torch.float64,
                    requires_grad=True)
    calls = []
    with _patched(conv_mod.DepthwiseConvCPU, 'apply',
                  _counting(conv_mod.DepthwiseConvCPU.apply, calls)):
        y = conv_mod.token_conv(conv, x, hw, repeat=repeat)
    assert calls == [1]
    w, b = conv_mod.repeat_depthwise(conv, repeat) if repeat > 1 else (conv.weight, conv.bias)
    img = x.view(batch, hw[0], hw[1], C * repeat).permute(0, 3, 1, 2)
    ref = F.conv2d(img, w, b, 1, kernel // 2, 1, C * repeat).permute(0, 2, 3, 1)
    ref = ref.reshape(batch, -1, C * repeat)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, conv.weight, conv.bias), g)
    want = torch.autograd.grad(ref, (x, conv.weight, conv.bias), g)
    for a, c in zip(got, want):
        assert torch.allclose(a, c, rtol=1e-12, atol=1e-12)
    small = nn.Conv2d(C, C, 3, 1, 1, groups=C)
    xs = torch.randn(1, hw[0] * hw[1], C, requires_grad=True)
    assert not conv_mod._fast_depthwise(conv_mod.tokens_as_map(xs, hw), small.weight, small)


def test_depthwise_conv_cpu_backward_under_autocast():
    """Under bf16 autocast the conv runs in bf16 as ``nn.Conv2d`` would (the same output
    bit for bit) and the backward gives bf16-rounded gradients of the plain conv's, the
    parameters' in float32."""
    torch.manual_seed(0)
    C, hw = 6, (20, 9)
    conv = nn.Conv2d(C, C, 5, 1, 2, groups=C)
    x = torch.randn(1, hw[0] * hw[1], C, requires_grad=True)
    outs = []
    for fast in (True, False):
        with _patched(conv_mod, '_fast_depthwise', lambda *a, f=fast: f), \
                torch.autocast('cpu', dtype=torch.bfloat16):
            y = conv_mod.token_conv(conv, x, hw)
        grads = torch.autograd.grad(y.float().square().sum(), (x, conv.weight, conv.bias))
        outs.append([y] + list(grads))
    (y, *g), (y_ref, *g_ref) = outs
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    assert [t.dtype for t in g] == [torch.float32] * 3
    for a, b in zip(g, g_ref):
        assert ((a - b).norm() / b.norm()) < 2**-7


@pytest.mark.parametrize('cls', [FLattenSwin, FLattenCSWin])
def test_backbones_recompute_under_bf16_autocast(cls):
    """Under bf16 autocast the recomputations run under the forward's autocast state: the
    outputs and every gradient equal those with ``recompute_norms=False`` and the FLA
    contexts off (the same casts, the same kernels)."""
    torch.manual_seed(0)
    arch = dict(embed_dims=16, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 4))
    kwargs = dict(window_size=4) if cls is FLattenSwin else dict(split_size=4)
    lean = _random_norms(cls(arch=arch, drop_path_rate=0., **kwargs))
    plain = cls(arch=arch, drop_path_rate=0., recompute_norms=False, **kwargs)
    plain.load_state_dict(lean.state_dict())
    x = torch.randn(1, 3, 44, 36, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        a = _backbone_grads(lean, x)
        with _patched(fla_mod, '_projection_recomputed', lambda *a: contextlib.nullcontext()), \
                _patched(fla_mod, '_table_recomputed', lambda *a: contextlib.nullcontext()):
            b = _backbone_grads(plain, x)
    assert a[0].dtype == torch.bfloat16
    for u, v in zip(a, b):
        assert torch.equal(u, v)
