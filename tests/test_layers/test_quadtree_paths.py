"""The QuadTree path table (``ops.quadtree_paths``): which path a finer level takes for
given facts, that the facts come from the switches, and that the hook reports the path
that actually ran."""
import logging

import pytest
import torch

from flatten_mm.models.layers import QuadTreeAttention
from flatten_mm.models.layers import quadtree_attention as qa
from flatten_mm.models.ops import quadtree_batched, quadtree_cpu as cpu_kernels
from flatten_mm.models.ops import quadtree_fused, quadtree_paths, quadtree_rows
from flatten_mm.models.ops.quadtree_layout import to_heads
from flatten_mm.models.ops.quadtree_paths import LevelFacts, choose_level_path, record_paths


def facts(**kw) -> LevelFacts:
    """CPU inference of a non-final B level with nothing available, changed by ``kw``."""
    base = dict(device='cpu', inference=True, capture=False, custom_ops=False, margins=False,
                triton=False, cpu_kernel=False, final=False, attn_type='B')
    base.update(kw)
    return LevelFacts(**base)


@pytest.mark.parametrize('case,kw,path', [
    ('cpu inference, kernel built', dict(cpu_kernel=True), 'cpu_kernel'),
    ('cpu inference, no kernel', dict(), 'rows'),
    ('cpu training, kernel built', dict(inference=False, cpu_kernel=True), 'cpu_train'),
    ('cpu training, no kernel', dict(inference=False), 'gathers'),
    ('export', dict(capture=True), 'tiles'),
    ('export, runtime custom ops', dict(capture=True, custom_ops=True), 'graph_op'),
    ('export with a margin recorder', dict(capture=True, margins=True), 'rows'),
    ('use_triton=False on cuda, inference', dict(device='cuda'), 'rows'),
    ('use_triton=False on cuda, training', dict(device='cuda', inference=False), 'gathers'),
    ('cuda final level', dict(device='cuda', triton=True, final=True), 'triton_fused'),
    ('cuda A final level, training',
     dict(device='cuda', triton=True, final=True, attn_type='A', inference=False),
     'triton_fused'),
    ('cuda B inner level, training', dict(device='cuda', triton=True, inference=False),
     'triton_fused'),
    ('cuda B inner level, inference', dict(device='cuda', triton=True), 'triton_gathers'),
    ('cuda A inner level, training',
     dict(device='cuda', triton=True, attn_type='A', inference=False), 'triton_gathers'),
])
def test_table_picks_the_path(case, kw, path):
    got, reason = choose_level_path(facts(**kw))
    assert got == path, case
    assert reason == dict((p, r) for p, _, r in quadtree_paths.LEVEL_PATHS)[path]


def test_every_path_has_a_module_and_is_reachable():
    names = [p for p, _, _ in quadtree_paths.LEVEL_PATHS]
    assert set(names) == set(qa.LEVEL_PATH_MODULES)
    assert all(callable(getattr(mod, 'finer_level')) for mod in qa.LEVEL_PATH_MODULES.values())
    reached = set()
    for inference in (True, False):
        for capture in (True, False):
            for custom in (True, False):
                for triton in (True, False):
                    for cpu in (True, False):
                        for final in (True, False):
                            reached.add(choose_level_path(facts(
                                inference=inference, capture=capture, custom_ops=custom,
                                triton=triton, cpu_kernel=cpu, final=final))[0])
    assert reached == set(names)


def _level(use_triton=None, inference=True, margins=False) -> qa.Level:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 8, 8, generator=g)
    k, v = (to_heads(torch.randn(1, 8, 8, 8, generator=g), 2) for _ in range(2))
    prev_idx = torch.randint(0, 16, (1, 2, 16, 2), generator=g)
    return qa.Level(1, q, k, v, prev_idx, None, 2, 0.5, 'B', 2, use_triton=use_triton,
                    inference=inference,
                    record_margin=(lambda p, n: None) if margins else None)


def test_facts_read_the_switches(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH, raising=False)
    built = cpu_kernels.quadtree_level_kernel() is not None
    got, _ = quadtree_paths.level_facts(_level())
    assert (got.device, got.inference, got.triton, got.cpu_kernel) == ('cpu', True, False, built)
    assert not quadtree_paths.level_facts(_level(margins=True))[0].cpu_kernel
    assert not quadtree_paths.level_facts(_level(use_triton=False))[0].triton
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, '0')
    assert not quadtree_paths.level_facts(_level())[0].cpu_kernel
    with cpu_kernels.use_cpu_kernels(False):
        assert choose_level_path(quadtree_paths.level_facts(_level())[0])[0] == 'rows'


@pytest.mark.parametrize('attn_type', ['A', 'B'])
def test_hook_reports_the_path_that_ran(attn_type, monkeypatch, caplog):
    """``record_paths`` and the debug log name the path of each level; a spy on each path
    module sees the same calls, and the output is the reference path's."""
    ran = []
    for name in ('rows', 'cpu_kernel', 'cpu_train', 'gathers'):
        mod = qa.LEVEL_PATH_MODULES[name]
        real = mod.finer_level
        monkeypatch.setattr(mod, 'finer_level', lambda lv, _r=real, _n=name: ran.append(
            _n if _n != 'gathers' or lv.use_triton is False else 'triton_gathers') or _r(lv))
    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, attn_type=attn_type, num_levels=3, topk=4)
    x = torch.randn(1, 16 * 16, 16)
    built = cpu_kernels.quadtree_level_kernel() is not None
    cases = [(True, True, 'cpu_kernel' if built else 'rows'),
             (True, False, 'rows'),
             (False, True, 'cpu_train' if built else 'gathers'),
             (False, False, 'gathers')]
    outputs = {}
    for inference, kernels, path in cases:
        ran.clear()
        with torch.set_grad_enabled(not inference), cpu_kernels.use_cpu_kernels(kernels), \
                record_paths() as taken, caplog.at_level(logging.DEBUG, 'flatten_mm.quadtree'):
            caplog.clear()
            outputs[inference, kernels] = m(x, (16, 16)).detach()
        assert [(t.level, t.path) for t in taken] == [(1, path), (2, path)]
        assert ran == [path, path]
        assert [r.getMessage().split(' (')[0] for r in caplog.records] == [
            f'level 1: {path}', f'level 2: {path}']
    for key, out in outputs.items():
        torch.testing.assert_close(out, outputs[True, False], rtol=1e-5, atol=1e-6)


def test_a_declined_fused_kernel_is_reported_as_the_gathers(monkeypatch):
    """When the fused kernel declines a level at run time, the level runs the gathered
    kernels' path and the hook says so (here the Triton gates are faked open on CPU, so the
    gathers themselves fall back to PyTorch: the ``gathers`` result)."""
    monkeypatch.setattr(quadtree_paths, 'level_uses_triton', lambda *a: True)
    monkeypatch.setattr(quadtree_fused, 'finer_level', lambda lv: None)
    calls = []
    real = quadtree_batched.finer_level
    monkeypatch.setattr(quadtree_batched, 'finer_level',
                        lambda lv: calls.append(lv.use_triton) or real(lv))
    torch.manual_seed(0)
    m = QuadTreeAttention(16, 2, num_levels=3, topk=4)
    x = torch.randn(1, 16 * 16, 16)
    with record_paths() as taken:
        got = m(x, (16, 16))
    assert [(t.path, t.reason) for t in taken] == [quadtree_paths.FUSED_DECLINED] * 2
    assert calls == [None, None]  # (auto mode: the gathered kernels may still run)
    with cpu_kernels.use_cpu_kernels(False):
        monkeypatch.undo()
        ref = m(x, (16, 16))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize('attn_type', ['A', 'B'])
@pytest.mark.parametrize('topk', [3, None])
def test_reference_equals_the_rows_path(attn_type, topk):
    """The layer's ``finer_level_reference`` (the paper's steps) against the ``rows`` path,
    float64: messages, the selected keys (as sets) and A's scores of them."""
    g = torch.Generator().manual_seed(0)
    B, h, d, hi, wi, Kp = 2, 2, 4, 8, 12, 4
    q = torch.randn(B, h * d, hi, wi, dtype=torch.float64, generator=g)
    k, v = (to_heads(torch.randn(B, h * d, hi, wi, dtype=torch.float64, generator=g), h)
            for _ in range(2))
    P = hi * wi // 4
    prev_idx = torch.stack([torch.randperm(P, generator=g)[:Kp]
                            for _ in range(B * h * P)]).view(B, h, P, Kp)
    prev_score = (torch.rand(B, h, P, Kp, dtype=torch.float64, generator=g)
                  if attn_type == 'A' else None)
    ref = quadtree_rows.finer_level_rows(q, k, v, prev_idx, prev_score, h, 0.3, attn_type, topk)
    BH, M = B * h, hi * wi
    msg, idx, score = qa.finer_level_reference(
        to_heads(q, h).reshape(BH, M, d), k.reshape(BH, M, d), v.reshape(BH, M, d),
        prev_idx.reshape(BH, P, Kp), None if prev_score is None else prev_score.reshape(BH, P, Kp),
        wi, 0.3, topk or 0)
    torch.testing.assert_close(msg.view(B, h, M, d), ref[0], rtol=1e-12, atol=1e-12)
    if topk is None:
        assert idx is None and ref[1] is None
        return
    order, order_ref = idx.argsort(-1), ref[1].reshape(BH, M, topk).argsort(-1)
    assert torch.equal(idx.gather(-1, order), ref[1].reshape(BH, M, topk).gather(-1, order_ref))
    if attn_type == 'A':
        torch.testing.assert_close(score.gather(-1, order),
                                   ref[2].reshape(BH, M, topk).gather(-1, order_ref))
