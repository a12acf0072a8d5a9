"""Speed and memory benchmark of the attention operators and backbones.

Two suites, both measured the same way:

* **op level** -- each attention on given ``q, k, v`` (after the projections) over a range
  of token counts ``N = s x s`` and head dims: Focused Linear Attention (fused and
  unfused), a plain ReLU linear attention of the same shape (the yardstick of the FLA
  kernel), SimA in both matmul orders and its automatic choice, QuadTree A/B
  (pyramid + attention, no projections) and softmax attention through
  ``F.scaled_dot_product_attention``;
* **backbone level** -- each flatten_mm backbone against its softmax counterpart from
  timm and (if installed) mmdet, at several input resolutions, batch 1, inference.

Timing: every case of a group (all ops at one shape, or one backbone family with its
baselines at one resolution) runs in the same process, **alternating** round-robin after
warm-up, so slow drifts (other processes, allocator state, CPU frequency) hit all sides
alike. Reported are the median and the minimum of the per-call wall times (CUDA: CUDA
events), the median per-call process CPU time (CPU only; less sensitive to other
processes on a shared machine), images/s, and the peak memory of one call (CUDA: the
caching allocator's peak; CPU: the peak of the allocations recorded by the PyTorch
profiler). Ratios are given both as a ratio of medians and as the median of the
per-round ratios.

Everything is importable without mmdet; the backbones of this package need mmengine
(``flatten_mm.models``), the baselines timm (and optionally mmdet). Results are plain
dicts (one per measured case), written as a table, a CSV and a log-log PNG with the
fitted scaling exponent of every op (``latency ~ N^a``).
"""
import csv
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

#: ops of the op-level suite, in table order
OPS = ('fla', 'fla_unfused', 'relu_linear', 'sima', 'sima_qk_first', 'sima_kv_first',
       'quadtree_a', 'quadtree_b', 'softmax_sdpa')
#: ops whose cost is quadratic in the token count (skipped above ``max_quadratic_tokens``)
QUADRATIC_OPS = ('softmax_sdpa', 'sima_qk_first')

#: backbone families: ours -> softmax counterparts (timm / mmdet names below)
BACKBONE_PAIRS: Dict[str, Tuple[str, ...]] = {
    'flatten-pvt-v2-b0': ('pvt-v2-b0 (timm)', 'pvt-v2-b0 (mmdet)'),
    'quadtree-b-pvt-v2-b0': ('pvt-v2-b0 (timm)', 'pvt-v2-b0 (mmdet)'),
    'flatten-swin-t': ('swin-t (timm)', 'swin-t (mmdet)'),
    'sima-xcit-s12-p16': ('xcit-s12-p16 (timm)', ),
}
#: default input resolutions ``(H, W)`` of the backbone suite
RESOLUTIONS = ((224, 224), (512, 512), (1024, 1024), (800, 1280))


@dataclass
class Timing:
    """Per-call times of one case (seconds)."""

    wall: List[float] = field(default_factory=list)
    cpu: List[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def minimum(self) -> float:
        return min(self.wall)


# --------------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def measure_alternating(cases: Dict[str, Callable[[], Any]], device: torch.device,
                        warmup: int = 2, repeats: int = 10) -> Dict[str, Timing]:
    """Time callables round-robin: ``warmup`` untimed rounds, then ``repeats`` rounds
    in which every case runs once (in turn).

    The order of the cases rotates from round to round.

    Args:
        cases: name -> zero-argument callable (one forward).
        device: where the callables run (CUDA: timed with CUDA events).
        warmup: untimed rounds.
        repeats: timed rounds.

    Returns:
        name -> ``Timing`` with ``repeats`` entries.
    """
    device = torch.device(device)
    timings = {name: Timing() for name in cases}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in cases.values():
                fn()
        _sync(device)
        items = list(cases.items())
        for r in range(repeats):
            # rotate the order every round: no case always follows the same (cache-
            # trashing) neighbour
            k = r % max(1, len(items))
            for name, fn in items[k:] + items[:k]:
                if device.type == 'cuda':
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    timings[name].wall.append(start.elapsed_time(end) / 1e3)
                else:
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    t1, c1 = time.perf_counter(), time.process_time()
                    timings[name].wall.append(t1 - t0)
                    timings[name].cpu.append(c1 - c0)
    return timings


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> Optional[int]:
    """Peak memory allocated during one call of ``fn`` (inputs excluded, output included).

    CUDA: the caching allocator's peak above the memory allocated before the call.
    CPU: the running peak of the allocations and frees recorded by the PyTorch profiler
    (``profile_memory=True``). ``None`` if it cannot be measured.
    """
    device = torch.device(device)
    with torch.no_grad():
        if device.type == 'cuda':
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            out = fn()
            _sync(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            del out
            return int(peak)
        if device.type != 'cpu':
            return None
        try:
            from torch._C._profiler import _EventType
            from torch.profiler import ProfilerActivity, profile
        except ImportError:  # pragma: no cover - very old torch
            return None
        os.environ.setdefault('KINETO_LOG_LEVEL', '5')
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
            del out
        sizes: List[Tuple[int, int]] = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
            stack.extend(node.children)
        sizes.sort()
        current = peak = 0
        for _, size in sizes:
            current += size
            peak = max(peak, current)
        return int(peak)


def fit_exponent(tokens: Sequence[float], seconds: Sequence[float]) -> float:
    """Least-squares slope ``a`` of ``log(t) = a log(N) + b`` (``nan`` for < 2 points)."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(tokens, seconds) if n > 0 and t > 0]
    if len(pts) < 2:
        return float('nan')
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx)**2 for p in pts)
    if sxx == 0:
        return float('nan')
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def _row(suite: str, name: str, timing: Optional[Timing], device: torch.device,
         dtype: torch.dtype, batch: int, **extra) -> Dict[str, Any]:
    row: Dict[str, Any] = dict(suite=suite, name=name, device=str(device),
                               dtype=str(dtype).replace('torch.', ''),
                               threads=torch.get_num_threads(), batch=batch)
    row.update(extra)
    if timing is not None and timing.wall:
        row.update(median_ms=timing.median * 1e3, min_ms=timing.minimum * 1e3,
                   cpu_ms=statistics.median(timing.cpu) * 1e3 if timing.cpu else None,
                   images_per_s=batch / timing.median, repeats=len(timing.wall))
    return row


# --------------------------------------------------------------------------- ops
def relu_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          num_heads: int) -> torch.Tensor:
    """Plain ReLU linear attention ``phi(Q) (phi(K)^T V) / (phi(Q) . sum phi(K) + 1e-6)``,
    ``phi = ReLU``, on ``(B, N, C)`` tokens (the yardstick of the FLA kernel)."""
    B, N, C = q.shape
    d = C // num_heads
    q = F.relu(q).reshape(B, N, num_heads, d).transpose(1, 2)
    k = F.relu(k).reshape(B, -1, num_heads, d).transpose(1, 2)
    v = v.reshape(B, -1, num_heads, d).transpose(1, 2)
    kv = k.transpose(-2, -1) @ v
    z = 1.0 / (q @ k.sum(dim=-2, keepdim=True).transpose(-2, -1) + 1e-6)
    return ((q @ kv) * z).transpose(1, 2).reshape(B, N, C)


def quadtree_levels(side: int, topk: int, max_levels: int = 4) -> int:
    """Pyramid levels for a ``side x side`` map: the most (up to ``max_levels``) whose
    coarsest level is a whole grid of at least ``max(2 * topk, 64)`` tokens (1 if none)."""
    best = 1
    for levels in range(2, max_levels + 1):
        f = 2**(levels - 1)
        if side % f == 0 and (side // f)**2 >= max(2 * topk, 64):
            best = levels
    return best


def make_op(name: str, side: int, head_dims: int, num_heads: int = 1, batch: int = 1,
            device: torch.device = torch.device('cpu'), dtype: torch.dtype = torch.float32,
            quadtree_topk: int = 32, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running op ``name`` on random ``q, k, v`` of
    ``N = side**2`` tokens, ``num_heads`` heads of ``head_dims`` channels.

    FLA and ReLU-LA take ``(B, N, C)`` tokens, SimA and SDPA ``(B, h, N, d)`` views of
    them; QuadTree runs ``QuadTreeAttention.attend`` (pyramid + attention) on the
    ``side x side`` map with ``quadtree_levels(side, topk)`` levels.
    """
    from flatten_mm.models.layers.focused_linear_attention import (
        focused_linear_core, focused_linear_core_reference)
    from flatten_mm.models.layers.quadtree_attention import QuadTreeAttention
    from flatten_mm.models.layers.sima_attention import sima_core

    g = torch.Generator().manual_seed(seed)
    N, C, h, d = side * side, head_dims * num_heads, num_heads, head_dims
    q, k, v = (torch.randn(batch, N, C, generator=g).to(device, dtype) for _ in range(3))
    scale = (0.5 * torch.randn(1, 1, C, generator=g)).to(device, dtype)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, N, h, d).transpose(1, 2)

    if name == 'fla':
        return lambda: focused_linear_core(q, k, v, scale, h, 3)
    if name == 'fla_unfused':
        return lambda: focused_linear_core_reference(q, k, v, scale, h, 3)
    if name == 'relu_linear':
        return lambda: relu_linear_attention(q, k, v, h)
    if name == 'softmax_sdpa':
        qh, kh, vh = heads(q), heads(k), heads(v)
        return lambda: F.scaled_dot_product_attention(qh, kh, vh)
    if name in ('sima', 'sima_qk_first', 'sima_kv_first'):
        order = {'sima': 'auto', 'sima_qk_first': 'qk_first', 'sima_kv_first': 'kv_first'}[name]
        qh, kh, vh = heads(q), heads(k), heads(v)
        return lambda: sima_core(qh, kh, vh, order)
    if name in ('quadtree_a', 'quadtree_b'):
        levels = quadtree_levels(side, quadtree_topk)
        torch.manual_seed(seed)
        module = QuadTreeAttention(C, h, attn_type=name[-1].upper(), num_levels=levels,
                                   topk=quadtree_topk).to(device, dtype).eval()
        return lambda: module.attend(q, k, v, (side, side))
    raise KeyError(f'unknown op {name!r}; available: {OPS}')


def run_op_benchmark(ops: Sequence[str] = OPS,
                     sides: Sequence[int] = (32, 64, 128, 256),
                     head_dims: Sequence[int] = (32, 64),
                     num_heads: int = 1,
                     batch: int = 1,
                     device: str = 'cpu',
                     dtype: torch.dtype = torch.float32,
                     warmup: int = 2,
                     repeats: int = 10,
                     max_quadratic_tokens: int = 128 * 128,
                     memory: bool = True,
                     quadtree_topk: int = 32,
                     log: Optional[Callable[[str], None]] = None) -> List[Dict[str, Any]]:
    """Op-level suite: for every ``(side, head_dims)`` all ``ops`` alternate.

    Args:
        ops: op names (see ``OPS``).
        sides: map sides ``s`` (``N = s * s`` tokens).
        head_dims: head dims ``d``.
        num_heads: heads ``h`` (``C = h * d``).
        batch: batch size.
        device: ``'cpu'`` or ``'cuda'``.
        dtype: input dtype (FLA / SimA / QuadTree compute their kernels in float32).
        warmup: untimed rounds.
        repeats: timed rounds.
        max_quadratic_tokens: ops in ``QUADRATIC_OPS`` are skipped above this ``N``.
        memory: also measure the peak memory of one call.
        quadtree_topk: top-k of the QuadTree ops.
        log: optional progress callback.

    Returns:
        One dict per (op, side, head dim) with ``tokens``, ``head_dims``, ``median_ms``,
        ``min_ms``, ``cpu_ms``, ``peak_mem_mb`` and, for skipped cases, a ``note``.
    """
    device_ = torch.device(device)
    rows = []
    for d in head_dims:
        for s in sides:
            N = s * s
            cases, skipped = {}, {}
            for name in ops:
                if name in QUADRATIC_OPS and N > max_quadratic_tokens:
                    skipped[name] = f'skipped: N={N} > max_quadratic_tokens'
                    continue
                try:
                    cases[name] = make_op(name, s, d, num_heads, batch, device_, dtype,
                                          quadtree_topk)
                except (ValueError, RuntimeError) as err:
                    skipped[name] = f'error: {err}'
            if log is not None:
                log(f'ops  N={N:6d} ({s}x{s}) d={d}: {", ".join(cases)}')
            timings = measure_alternating(cases, device_, warmup, repeats)
            for name in ops:
                extra = dict(tokens=N, height=s, width=s, head_dims=d, heads=num_heads)
                if name in skipped:
                    rows.append(_row('op', name, None, device_, dtype, batch, note=skipped[name],
                                     **extra))
                    continue
                row = _row('op', name, timings[name], device_, dtype, batch, **extra)
                if memory:
                    peak = peak_memory_bytes(cases[name], device_)
                    row['peak_mem_mb'] = None if peak is None else peak / 2**20
                rows.append(row)
            del cases
    return rows


def run_sima_order_grid(tokens: Sequence[int] = (16, 32, 48, 64, 96, 128, 192, 256, 512, 1024),
                        head_dims: Sequence[int] = (32, 48, 64, 128),
                        num_heads: int = 4, batch: int = 1, device: str = 'cpu',
                        warmup: int = 3, repeats: int = 15,
                        log: Optional[Callable[[str], None]] = None) -> List[Dict[str, Any]]:
    """SimA ``order='auto'`` against both fixed orders on a grid of ``(N, d)`` covering
    both regimes (``N < d``: ``qk_first`` cheaper; ``N > d``: ``kv_first``).

    Returns one dict per ``(N, d)`` with the three medians/minima,
    ``auto_vs_best = min_ms(auto) / min(min_ms(qk_first), min_ms(kv_first))`` (and the
    same with medians), and ``chosen_vs_best``: the fixed order that ``auto`` picks
    against the faster one (the rule's quality without the noise of separate runs).
    """
    from flatten_mm.models.layers.sima_attention import sima_core, sima_order
    device_ = torch.device(device)
    rows = []
    g = torch.Generator().manual_seed(0)
    for d in head_dims:
        for N in tokens:
            q, k, v = (torch.randn(batch, num_heads, N, d, generator=g).to(device_)
                       for _ in range(3))
            cases = {order: (lambda o: lambda: sima_core(q, k, v, o))(order)
                     for order in ('auto', 'qk_first', 'kv_first')}
            t = measure_alternating(cases, device_, warmup, repeats)
            best = min(t['qk_first'].minimum, t['kv_first'].minimum)
            best_med = min(t['qk_first'].median, t['kv_first'].median)
            row = _row('sima_order', 'sima', None, device_, torch.float32, batch, tokens=N,
                       head_dims=d, heads=num_heads, chosen=sima_order(N, d))
            for order, tim in t.items():
                row[f'{order}_median_ms'] = tim.median * 1e3
                row[f'{order}_min_ms'] = tim.minimum * 1e3
            row['auto_vs_best'] = t['auto'].minimum / best
            row['auto_vs_best_median'] = t['auto'].median / best_med
            # quality of the rule alone (no timing noise of the extra 'auto' runs)
            row['chosen_vs_best'] = t[row['chosen']].minimum / best
            rows.append(row)
            if log is not None:
                log(f'sima N={N} d={d}: auto/best {row["auto_vs_best"]:.3f}')
    return rows


# --------------------------------------------------------------------------- backbones
@dataclass
class BackboneCase:
    """How to build and run one backbone at one resolution."""

    name: str
    build: Callable[[Tuple[int, int]], nn.Module]
    run: Callable[[nn.Module, torch.Tensor], Any]
    source: str = 'flatten_mm'


def _call(m: nn.Module, x: torch.Tensor):
    return m(x)


def _timm_intermediates(indices=None):
    def run(m: nn.Module, x: torch.Tensor):
        return m.forward_intermediates(x, indices=indices, intermediates_only=True)
    return run


def backbone_cases(quick: bool = False) -> Dict[str, BackboneCase]:
    """Every backbone of the suite (ours and the baselines available here).

    With ``quick``: tiny custom architectures of the same classes (CI smoke test).
    """
    import timm
    from flatten_mm.models.backbones import FLattenPVTv2, FLattenSwin, QuadTreePVTv2, SimAXCiT

    cases: Dict[str, BackboneCase] = {}
    if quick:
        tiny = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 2),
                    mlp_ratios=(2, 2, 2, 2))
        cases['flatten-pvt-v2-tiny'] = BackboneCase(
            'flatten-pvt-v2-tiny', lambda hw: FLattenPVTv2(arch=tiny, drop_path_rate=0.), _call)
        cases['quadtree-b-pvt-v2-tiny'] = BackboneCase(
            'quadtree-b-pvt-v2-tiny',
            lambda hw: QuadTreePVTv2(arch=tiny, attn_cfg=dict(topk=2), drop_path_rate=0.), _call)

        def timm_tiny(hw):
            from timm.models.pvt_v2 import PyramidVisionTransformerV2
            return PyramidVisionTransformerV2(depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32),
                                              num_heads=(1, 1, 1, 2), mlp_ratios=(2, 2, 2, 2))

        cases['pvt-v2-tiny (timm)'] = BackboneCase('pvt-v2-tiny (timm)', timm_tiny,
                                                   _timm_intermediates(), 'timm')
        return cases

    cases['flatten-pvt-v2-b0'] = BackboneCase(
        'flatten-pvt-v2-b0', lambda hw: FLattenPVTv2('b0', drop_path_rate=0.), _call)
    cases['quadtree-b-pvt-v2-b0'] = BackboneCase(
        'quadtree-b-pvt-v2-b0', lambda hw: QuadTreePVTv2('b0', drop_path_rate=0.), _call)
    cases['flatten-swin-t'] = BackboneCase(
        'flatten-swin-t', lambda hw: FLattenSwin('t', drop_path_rate=0.), _call)
    sima_idx = (3, 5, 7, 11)
    cases['sima-xcit-s12-p16'] = BackboneCase(
        'sima-xcit-s12-p16', lambda hw: SimAXCiT('s12', block_indices=sima_idx),
        lambda m, x: m.forward_blocks(x, m.block_indices))
    cases['pvt-v2-b0 (timm)'] = BackboneCase(
        'pvt-v2-b0 (timm)', lambda hw: timm.create_model('pvt_v2_b0', pretrained=False),
        _timm_intermediates(), 'timm')
    cases['swin-t (timm)'] = BackboneCase(
        'swin-t (timm)', lambda hw: timm.create_model(
            'swin_tiny_patch4_window7_224', pretrained=False, img_size=tuple(hw)),
        _timm_intermediates(), 'timm')
    cases['xcit-s12-p16 (timm)'] = BackboneCase(
        'xcit-s12-p16 (timm)', lambda hw: timm.create_model('xcit_small_12_p16_224',
                                                            pretrained=False),
        _timm_intermediates(list(sima_idx)), 'timm')
    try:
        from mmdet.models.backbones import PyramidVisionTransformerV2, SwinTransformer
    except Exception:  # noqa: BLE001 - mmdet (and its mmcv) are optional here
        return cases
    cases['pvt-v2-b0 (mmdet)'] = BackboneCase(
        'pvt-v2-b0 (mmdet)',
        lambda hw: PyramidVisionTransformerV2(embed_dims=32, num_layers=[2, 2, 2, 2]), _call,
        'mmdet')
    cases['swin-t (mmdet)'] = BackboneCase('swin-t (mmdet)', lambda hw: SwinTransformer(),
                                           _call, 'mmdet')
    return cases


def quick_pairs() -> Dict[str, Tuple[str, ...]]:
    """Backbone families of the ``quick`` suite."""
    return {'flatten-pvt-v2-tiny': ('pvt-v2-tiny (timm)', ),
            'quadtree-b-pvt-v2-tiny': ('pvt-v2-tiny (timm)', )}


def run_backbone_benchmark(pairs: Optional[Dict[str, Sequence[str]]] = None,
                           resolutions: Sequence[Tuple[int, int]] = RESOLUTIONS,
                           batch: int = 1,
                           device: str = 'cpu',
                           dtype: torch.dtype = torch.float32,
                           warmup: int = 1,
                           repeats: int = 5,
                           memory: bool = True,
                           quick: bool = False,
                           log: Optional[Callable[[str], None]] = None
                           ) -> List[Dict[str, Any]]:
    """Backbone suite: per family and resolution, ours and its baselines alternate.

    Args:
        pairs: ours -> baselines (default ``BACKBONE_PAIRS``; only available baselines
            run, e.g. no mmdet rows without mmdet).
        resolutions: input sizes ``(H, W)``.
        batch: images per forward.
        device: ``'cpu'`` or ``'cuda'``.
        dtype: ``torch.float32`` or a half type (run under autocast on CUDA, as in
            mixed-precision inference; weights stay float32).
        warmup: untimed rounds.
        repeats: timed rounds.
        memory: also measure the peak memory of one forward.
        quick: tiny architectures (see ``backbone_cases``).
        log: optional progress callback.

    Returns:
        One dict per (model, resolution) with ``median_ms``, ``min_ms``, ``cpu_ms``,
        ``images_per_s``, ``peak_mem_mb``, and ``baseline_of`` / ``ratio_*`` columns
        on the rows of our backbones (see ``ratio_rows``).
    """
    device_ = torch.device(device)
    available = backbone_cases(quick)
    if pairs is None:
        pairs = quick_pairs() if quick else BACKBONE_PAIRS
    rows = []
    for ours, baselines in pairs.items():
        names = [ours] + [b for b in baselines if b in available]
        for hw in resolutions:
            torch.manual_seed(0)
            x = torch.randn(batch, 3, *hw, device=device_)
            models, cases, errors = {}, {}, {}
            for name in names:
                try:
                    model = available[name].build(tuple(hw)).to(device_)
                    model.eval()  # (mmdet's Swin.train() does not return self)
                    models[name] = model
                except Exception as err:  # noqa: BLE001 - reported in the table
                    errors[name] = f'error: {type(err).__name__}: {err}'
                    continue
                cases[name] = _backbone_call(available[name], models[name], x, device_, dtype)
            # a failing forward is reported, not fatal
            for name in list(cases):
                try:
                    with torch.no_grad():
                        cases[name]()
                except Exception as err:  # noqa: BLE001
                    errors[name] = f'error: {type(err).__name__}: {str(err)[:120]}'
                    del cases[name]
            if log is not None:
                log(f'backbones {hw[0]}x{hw[1]}: {", ".join(cases)}')
            timings = measure_alternating(cases, device_, warmup, repeats)
            group = f'{ours}@{hw[0]}x{hw[1]}'
            for name in names:
                extra = dict(height=hw[0], width=hw[1], tokens=hw[0] * hw[1], group=group,
                             source=available[name].source if name in available else '')
                if name in errors or name not in cases:
                    rows.append(_row('backbone', name, None, device_, dtype, batch,
                                     note=errors.get(name, 'not run'), **extra))
                    continue
                row = _row('backbone', name, timings[name], device_, dtype, batch, **extra)
                if memory:
                    peak = peak_memory_bytes(cases[name], device_)
                    row['peak_mem_mb'] = None if peak is None else peak / 2**20
                row['_wall'] = list(timings[name].wall)
                rows.append(row)
            del models, cases
    return rows


def _backbone_call(case: BackboneCase, model: nn.Module, x: torch.Tensor,
                   device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    if dtype == torch.float32:
        return lambda: case.run(model, x)

    def run():
        with torch.autocast(device_type=device.type, dtype=dtype):
            return case.run(model, x)
    return run


def ratio_rows(rows: Sequence[Dict[str, Any]],
               pairs: Optional[Dict[str, Sequence[str]]] = None) -> List[Dict[str, Any]]:
    """Ours / baseline latency ratios of every family and resolution.

    ``ratio_median`` = median(ours) / median(baseline); ``ratio_min`` = min / min;
    ``ratio_rounds`` = median over the alternating rounds of the per-round ratio;
    ``ratio_cpu`` = ratio of the median process CPU times (CPU only; with one thread the
    measure least disturbed by other processes on a shared machine).
    """
    by_group: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        if r.get('suite') == 'backbone' and r.get('median_ms') is not None:
            by_group.setdefault(r['group'], {})[r['name']] = r
    out = []
    for group, members in by_group.items():
        ours = group.split('@')[0]
        if ours not in members:
            continue
        o = members[ours]
        baselines = pairs[ours] if pairs and ours in pairs else [m for m in members if m != ours]
        for b in baselines:
            if b not in members:
                continue
            base = members[b]
            rounds = [a / c for a, c in zip(o.get('_wall', []), base.get('_wall', [])) if c > 0]
            out.append(dict(ours=ours, baseline=b, height=o['height'], width=o['width'],
                            device=o['device'], dtype=o['dtype'],
                            ours_ms=o['median_ms'], baseline_ms=base['median_ms'],
                            ratio_median=o['median_ms'] / base['median_ms'],
                            ratio_min=o['min_ms'] / base['min_ms'],
                            ratio_rounds=statistics.median(rounds) if rounds else None,
                            ratio_cpu=(o['cpu_ms'] / base['cpu_ms']
                                       if o.get('cpu_ms') and base.get('cpu_ms') else None),
                            mem_ratio=(o['peak_mem_mb'] / base['peak_mem_mb']
                                       if o.get('peak_mem_mb') and base.get('peak_mem_mb')
                                       else None)))
    return out


def op_exponents(rows: Sequence[Dict[str, Any]], min_tokens: int = 0,
                 max_tokens: Optional[int] = None) -> Dict[Tuple[str, int], float]:
    """Fitted time exponent ``a`` (``median ~ N^a``) per ``(op, head_dims)``."""
    series: Dict[Tuple[str, int], List[Tuple[int, float]]] = {}
    for r in rows:
        if r.get('suite') != 'op' or r.get('median_ms') is None:
            continue
        if r['tokens'] < min_tokens or (max_tokens is not None and r['tokens'] > max_tokens):
            continue
        series.setdefault((r['name'], r['head_dims']), []).append((r['tokens'], r['median_ms']))
    return {key: fit_exponent([p[0] for p in pts], [p[1] for p in pts])
            for key, pts in series.items()}


# --------------------------------------------------------------------------- compile
def compile_report(model: nn.Module, x: torch.Tensor, backend: Optional[str] = None
                   ) -> Dict[str, Any]:
    """``torch.compile`` compatibility of ``model`` on input ``x``.

    Always counts graphs and graph breaks with ``torch._dynamo.explain`` (tracing only).
    With ``backend`` (e.g. ``'inductor'``, ``'aot_eager'``) the model is also compiled
    and run, and the largest absolute difference to eager mode is reported.

    Returns:
        ``dict(graphs, graph_breaks, break_reasons, max_abs_diff, error)``.
    """
    report: Dict[str, Any] = dict(graphs=None, graph_breaks=None, break_reasons=[],
                                  max_abs_diff=None, error=None)
    try:
        import torch._dynamo as dynamo
    except ImportError as err:  # pragma: no cover
        report['error'] = f'no torch._dynamo: {err}'
        return report
    model = model.eval()
    try:
        with torch.no_grad():
            dynamo.reset()
            explanation = dynamo.explain(model)(x)
        report['graphs'] = explanation.graph_count
        report['graph_breaks'] = explanation.graph_break_count
        report['break_reasons'] = [str(getattr(b, 'reason', b))[:200]
                                   for b in explanation.break_reasons][:5]
        if backend is not None:
            dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            with torch.no_grad():
                ref = model(x)
                out = compiled(x)
            ref = ref if isinstance(ref, (tuple, list)) else (ref, )
            out = out if isinstance(out, (tuple, list)) else (out, )
            report['max_abs_diff'] = max(float((a - b).abs().max()) for a, b in zip(ref, out))
    except Exception as err:  # noqa: BLE001 - reported, the benchmark goes on
        report['error'] = f'{type(err).__name__}: {str(err)[:300]}'
    finally:
        dynamo.reset()
    return report


def tiny_backbones() -> Dict[str, Tuple[nn.Module, Tuple[int, int]]]:
    """One small model of every backbone family and an input size exercising its
    special paths (shifted windows with a mask, QuadTree top-k, padding), for
    ``torch.compile`` checks."""
    from flatten_mm.models.backbones import (FLattenCSWin, FLattenPVTv2, FLattenSwin,
                                             QuadTreePVTv2, SimAXCiT)
    tiny_pvt = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 2),
                    mlp_ratios=(2, 2, 2, 2))
    torch.manual_seed(0)
    return {
        'flatten-pvt-v2': (FLattenPVTv2(arch=tiny_pvt), (64, 80)),
        'quadtree-b-pvt-v2': (QuadTreePVTv2(arch=tiny_pvt, attn_cfg=dict(topk=2)), (64, 80)),
        'quadtree-a-pvt-v2': (QuadTreePVTv2(arch=tiny_pvt, attn_cfg=dict(topk=2, attn_type='A')),
                              (64, 64)),
        'flatten-swin': (FLattenSwin(arch=dict(embed_dims=8, depths=(1, 1, 2, 2),
                                               num_heads=(1, 1, 2, 2))), (128, 112)),
        'flatten-cswin': (FLattenCSWin(arch=dict(embed_dims=8, depths=(1, 1, 1, 1),
                                                 num_heads=(2, 2, 2, 2))), (64, 64)),
        'sima-xcit': (SimAXCiT(arch=dict(embed_dims=32, depth=2, num_heads=2)), (64, 48)),
    }


# --------------------------------------------------------------------------- consistency
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_fast_paths(device: str = 'cpu') -> Dict[str, Any]:
    """Relative max differences between every fast path and its reference path on
    ``device`` (the checks of ``tests/test_layers/test_fast_paths.py`` at realistic
    sizes; run this on a GPU, where CI never runs). TF32 is disabled during the checks.

    Returns:
        check name -> dict of relative differences (``|a - b|_max / |b|_max``) or an
        ``'ERROR ...'`` string.
    """
    from flatten_mm.models.layers import (FocusedLinearAttention, QuadTreeAttention,
                                          ShiftedWindowAttention, cpu_kernels, nchw_to_nlc,
                                          nlc_to_nchw)
    from flatten_mm.models.layers.conv import token_conv
    from flatten_mm.models.layers.focused_linear_attention import (
        depthwise_conv_heads, focused_linear_core, focused_linear_core_reference)
    from flatten_mm.models.layers.sima_attention import sima_core, sima_core_reference

    dev = torch.device(device)
    cuda = dev.type == 'cuda'
    if cuda:
        tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def fla_core():
        out = {}
        for B, N, C, h in [(2, 4096, 64, 1), (1, 3136, 96, 3), (2, 784, 160, 5)]:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, N, C, generator=g).to(dev) for _ in range(3))
            pos = torch.randn(1, N, C, generator=g).to(dev)
            scale = (0.5 * torch.randn(1, 1, C, generator=g)).to(dev)
            ref = focused_linear_core_reference(q, k + pos, v, scale, h, 3)
            with torch.no_grad():
                fast = focused_linear_core(q, k, v, scale, h, 3, k_pos=pos)
                half = focused_linear_core(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale, h,
                                           3, k_pos=pos)
            grad = focused_linear_core(q.clone().requires_grad_(True), k, v, scale, h, 3,
                                       k_pos=pos).detach()
            out[f'N{N}_C{C}_h{h}'] = dict(no_grad=_rel(fast, ref), grad=_rel(grad, ref),
                                          bf16_inputs=_rel(half, ref))
        return out

    def token_convs():
        torch.manual_seed(0)
        conv = nn.Conv2d(32, 32, 5, padding=2, groups=32).to(dev)
        conv3 = nn.Conv2d(96, 96, 3, padding=1, groups=96).to(dev)
        x = torch.randn(2, 64 * 48, 96, device=dev)
        with torch.no_grad():
            return dict(
                dwc_heads=_rel(token_conv(conv, x, (64, 48), repeat=3),
                               depthwise_conv_heads(conv, x, (64, 48), 3)),
                dw3x3=_rel(token_conv(conv3, x, (64, 48)),
                           nchw_to_nlc(conv3(nlc_to_nchw(x, (64, 48))))))

    def sima():
        out = {}
        for N, d in [(4096, 48), (32, 64)]:
            qkv = torch.randn(2, N, 3 * 8 * d, device=dev)
            q, k, v = qkv.reshape(2, N, 3, 8, d).permute(2, 0, 3, 1, 4).unbind(0)
            for order in ('qk_first', 'kv_first'):
                out[f'N{N}_d{d}_{order}'] = _rel(sima_core(q, k, v, order),
                                                 sima_core_reference(q, k, v, order))
        return out

    def quadtree():
        out = {}
        for attn_type in ('A', 'B'):
            torch.manual_seed(0)
            m = QuadTreeAttention(64, 2, attn_type=attn_type, num_levels=4, topk=32)
            m = m.to(dev).eval()
            x = torch.randn(2, 120 * 100, 64, device=dev)
            with torch.no_grad():
                fast = m(x, (120, 100))
            out[attn_type] = dict(no_grad_vs_grad=_rel(fast, m(x, (120, 100)).detach()))
            if not cuda and cpu_kernels.quadtree_level_kernel() is not None:
                with torch.no_grad(), cpu_kernels.use_cpu_kernels(False):
                    out[attn_type]['cpu_kernel_vs_pytorch'] = _rel(fast, m(x, (120, 100)))
            if cuda:
                with torch.no_grad():
                    out[attn_type]['device_vs_cpu'] = _rel(fast.cpu(), m.cpu()(x.cpu(),
                                                                                 (120, 100)))
        return out

    def caches():
        torch.manual_seed(0)
        w = ShiftedWindowAttention(96, 3, window_size=7, shift=True).to(dev).eval()
        f = FocusedLinearAttention(32, 1, pretrain_hw_shape=(56, 56)).to(dev).eval()
        nn.init.normal_(f.positional_encoding)
        x, y = torch.randn(2, 60 * 45, 96, device=dev), torch.randn(1, 100 * 80, 32, device=dev)
        with torch.no_grad():
            w(x, (60, 45))
            f(y, (100, 80))
            cached_w, cached_f = w(x, (60, 45)), f(y, (100, 80))
        return dict(window_bias=_rel(cached_w, w(x, (60, 45)).detach()),
                    fla_pos_table=_rel(cached_f, f(y, (100, 80)).detach()))

    def backbones():
        out = {}
        for name, (model, hw) in tiny_backbones().items():
            x = torch.randn(2, 3, *hw)
            model.eval()
            with torch.no_grad():
                ref = model(x)
                model.to(dev)
                got = model(x.to(dev))
            out[name] = dict(device_vs_cpu=max(_rel(a.cpu(), b) for a, b in zip(got, ref)))
        return out

    results: Dict[str, Any] = {}
    try:
        for name, fn in [('fla_core', fla_core), ('token_conv', token_convs), ('sima', sima),
                         ('quadtree', quadtree), ('caches', caches),
                         ('backbones_device_vs_cpu', backbones)]:
            if name == 'backbones_device_vs_cpu' and not cuda:
                continue
            try:
                results[name] = fn()
            except Exception as err:  # noqa: BLE001 - reported
                results[name] = f'ERROR {type(err).__name__}: {err}'
    finally:
        if cuda:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    return results


# --------------------------------------------------------------------------- output
CSV_COLUMNS = ('suite', 'name', 'group', 'source', 'device', 'dtype', 'threads', 'batch',
               'tokens', 'height', 'width', 'heads', 'head_dims', 'median_ms', 'min_ms',
               'cpu_ms', 'images_per_s', 'peak_mem_mb', 'repeats', 'note')


def write_csv(rows: Iterable[Dict[str, Any]], path: str,
              columns: Optional[Sequence[str]] = None) -> None:
    """Write result dicts as CSV (``columns`` default: ``CSV_COLUMNS`` plus any other
    public keys found in the rows)."""
    rows = list(rows)
    if columns is None:
        columns = list(CSV_COLUMNS)
        for r in rows:
            for key in r:
                if key not in columns and not key.startswith('_'):
                    columns.append(key)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction='ignore')
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _fmt_csv(r.get(k)) for k in columns})


def read_csv(path: str) -> List[Dict[str, Any]]:
    """Rows written by ``write_csv``, numbers parsed (e.g. to re-plot a stored run)."""
    def parse(v: str):
        if v == '':
            return None
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v

    with open(path, newline='') as f:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _fmt_csv(v):
    if isinstance(v, float):
        return f'{v:.6g}'
    return '' if v is None else v


def _fmt(v, spec: str = '.3g') -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return '-'
    if isinstance(v, str):
        return ' '.join(v.split()).replace('|', '/')[:160]
    if isinstance(v, float):
        return f'{v:.0f}' if abs(v) >= 1000 else format(v, spec)
    return str(v)


def format_table(rows: Sequence[Dict[str, Any]], columns: Sequence[Tuple[str, str]]) -> str:
    """Markdown table of ``rows`` with ``columns = [(key, header), ...]``."""
    lines = ['| ' + ' | '.join(h for _, h in columns) + ' |',
             '|' + '|'.join('---' for _ in columns) + '|']
    for r in rows:
        lines.append('| ' + ' | '.join(_fmt(r.get(k)) for k, _ in columns) + ' |')
    return '\n'.join(lines)


OP_COLUMNS = (('name', 'op'), ('tokens', 'N'), ('head_dims', 'd'), ('median_ms', 'median ms'),
              ('min_ms', 'min ms'), ('cpu_ms', 'CPU ms'), ('peak_mem_mb', 'peak MiB'),
              ('note', 'note'))
BACKBONE_COLUMNS = (('name', 'backbone'), ('height', 'H'), ('width', 'W'),
                    ('median_ms', 'median ms'), ('min_ms', 'min ms'), ('cpu_ms', 'CPU ms'),
                    ('images_per_s', 'img/s'), ('peak_mem_mb', 'peak MiB'), ('note', 'note'))
RATIO_COLUMNS = (('ours', 'ours'), ('baseline', 'softmax counterpart'), ('height', 'H'),
                 ('width', 'W'), ('ours_ms', 'ours ms'), ('baseline_ms', 'baseline ms'),
                 ('ratio_median', 'ratio (medians)'), ('ratio_rounds', 'ratio (per round)'),
                 ('ratio_min', 'ratio (min)'), ('ratio_cpu', 'ratio (CPU time)'),
                 ('mem_ratio', 'memory ratio'))
SIMA_COLUMNS = (('tokens', 'N'), ('head_dims', 'd'), ('chosen', 'auto picks'),
                ('qk_first_min_ms', 'qk_first ms'), ('kv_first_min_ms', 'kv_first ms'),
                ('auto_min_ms', 'auto ms'), ('auto_vs_best', 'auto / best (min)'),
                ('auto_vs_best_median', 'auto / best (median)'),
                ('chosen_vs_best', 'picked order / best'))


def plot_scaling(rows: Sequence[Dict[str, Any]], path: str, title: str = '') -> bool:
    """Log-log PNG: op latency and peak memory against the token count, with the fitted
    time exponent of every op in the legend. Returns ``False`` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    op_rows = [r for r in rows if r.get('suite') == 'op' and r.get('median_ms') is not None]
    if not op_rows:
        return False
    exps = op_exponents(op_rows)
    dims = sorted({r['head_dims'] for r in op_rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    styles = ['-', '--', ':', '-.']
    colors = plt.get_cmap('tab10').colors
    for j, d in enumerate(dims):
        for c, name in enumerate(OPS):  # one colour per op, one line style per head dim
            pts = sorted((r['tokens'], r['median_ms'], r.get('peak_mem_mb'))
                         for r in op_rows if r['name'] == name and r['head_dims'] == d)
            if not pts:
                continue
            label = f'{name} d={d} (N^{exps.get((name, d), float("nan")):.2f})'
            style = dict(linestyle=styles[j % 4], marker='o', ms=3, color=colors[c % 10])
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
            mem = [(p[0], p[2]) for p in pts if p[2]]
            if mem:
                axes[1].plot([m[0] for m in mem], [m[1] for m in mem], label=f'{name} d={d}',
                             **style)
    for ax, ylabel in zip(axes, ('median latency (ms)', 'peak memory of one call (MiB)')):
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('tokens N')
        ax.set_ylabel(ylabel)
        ax.grid(True, which='both', alpha=0.3)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5, ncol=1)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def environment() -> Dict[str, Any]:
    """Machine / library description for the report header."""
    import platform
    info = dict(torch=torch.__version__, threads=torch.get_num_threads(),
                python=platform.python_version(), machine=platform.machine(),
                cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    info['cpu'] = line.split(':', 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info['gpu'] = torch.cuda.get_device_name(0)
    from flatten_mm.models.layers import cpu_kernels
    cpu_kernels.quadtree_level_kernel()  # built here, not inside a timed call
    info['cpu_kernels'] = cpu_kernels.status()
    return info


__all__ = [
    'BACKBONE_PAIRS', 'OPS', 'RESOLUTIONS', 'BackboneCase', 'Timing', 'backbone_cases',
    'check_fast_paths', 'compile_report', 'tiny_backbones', 'environment', 'fit_exponent', 'format_table', 'make_op',
    'measure_alternating', 'op_exponents', 'peak_memory_bytes', 'plot_scaling',
    'quadtree_levels', 'ratio_rows', 'read_csv', 'relu_linear_attention',
    'run_backbone_benchmark',
    'run_op_benchmark', 'run_sima_order_grid', 'write_csv'
]
