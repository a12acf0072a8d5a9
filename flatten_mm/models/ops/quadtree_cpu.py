"""Optional fused CPU kernels, compiled on first use (``torch.utils.cpp_extension``).

Stock PyTorch has no fast CPU form of QuadTree's per-parent "gather the candidate keys,
score, soft-max, top-k, aggregate" step: it becomes a dozen small operators per level
whose gathered ``(N, 4K, d)`` rows do not fit in cache (docs/benchmarks). The kernels in
``csrc/quadtree_cpu.cpp`` do the step for one parent at a time in cache, and its backward
from the level's inputs alone (``level``: an autograd function that keeps ``q``, ``k``,
``v`` and the selected cells, not the ``(N, 4K)`` weights and gathered rows the PyTorch
path saves). They are built once per machine and torch version with the system C++
compiler (a few tens of seconds; cached under ``$FLATTEN_MM_EXT_DIR``, default
``~/.cache/flatten_mm/ext``) and used on CPU, for inference and training. The
pure-PyTorch paths of ``layers.quadtree_attention`` stay the reference and the fallback:
they are used on other devices, under ``torch.compile``, when margins are recorded, when
``FLATTEN_MM_CPU_KERNELS=0``, and when the build fails (one warning with the compiler's
message; results are the same either way, up to float rounding).
"""
import contextlib
import hashlib
import os
import os.path as osp
import platform
import re
import threading
import warnings
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from .autograd_paths import differentiate_reference, records_backward_graph

#: environment switch: ``0`` disables the compiled kernels (pure-PyTorch paths only)
ENV_SWITCH = 'FLATTEN_MM_CPU_KERNELS'
#: set ``FLATTEN_MM_REQUIRE_CPU_KERNELS=1`` (CI does) to make a failed build an error
ENV_REQUIRE = 'FLATTEN_MM_REQUIRE_CPU_KERNELS'
#: ``generic`` builds without ISA extensions (the code paths of non-AVX2 machines)
ENV_ISA = 'FLATTEN_MM_CPU_ISA'
_OPS = ('quadtree_level', 'quadtree_level_backward')
_SOURCE = osp.join(osp.dirname(osp.abspath(__file__)), 'csrc', 'quadtree_cpu.cpp')
#: what the build depends on besides the source (its digest names the cached build)
_HEADERS = (osp.join(osp.dirname(_SOURCE), 'quadtree_level.h'), )

_lock = threading.Lock()
_loaded: Optional[bool] = None  # None: not tried yet
_error: Optional[str] = None
_override: Optional[bool] = None  # set by ``use_cpu_kernels``


def cpu_features() -> List[str]:
    """This CPU's instruction-set flags (``/proc/cpuinfo``; empty where unknown)."""
    try:
        with open('/proc/cpuinfo') as f:
            return next((line.split(':', 1)[1].split() for line in f
                         if line.startswith('flags')), [])
    except OSError:
        return []


def isa_flags() -> list:
    """``-mavx2 -mfma`` where the CPU has them (x86-64), else the compiler's baseline
    (also with ``FLATTEN_MM_CPU_ISA=generic``: the portable loops, e.g. to test them)."""
    if os.environ.get(ENV_ISA, '').strip().lower() == 'generic':
        return []
    if platform.machine() in ('x86_64', 'AMD64'):
        flags = cpu_features()
        if 'avx2' in flags and 'fma' in flags:
            return ['-mavx2', '-mfma']
    return []


def missing_isa(flags: List[str]) -> List[str]:
    """The instruction sets that compiler ``flags`` (``-mavx2``...) enable and this CPU
    lacks: code built with them would stop with SIGILL here."""
    have = {f.replace('_', '') for f in cpu_features()}  # (cpuinfo's avx512_fp16...)
    wanted = [f[2:] for f in flags if re.fullmatch(r'-m[a-z0-9]+', f)]
    return [w for w in wanted if w.replace('_', '') not in have]


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ('0', 'false', 'no', 'off', '')


def build_required() -> bool:
    """Whether a failed build of our compiled code (this kernel, the ONNX Runtime
    operators of ``deploy.ort_ops``) is an error: ``FLATTEN_MM_REQUIRE_CPU_KERNELS=1``."""
    return _env_flag(ENV_REQUIRE, '0')


def enabled() -> bool:
    """Whether the compiled kernels may be used: ``use_cpu_kernels`` if active, else the
    ``FLATTEN_MM_CPU_KERNELS`` switch (default on)."""
    return _override if _override is not None else _env_flag(ENV_SWITCH, '1')


@contextlib.contextmanager
def use_cpu_kernels(flag: bool) -> Iterator[None]:
    """Force the compiled kernels on (when built) or off inside the block, e.g. to compare
    the fused kernel with the pure-PyTorch path (not thread-safe)."""
    global _override
    previous, _override = _override, bool(flag)
    try:
        yield
    finally:
        _override = previous


def _build() -> None:
    global _loaded, _error
    from torch.utils import cpp_extension  # late: it imports setuptools; only a build needs it
    isa = isa_flags()
    # The build's name carries its ISA flags (a cache shared by machines never hands one CPU
    # another's build); and code compiled for an ISA this CPU lacks is not loaded at all
    # (its static initialisers run at load and would stop the process with SIGILL).
    missing = missing_isa(isa)
    if missing:
        raise RuntimeError(f'the kernel would be compiled with {" ".join(isa)}, and this CPU '
                           f'lacks {", ".join(missing)}; set {ENV_ISA}=generic')
    digest = hashlib.sha1(' '.join(isa).encode())
    for path in (_SOURCE, ) + _HEADERS:
        with open(path, 'rb') as f:
            digest.update(f.read())
    digest = digest.hexdigest()[:10]
    name = f'flatten_mm_cpu_{digest}'
    root = os.environ.get('FLATTEN_MM_EXT_DIR') or osp.join(
        os.environ.get('XDG_CACHE_HOME') or osp.expanduser('~/.cache'), 'flatten_mm', 'ext')
    build_dir = osp.join(root, f'torch{torch.__version__}', name)
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(
        name=name, sources=[_SOURCE], build_directory=build_dir, is_python_module=False,
        extra_cflags=['-O3', '-fopenmp', '-fno-math-errno'] + isa,
        extra_ldflags=['-fopenmp'], verbose=False)
    _loaded = all(hasattr(torch.ops.flatten_mm, op) for op in _OPS)
    if not _loaded:
        _error = f'the library loaded but did not register flatten_mm::{{{", ".join(_OPS)}}}'


def quadtree_level_kernel() -> Optional[Callable]:
    """``torch.ops.flatten_mm.quadtree_level`` (see the C++ source), building it on the
    first call; ``None`` when disabled, while compiling a graph or exporting to ONNX
    (``flatten_mm.deploy`` also switches the kernels off around its export), or if the build
    failed (warned once; ``RuntimeError`` instead when ``FLATTEN_MM_REQUIRE_CPU_KERNELS=1``)."""
    global _loaded, _error
    if not enabled() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export():
        return None
    if _loaded is None:
        with _lock:
            if _loaded is None:
                try:
                    _build()
                except Exception as e:  # no compiler, no headers, ...
                    _loaded = False
                    _error = f'{type(e).__name__}: {e}'
                if not _loaded and not build_required():
                    warnings.warn(
                        'flatten_mm: the fused QuadTree CPU kernel could not be built; using '
                        f'the pure-PyTorch path (same results, slower). Reason: {_error}',
                        RuntimeWarning, stacklevel=2)
    if not _loaded and build_required():
        raise RuntimeError(f'flatten_mm: the fused QuadTree CPU kernel could not be built '
                           f'({ENV_REQUIRE} is set): {_error}')
    return torch.ops.flatten_mm.quadtree_level if _loaded else None


def status() -> str:
    """One line: whether the compiled kernels are in use, and why not."""
    if not enabled():
        return f'disabled ({ENV_SWITCH}=0 or use_cpu_kernels(False))'
    if _loaded is None:
        return 'not built yet (built on first CPU use)'
    return 'loaded' if _loaded else f'unavailable: {_error}'


class _Level(torch.autograd.Function):
    """One finer level by the fused kernels, with autograd: keeps the inputs, and the
    backward kernel rebuilds the scores and weights from them (see ``level``)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prev_idx: torch.Tensor,
                prev_score: Optional[torch.Tensor], width: int, temp: float, topk: int):
        type_a = prev_score is not None
        msg = torch.zeros_like(q)
        next_idx, next_score = torch.ops.flatten_mm.quadtree_level(
            q, k, v, prev_idx, prev_score, msg, width, temp, topk, type_a)
        ctx.save_for_backward(q, k, v, prev_idx, prev_score, next_idx)
        ctx.width, ctx.temp = width, temp
        ctx.mark_non_differentiable(next_idx)
        if not type_a:
            ctx.mark_non_differentiable(next_score)
        ctx.set_materialize_grads(False)
        return msg, next_idx, next_score

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor], _, next_grad: Optional[torch.Tensor]):
        q, k, v, prev_idx, prev_score, next_idx = ctx.saved_tensors
        if records_backward_graph():  # (create_graph: the level op by op, registered by
            # the QuadTree operator as 'quadtree_level')
            grads = differentiate_reference(
                'quadtree_level', (q, k, v, prev_idx, prev_score, next_idx, ctx.width,
                                   ctx.temp), ctx.needs_input_grad[:5] + (False, ) * 3,
                (grad, next_grad))
            return tuple(grads[:5]) + (None, None, None)
        grad = torch.zeros_like(q) if grad is None else grad.contiguous()
        dq, dk, dv, dprev = torch.ops.flatten_mm.quadtree_level_backward(
            grad, q, k, v, prev_idx, prev_score, next_idx, next_grad, ctx.width, ctx.temp,
            prev_score is not None)
        return dq, dk, dv, None, dprev if prev_score is not None else None, None, None, None


def level(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prev_idx: torch.Tensor,
          prev_score: Optional[torch.Tensor], width: int, temp: float,
          topk: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One finer level of QuadTree attention by the compiled kernels, differentiable in
    ``q``, ``k``, ``v`` and (variant A) ``prev_score``; call only when
    ``quadtree_level_kernel()`` returned the kernel.

    Args:
        q, k, v: ``(BH, M, d)`` float32, raster order of an ``(M / width, width)`` level
            with even sides (``q`` not pre-scaled).
        prev_idx: ``(BH, M / 4, Kp)`` int64 cells of the coarser grid each parent selected.
        prev_score: variant A: ``(BH, M / 4, Kp)`` float32 weights of those cells;
            ``None`` selects variant B.
        width: the level's width.
        temp: the score scale (``d ** -0.5``).
        topk: candidates each query passes on (0 at the final level).

    Returns:
        ``msg`` ``(BH, M, d)``, ``next_idx`` ``(BH, M, topk)`` int64 candidate rows of this
        level (no gradient) and ``next_score`` (A: their weights, ``(BH, M, topk)``; B:
        empty).
    """
    return _Level.apply(q.contiguous(), k.contiguous(), v.contiguous(), prev_idx.contiguous(),
                        None if prev_score is None else prev_score.contiguous(), width, temp,
                        topk)
