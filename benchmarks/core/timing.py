"""Timing protocol of the benchmark: alternating rounds, peak memory, result rows.

Every case of a group runs in the same process, **alternating** round-robin after
warm-up, so slow drifts (other processes, allocator state, CPU frequency) hit all sides
alike. Per call: the wall time (CUDA: CUDA events) and, on CPU, the process CPU time.
"""
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


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


def _grad_mode(grad: bool):
    return torch.enable_grad() if grad else torch.no_grad()


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def measure_alternating(cases: Dict[str, Callable[[], Any]], device: torch.device,
                        warmup: int = 2, repeats: int = 10,
                        grad: bool = False, lead_in: int = 0) -> Dict[str, Timing]:
    """Time callables round-robin: ``warmup`` untimed rounds, then ``repeats`` rounds
    in which every case runs once (in turn).

    The order of the cases rotates from round to round. ``lead_in`` untimed calls of the
    same case precede each timed call: a runtime whose worker threads spin-wait after a
    call (ONNX Runtime, OpenMP) slows whatever runs next in the process, so without them
    each case would be timed in the wake of the previous, different one.

    Args:
        cases: name -> zero-argument callable (one forward).
        device: where the callables run (CUDA: timed with CUDA events).
        warmup: untimed rounds.
        repeats: timed rounds.
        grad: run with autograd enabled (training steps); default ``torch.no_grad()``.
        lead_in: untimed calls of a case right before each of its timed calls.

    Returns:
        name -> ``Timing`` with ``repeats`` entries.
    """
    device = torch.device(device)
    timings = {name: Timing() for name in cases}
    with _grad_mode(grad):
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
                for _ in range(lead_in):
                    fn()
                _sync(device)
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


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device,
                      grad: bool = False) -> Optional[int]:
    """Peak memory allocated during one call of ``fn`` (inputs excluded, output included).

    CUDA: the caching allocator's peak above the memory allocated before the call.
    CPU: the running peak of the allocations and frees recorded by the PyTorch profiler
    (``profile_memory=True``). ``None`` if it cannot be measured. ``grad``: call with
    autograd enabled (a training step) instead of under ``torch.no_grad()``.
    """
    device = torch.device(device)
    with _grad_mode(grad):
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
