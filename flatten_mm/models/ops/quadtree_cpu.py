"""Optional fused CPU kernels, compiled on first use (``torch.utils.cpp_extension``).

Stock PyTorch has no fast CPU form of QuadTree's per-parent "gather the candidate keys,
score, soft-max, top-k, aggregate" step: it becomes a dozen small operators per level
whose gathered ``(N, 4K, d)`` rows do not fit in cache (docs/benchmarks). The kernel in
``csrc/quadtree_cpu.cpp`` does the step for one parent at a time in cache. It is built once
per machine and torch version with the system C++ compiler (a few tens of seconds; cached
under ``$FLATTEN_MM_EXT_DIR``, default ``~/.cache/flatten_mm/ext``) and used for CPU
inference only. The pure-PyTorch path (``quadtree_attention._finer_level_inference``) stays
the reference and the fallback: it is used with autograd, on other devices, under
``torch.compile``, when ``FLATTEN_MM_CPU_KERNELS=0``, and when the build fails (one
warning with the compiler's message; results are the same either way).
"""
import contextlib
import hashlib
import os
import os.path as osp
import platform
import threading
import warnings
from typing import Callable, Iterator, Optional

import torch

#: environment switch: ``0`` disables the compiled kernels (pure-PyTorch paths only)
ENV_SWITCH = 'FLATTEN_MM_CPU_KERNELS'
#: set ``FLATTEN_MM_REQUIRE_CPU_KERNELS=1`` (CI does) to make a failed build an error
ENV_REQUIRE = 'FLATTEN_MM_REQUIRE_CPU_KERNELS'
#: ``generic`` builds without ISA extensions (the code paths of non-AVX2 machines)
ENV_ISA = 'FLATTEN_MM_CPU_ISA'
_SOURCE = osp.join(osp.dirname(osp.abspath(__file__)), 'csrc', 'quadtree_cpu.cpp')

_lock = threading.Lock()
_loaded: Optional[bool] = None  # None: not tried yet
_error: Optional[str] = None
_override: Optional[bool] = None  # set by ``use_cpu_kernels``


def _isa_flags() -> list:
    """``-mavx2 -mfma`` where the CPU has them (x86-64), else the compiler's baseline
    (also with ``FLATTEN_MM_CPU_ISA=generic``: the portable loops, e.g. to test them)."""
    if os.environ.get(ENV_ISA, '').strip().lower() == 'generic':
        return []
    if platform.machine() in ('x86_64', 'AMD64'):
        try:
            with open('/proc/cpuinfo') as f:
                flags = next((line.split(':', 1)[1].split() for line in f
                              if line.startswith('flags')), [])
        except OSError:
            flags = []
        if 'avx2' in flags and 'fma' in flags:
            return ['-mavx2', '-mfma']
    return []


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ('0', 'false', 'no', 'off', '')


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
    isa = _isa_flags()
    with open(_SOURCE, 'rb') as f:
        digest = hashlib.sha1(f.read() + ' '.join(isa).encode()).hexdigest()[:10]
    name = f'flatten_mm_cpu_{digest}'
    root = os.environ.get('FLATTEN_MM_EXT_DIR') or osp.join(
        os.environ.get('XDG_CACHE_HOME') or osp.expanduser('~/.cache'), 'flatten_mm', 'ext')
    build_dir = osp.join(root, f'torch{torch.__version__}', name)
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(
        name=name, sources=[_SOURCE], build_directory=build_dir, is_python_module=False,
        extra_cflags=['-O3', '-fopenmp', '-fno-math-errno'] + isa,
        extra_ldflags=['-fopenmp'], verbose=False)
    _loaded = hasattr(torch.ops.flatten_mm, 'quadtree_level')
    if not _loaded:
        _error = 'the library loaded but did not register flatten_mm::quadtree_level'


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
                if not _loaded and not _env_flag(ENV_REQUIRE, '0'):
                    warnings.warn(
                        'flatten_mm: the fused QuadTree CPU kernel could not be built; using '
                        f'the pure-PyTorch path (same results, slower). Reason: {_error}',
                        RuntimeWarning, stacklevel=2)
    if not _loaded and _env_flag(ENV_REQUIRE, '0'):
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
