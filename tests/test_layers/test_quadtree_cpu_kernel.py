"""The fused QuadTree CPU kernels (``ops.quadtree_cpu`` + ``ops/csrc/quadtree_cpu.cpp``) against
the pure-PyTorch paths they replace: messages, selected keys (A: and their weights), the
backward's gradients (against a float64 reference, the batched path, per module and per
backbone with and without ``with_cp``), both variants, every head-width code path (AVX2
for d = 16/32/64, generic otherwise), batches, heads, odd and non-square maps; ties, NaN,
thread counts, the switch and the build fallback.

The kernel is built on first use; in CI (``FLATTEN_MM_REQUIRE_CPU_KERNELS=1``) a failed
build is an error, elsewhere these tests are skipped with the build error as the reason."""
import os
import warnings

import pytest
import torch

from flatten_mm.models import QuadTreePVTv2
from flatten_mm.models.layers import QuadTreeAttention
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels
from flatten_mm.models.ops.quadtree_cpu_infer import finer_level_cpu
from flatten_mm.models.ops.quadtree_rows import finer_level_rows
from flatten_mm.models.ops.quadtree_layout import child_candidates, to_heads


def _kernel():
    op = cpu_kernels.quadtree_level_kernel()
    if op is None:
        pytest.skip(f'fused CPU kernel: {cpu_kernels.status()}')
    return op


def _level_inputs(B, h, d, hw, Kp, gen, attn_type):
    """Random level inputs with valid parent selections (distinct parents per query)."""
    H, W = hw
    M, Mp = H * W, (H // 2) * (W // 2)
    q_map = torch.randn(B, h * d, H, W, generator=gen)
    k, v = (torch.randn(B, h, M, d, generator=gen) for _ in range(2))
    prev_idx = torch.rand(B, h, Mp, Mp, generator=gen).argsort(-1)[..., :Kp].contiguous()
    prev_score = torch.rand(B, h, Mp, Kp, generator=gen) if attn_type == 'A' else None
    return q_map, k, v, prev_idx, prev_score


# (attn_type, B, heads, d, (H, W), Kp, topk): d 16/32/64 take the AVX2 code, 8/24/33 the
# generic loops; topk None = the final level
LEVEL_CASES = [
    ('B', 1, 1, 32, (56, 56), 32, 32),
    ('B', 2, 2, 32, (28, 20), 16, 24),
    ('B', 1, 3, 64, (16, 12), 8, 8),
    ('B', 2, 1, 16, (12, 18), 5, None),
    ('B', 1, 2, 8, (10, 14), 7, 20),
    ('B', 2, 1, 33, (8, 8), 4, 16),
    ('B', 1, 2, 24, (6, 10), 15, 60),  # topk = all candidates
    ('A', 1, 1, 32, (56, 56), 32, 32),
    ('A', 2, 2, 16, (20, 12), 6, 12),
    ('A', 1, 3, 33, (8, 12), 4, None),
    ('A', 2, 1, 64, (12, 8), 3, 5),
]


@pytest.mark.parametrize('attn_type,B,h,d,hw,Kp,topk', LEVEL_CASES)
@pytest.mark.parametrize('with_init', [False, True])
def test_level_matches_pytorch_path(attn_type, B, h, d, hw, Kp, topk, with_init):
    op = _kernel()
    gen = torch.Generator().manual_seed(B * 1000 + d * 10 + Kp)
    q_map, k, v, prev_idx, prev_score = _level_inputs(B, h, d, hw, Kp, gen, attn_type)
    M = hw[0] * hw[1]
    init = torch.randn(B, h, M, d, generator=gen) if with_init else None
    temp = d**-0.5
    args = (q_map, k, v, prev_idx, prev_score, h, temp, attn_type, topk)
    ref_msg, ref_idx, ref_score = finer_level_rows(*args, None if init is None else init.clone())
    msg, idx, score = finer_level_cpu(*args, None if init is None else init.clone(), kernel=op)
    torch.testing.assert_close(msg, ref_msg, atol=2e-6, rtol=1e-5)
    if topk is None:
        assert idx is None and ref_idx is None
        return
    assert idx.shape == ref_idx.shape == (B, h, M, topk)
    # the same keys are passed on (in no particular order)
    order, ref_order = idx.argsort(-1), ref_idx.argsort(-1)
    assert torch.equal(idx.gather(-1, order), ref_idx.gather(-1, ref_order))
    if attn_type == 'A':
        torch.testing.assert_close(score.gather(-1, order), ref_score.gather(-1, ref_order),
                                   atol=1e-7, rtol=1e-5)
    else:
        assert score is None and ref_score is None


@pytest.mark.parametrize('attn_type', ['A', 'B'])
@pytest.mark.parametrize('dims,heads,levels,topk,hw', [
    (64, 2, 4, 8, (64, 48)),
    (32, 1, 3, 32, (56, 56)),
    (96, 3, 3, (6, 12), (41, 70)),  # padded to multiples of 4
    (66, 2, 2, 4, (30, 18)),  # d = 33
])
def test_module_matches_pytorch_path(attn_type, dims, heads, levels, topk, hw):
    _kernel()
    torch.manual_seed(0)
    m = QuadTreeAttention(dims, heads, attn_type=attn_type, num_levels=levels, topk=topk).eval()
    x = torch.randn(2, hw[0] * hw[1], dims)
    with torch.no_grad():
        with cpu_kernels.use_cpu_kernels(False):
            ref = m(x, hw)
        out = m(x, hw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_kernel_is_used_on_cpu_for_inference_and_training(monkeypatch):
    _kernel()
    calls = []
    real, real_level = cpu_kernels.quadtree_level_kernel, cpu_kernels.level

    def spy():
        op = real()
        return None if op is None else (lambda *a: calls.append('inference') or op(*a))

    monkeypatch.setattr(cpu_kernels, 'quadtree_level_kernel', spy)
    monkeypatch.setattr(cpu_kernels, 'level',
                        lambda *a: calls.append('train') or real_level(*a))
    m = QuadTreeAttention(16, 2, num_levels=3, topk=4)
    x = torch.randn(1, 16 * 16, 16)
    m(x, (16, 16)).sum().backward()
    assert calls == ['train', 'train']  # the two finer levels, with autograd
    calls.clear()
    with torch.no_grad():
        m(x, (16, 16))
    assert calls == ['inference', 'inference']
    calls.clear()
    with cpu_kernels.use_cpu_kernels(False):
        m(x, (16, 16)).sum().backward()
        with torch.no_grad():
            m(x, (16, 16))
    assert not calls
    m.margin_recorder = lambda level, margin: None  # margins: the PyTorch path
    m(x, (16, 16)).sum().backward()
    assert not calls


def _dense_level(q, k, v, prev_idx, prev_score, width, temp, topk):
    """One finer level written densely (every query's ``4 Kp`` candidate rows gathered):
    the float64 reference of ``cpu_kernels.level``."""
    BH, M, d = q.shape
    pw = width // 2
    rows = torch.arange(M)
    parent = (rows // width // 2) * pw + rows % width // 2
    cand = child_candidates(prev_idx, pw)[:, parent]  # (BH, M, K)
    heads = torch.arange(BH)[:, None, None]
    kg, vg = k[heads, cand], v[heads, cand]  # (BH, M, K, d)
    scores = (q.unsqueeze(2) * kg).sum(-1) * temp
    K = cand.shape[-1]
    if prev_score is None:
        attn = scores.softmax(-1)
    else:
        attn = scores.view(BH, M, K // 4, 4).softmax(-1) * prev_score[:, parent, :, None]
        attn = attn.view(BH, M, K)
    weights, idx, score = attn, None, None
    if topk:
        score, sel = attn.topk(topk, -1) if prev_score is not None else attn.detach().topk(topk, -1)
        idx = cand.gather(-1, sel)
        if prev_score is not None:
            weights = attn.scatter(-1, sel, 0.)
    return (weights.unsqueeze(-1) * vg).sum(2), idx, score


def _level_step(fn, q, k, v, prev_idx, prev_score, width, temp, topk, grad):
    """Messages, selections and the gradients of a loss over the messages and (A) the
    passed-on weights, weighted by their key rows (independent of the selection order)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ps = None if prev_score is None else prev_score.detach().clone().requires_grad_()
    msg, idx, score = fn(*leaves, prev_idx, ps, width, temp, topk)
    loss = (msg * grad).sum()
    if ps is not None and topk:
        loss = loss + (score * torch.sin(idx.to(score.dtype))).sum()
    grads = torch.autograd.grad(loss, leaves + ([ps] if ps is not None else []))
    return msg.detach(), idx, grads


@pytest.mark.parametrize('attn_type,B,h,d,hw,Kp,topk',
                         [c for c in LEVEL_CASES if c[4] != (56, 56)])
def test_level_gradients_match_float64_reference(attn_type, B, h, d, hw, Kp, topk):
    """``cpu_kernels.level`` forward and backward (B; A with the passed-on weights' gradient
    from the next level) against a dense float64 reference: every gradient within float32
    rounding of the reference's largest magnitude."""
    _kernel()
    gen = torch.Generator().manual_seed(B * 1000 + d * 10 + Kp)
    q_map, k, v, prev_idx, prev_score = _level_inputs(B, h, d, hw, Kp, gen, attn_type)
    BH, M = B * h, hw[0] * hw[1]
    q = to_heads(q_map, h).reshape(BH, M, d)
    k, v = k.reshape(BH, M, d), v.reshape(BH, M, d)
    prev_idx = prev_idx.reshape(BH, M // 4, Kp)
    prev_score = None if prev_score is None else prev_score.reshape(BH, M // 4, Kp)
    grad = torch.randn(BH, M, d, generator=gen)
    args = (prev_idx, prev_score, hw[1], d**-0.5, topk or 0, grad)
    msg, idx, grads = _level_step(cpu_kernels.level, q, k, v, *args)
    f64 = [t.double() if t is not None and t.is_floating_point() else t
           for t in (q, k, v, prev_idx, prev_score)]
    ref_msg, ref_idx, ref_grads = _level_step(_dense_level, *f64, *args[2:5], grad.double())
    torch.testing.assert_close(msg.double(), ref_msg, atol=2e-6, rtol=1e-5)
    if topk:
        assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)
    assert len(grads) == (4 if attn_type == 'A' else 3)
    for name, g, ref in zip(('q', 'k', 'v', 'prev_score'), grads, ref_grads):
        err = ((g.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert err < 1e-5, (name, err)


def test_level_backward_is_independent_of_the_thread_count():
    """Every gradient row has one writer: 1 and 3 threads give bit-identical gradients."""
    _kernel()
    gen = torch.Generator().manual_seed(3)
    q_map, k, v, prev_idx, _ = _level_inputs(2, 1, 32, (32, 24), 16, gen, 'B')
    q = to_heads(q_map, 1).reshape(2, -1, 32)
    k, v, prev_idx = k.reshape(2, -1, 32), v.reshape(2, -1, 32), prev_idx.reshape(2, -1, 16)
    grad = torch.randn(q.shape, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(_level_step(cpu_kernels.level, q, k, v, prev_idx, None, 24, 0.2,
                                       8, grad))
    finally:
        torch.set_num_threads(threads)
    (msg1, idx1, g1), (msg3, idx3, g3) = results
    assert torch.equal(msg1, msg3) and torch.equal(idx1, idx3)
    assert all(torch.equal(a, b) for a, b in zip(g1, g3))


@pytest.mark.parametrize('attn_type', ['A', 'B'])
@pytest.mark.parametrize('dims,heads,levels,topk,hw', [
    (64, 2, 4, 8, (64, 48)),
    (96, 3, 3, (6, 12), (41, 70)),  # padded to multiples of 4
    (66, 2, 2, 4, (30, 18)),  # d = 33
])
def test_module_trains_as_with_the_pytorch_path(attn_type, dims, heads, levels, topk, hw):
    """A training step of ``QuadTreeAttention`` with the kernels: output, input gradient and
    every parameter gradient as on the batched PyTorch path, within float32 rounding."""
    _kernel()
    torch.manual_seed(0)
    m = QuadTreeAttention(dims, heads, attn_type=attn_type, num_levels=levels, topk=topk)
    x = torch.randn(2, hw[0] * hw[1], dims)
    grad = torch.randn(x.shape)

    def step():
        m.zero_grad()
        xi = x.clone().requires_grad_()
        out = m(xi, hw)
        out.backward(grad)
        return out.detach(), xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()
                                       if p.grad is not None}

    out, dx, grads = step()
    with cpu_kernels.use_cpu_kernels(False):
        ref, ref_dx, ref_grads = step()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    _assert_gradients_close(dict(grads, x=dx), dict(ref_grads, x=ref_dx))


def _assert_gradients_close(grads, ref_grads):
    """Each gradient within 1e-4 of its largest magnitude, or of a thousandth of the largest
    of all (``k_proj.bias`` only shifts every score of a query: its gradient is zero up to
    rounding on both paths)."""
    floor = 1e-3 * max(r.abs().max() for r in ref_grads.values())
    for name, r in ref_grads.items():
        err = ((grads[name] - r).abs().max() / torch.maximum(r.abs().max(), floor)).item()
        assert err < 1e-4, (name, err)


@pytest.mark.parametrize('attn_type', ['A', 'B'])
@pytest.mark.parametrize('with_cp', [False, True])
def test_backbone_trains_as_with_the_pytorch_path(attn_type, with_cp):
    """A training step of a tiny QuadTree backbone (both variants, with and without
    ``with_cp``) with the kernels: outputs and every parameter gradient as without them."""
    _kernel()
    arch = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                mlp_ratios=(2, 2, 2, 2))
    x = torch.randn(1, 3, 160, 128, generator=torch.Generator().manual_seed(1))

    def step():
        torch.manual_seed(0)
        model = QuadTreePVTv2(arch=arch, attn_cfg=dict(topk=4, attn_type=attn_type),
                              drop_path_rate=0., with_cp=with_cp).train()
        outs = model(x.clone().requires_grad_(with_cp))
        sum((o * torch.linspace(0.5, 1.5, o.shape[1]).view(1, -1, 1, 1)).mean()
            for o in outs).backward()
        return outs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    outs, grads = step()
    with cpu_kernels.use_cpu_kernels(False):
        ref_outs, ref_grads = step()
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    _assert_gradients_close(grads, ref_grads)


def test_ties_take_the_lowest_candidates():
    """All scores equal: the kernel passes on the first ``topk`` candidates (children of
    the selected parents in order), deterministically."""
    op = _kernel()
    H = W = 8
    d, Kp, topk = 32, 4, 6
    q_map = torch.zeros(1, d, H, W)
    k = v = torch.randn(1, 1, H * W, d)
    prev_idx = torch.tensor([3, 0, 9, 14]).expand(1, 1, 16, Kp).contiguous()
    _, idx, _ = finer_level_cpu(q_map, k, v, prev_idx, None, 1, 1.0, 'B', topk, kernel=op)
    # children of parent 3 (row 0, col 3 of the 4x4 parent grid) come first: 6, 7, 14, 15
    expected = torch.tensor([6, 7, 14, 15, 0, 1])
    assert torch.equal(idx.sort(-1).values[0, 0], expected.sort().values.expand(64, topk))


def test_nan_query_stays_local_and_non_finite():
    op = _kernel()
    gen = torch.Generator().manual_seed(0)
    q_map, k, v, prev_idx, _ = _level_inputs(1, 1, 32, (16, 16), 8, gen, 'B')
    ref_msg, _, _ = finer_level_cpu(q_map, k, v, prev_idx, None, 1, 0.2, 'B', 8, kernel=op)
    q_map[0, :, 5, 7] = float('nan')
    msg, idx, _ = finer_level_cpu(q_map, k, v, prev_idx, None, 1, 0.2, 'B', 8, kernel=op)
    bad = 5 * 16 + 7
    assert torch.isnan(msg[0, 0, bad]).all()
    keep = torch.ones(256, dtype=torch.bool)
    keep[bad] = False
    torch.testing.assert_close(msg[0, 0, keep], ref_msg[0, 0, keep])
    assert ((idx >= 0) & (idx < 256)).all()  # selections stay valid rows


def test_switch_and_failed_build_fall_back(monkeypatch):
    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, num_levels=3, topk=4).eval()
    x = torch.randn(1, 16 * 16, 16)
    with torch.no_grad(), cpu_kernels.use_cpu_kernels(False):
        ref = m(x, (16, 16))
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, '0')
    assert cpu_kernels.quadtree_level_kernel() is None
    assert 'disabled' in cpu_kernels.status()
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH)

    # a machine without a compiler: one warning naming the reason, then the PyTorch path
    def broken_build():
        raise OSError('no C++ compiler found')

    monkeypatch.setattr(cpu_kernels, '_build', broken_build)
    monkeypatch.setattr(cpu_kernels, '_loaded', None)
    monkeypatch.setattr(cpu_kernels, '_error', None)
    monkeypatch.delenv(cpu_kernels.ENV_REQUIRE, raising=False)
    with pytest.warns(RuntimeWarning, match='no C\\+\\+ compiler found'):
        with torch.no_grad():
            out = m(x, (16, 16))
    torch.testing.assert_close(out, ref)
    assert 'unavailable' in cpu_kernels.status()
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # warned once only
        with torch.no_grad():
            m(x, (16, 16))
    # where the kernel is required (CI), the failure is an error naming the reason
    monkeypatch.setenv(cpu_kernels.ENV_REQUIRE, '1')
    with pytest.raises(RuntimeError, match='no C\\+\\+ compiler found'):
        cpu_kernels.quadtree_level_kernel()


def test_kernel_is_not_loaded_on_a_cpu_without_its_instruction_sets(monkeypatch):
    """A build for AVX2 + FMA is refused before it is loaded on a CPU without them (its
    static initialisers would stop the process with SIGILL at load): the reason names what
    is missing and the way out; the PyTorch path stays."""
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpu_kernels, 'isa_flags', lambda: ['-mavx2', '-mfma'])
    monkeypatch.setattr(cpu_kernels, 'cpu_features', lambda: ['sse2', 'avx'])
    monkeypatch.setattr(cpp_extension, 'load', lambda **kw: pytest.fail('loaded anyway'))
    with pytest.raises(RuntimeError, match='this CPU lacks avx2, fma; set FLATTEN_MM_CPU_ISA='
                                           'generic'):
        cpu_kernels._build()
    assert cpu_kernels.missing_isa(['-O3', '-mavx2', '-mfma']) == ['avx2', 'fma']
    monkeypatch.setattr(cpu_kernels, 'cpu_features', lambda: ['avx2', 'fma', 'avx512_fp16'])
    assert cpu_kernels.missing_isa(['-mavx2', '-mfma', '-mavx512fp16']) == []


def test_bad_kernel_arguments_are_named():
    op = _kernel()
    q = torch.randn(1, 64, 8)
    idx = torch.zeros(1, 16, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match='float32'):
        op(q.double(), q.double(), q.double(), idx, None, q.double(), 8, 1.0, 0, False)
    with pytest.raises(RuntimeError, match='prev_idx must be'):
        op(q, q, q, idx[:, :8], None, q.clone(), 8, 1.0, 0, False)
    with pytest.raises(RuntimeError, match='variant A needs prev_score'):
        op(q, q, q, idx, None, q.clone(), 8, 1.0, 2, True)
    with pytest.raises(RuntimeError, match='topk'):
        op(q, q, q, idx, None, q.clone(), 8, 1.0, 9, False)
    with pytest.raises(RuntimeError, match='outside the parent grid'):
        op(q, q, q, idx + 16, None, q.clone(), 8, 1.0, 0, False)
    backward = torch.ops.flatten_mm.quadtree_level_backward
    none = torch.empty(1, 64, 0, dtype=torch.long)
    with pytest.raises(RuntimeError, match='float32'):
        backward(q.double(), q, q, q, idx, None, none, None, 8, 1.0, False)
    with pytest.raises(RuntimeError, match='prev_idx must be'):
        backward(q, q, q, q, idx[:, :8], None, none, None, 8, 1.0, False)
    with pytest.raises(RuntimeError, match='variant A needs prev_score'):
        backward(q, q, q, q, idx, None, none, None, 8, 1.0, True)
    with pytest.raises(RuntimeError, match='outside the parent grid'):
        backward(q, q, q, q, idx + 16, None, none, None, 8, 1.0, False)


_GENERIC_CHECK = '''
import torch
from flatten_mm.models.layers import QuadTreeAttention
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels
assert cpu_kernels.isa_flags() == []
assert cpu_kernels.quadtree_level_kernel() is not None, cpu_kernels.status()
worst = 0.0
for attn_type in ('A', 'B'):
    for dims, heads in ((64, 2), (64, 1), (66, 2)):  # d = 32 (AVX2 code elsewhere), 64, 33
        torch.manual_seed(0)
        m = QuadTreeAttention(dims, heads, attn_type=attn_type, num_levels=3, topk=6).eval()
        x = torch.randn(2, 24 * 20, dims)
        with torch.no_grad():
            out = m(x, (24, 20))
            with cpu_kernels.use_cpu_kernels(False):
                ref = m(x, (24, 20))
        worst = max(worst, float((out - ref).abs().max() / ref.abs().max()))
        grads = []
        for on in (True, False):  # a training step: the backward kernel's generic loops
            xi = x.clone().requires_grad_()
            with cpu_kernels.use_cpu_kernels(on):
                m.train()(xi, (24, 20)).square().sum().backward()
            grads.append(xi.grad)
        worst = max(worst, float((grads[0] - grads[1]).abs().max() / grads[1].abs().max()))
print('WORST', worst)
'''


def test_generic_build_without_isa_extensions(tmp_path):
    """The portable build (what a CPU without AVX2 / a non-x86 machine compiles: scalar
    exp and dot products) gives the PyTorch path's results and input gradients too. Own
    process and cache directory: a process holds one build of the ``flatten_mm`` op
    library."""
    import subprocess
    import sys
    _kernel()  # the compiler works here
    env = dict(os.environ, FLATTEN_MM_CPU_ISA='generic', FLATTEN_MM_EXT_DIR=str(tmp_path),
               FLATTEN_MM_REQUIRE_CPU_KERNELS='1')
    env.pop(cpu_kernels.ENV_SWITCH, None)
    res = subprocess.run([sys.executable, '-c', _GENERIC_CHECK], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    worst = float(res.stdout.split('WORST')[-1])
    assert worst < 1e-5
