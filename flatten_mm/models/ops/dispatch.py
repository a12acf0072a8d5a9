"""The one dispatch between the attention operators' PyTorch paths and their Triton kernels.

Two kernel families sit behind it: ``'fla'`` (``ops.fla_triton``, the FLA core and the
projected FLA layer) and ``'quadtree'`` (``ops.quadtree_triton``, QuadTree's finer levels).
An operator asks ``use_kernels(use_triton, family, x, why_not, key)`` and runs the kernels
only if it says yes; the PyTorch path is the fallback and the reference.

``use_triton`` (an operator argument, or ``use_triton=...`` of any backbone):

* ``False``, or ``FLATTEN_MM_TRITON=0`` in the environment: never.
* ``True``: always (but for an empty batch, which takes the PyTorch path: there is nothing
  to compute); anything that stands in the way raises (the kernels do not import, the
  inputs do not fit, deterministic mode with atomics), and a kernel error propagates.
* ``None`` (auto, the default): on CUDA tensors, outside tracing / ONNX export, when
  Triton imports, and then only after passing these gates, in this order:

  1. **determinism**: with ``torch.use_deterministic_algorithms(True)`` (mmengine's
     ``randomness=dict(deterministic=True)``) a family whose backward accumulates with float
     atomics (QuadTree) is not used when autograd records the call (inference keeps it);
  2. **ROCm**: the kernels are built and checked for NVIDIA GPUs only (``torch.version.hip``);
  3. **the inputs** (the family's ``check_inputs``, ``why_not``), including the device's
     shared memory for the tiles the launch would compile (``kernel_limits``);
  4. **the first-use check**: the first time a kernel configuration (``key``: the op and
     everything that selects its compiled specialisation -- dtypes, matmul precision,
     channels, heads, and the ``specialisation.layout`` of every input: alignment, size
     and stride classes) meets a device in this process, its forward and backward run on
     a tiny input of the same layout spanning at least two tiles with a ragged tail,
     against the PyTorch path (``register_first_use_check``), synchronised, inside
     ``try``. The check runs in a thread of its own, so nothing of the caller's -- saved-
     tensor hooks (``with_cp``'s checkpoint, offloading), grad / inference mode, autocast,
     ``torch.func`` transforms, compile tracing -- reaches it, and it changes nothing of
     the caller's (RNG included). During CUDA-graph capture it does not run: that call
     takes the PyTorch path and the check runs at the next eager call. An exception or a
     mismatch beyond ``TOLERANCES`` gives **one** ``RuntimeWarning`` naming the op, the
     device (name, compute capability), the dtype and what happened, and the PyTorch path
     for that configuration from then on. The verdict is cached per (family, device, key)
     and made once: threads that meet a configuration while its check runs wait for its
     verdict. An interrupt (``KeyboardInterrupt``) of the caller propagates at once; the
     check runs on to its end in its thread and gives the verdict, and no other check of
     that configuration starts meanwhile.

  A kernel that raises later in eager mode (a specialisation the check did not compile)
  is treated the same way (``guarded``): one warning, the PyTorch path for that call and
  every later one of its configuration. Out-of-memory errors are re-raised, and so are
  errors that leave the device unusable (an illegal address, a device-side assert: CUDA
  keeps failing after them, so a fallback cannot run), as ``DeviceUnusable`` naming the
  kernel.

Under ``torch.compile`` every decision is a constant of the graph (``assume_constant_result``:
no graph break; a verdict not yet made runs its check when the graph is traced). On CPU
tensors in auto mode nothing but ``use_triton`` and the device type is looked at.
"""
import contextlib
import functools
import importlib
import os
import threading
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from . import specialisation

#: environment switch: ``FLATTEN_MM_TRITON=0`` turns the Triton kernels off everywhere
TRITON_ENV = 'FLATTEN_MM_TRITON'

#: family -> (kernel module, whether its backward accumulates with float atomics)
FAMILIES: Dict[str, Tuple[str, bool]] = {
    'fla': ('flatten_mm.models.ops.fla_triton', False),
    'quadtree': ('flatten_mm.models.ops.quadtree_triton', True),
}

#: device types on which ``use_triton=None`` considers the kernels. Tests add ``'cpu'`` to
#: exercise the auto mode on kernels run by Triton's interpreter (``TRITON_INTERPRET=1``).
AUTO_DEVICE_TYPES: Tuple[str, ...] = ('cuda', )

#: first-use check tolerance: the largest absolute difference from the PyTorch path,
#: relative to the largest absolute value of the PyTorch path, per output dtype (and TF32
#: matmuls). Both paths accumulate in float32 and round once, so they differ by at most
#: two roundings of the output dtype (bf16 2^-8, fp16 2^-10) or of TF32's inputs (~2e-3)
#: plus float32 summation order (~1e-6 measured on the CPU); the bounds leave 2x headroom.
TOLERANCES = {'float32': 1e-4, 'tf32': 5e-3, 'bfloat16': 2.0**-7, 'float16': 2.0**-9,
              'float64': 1e-10}

_lock = threading.RLock()
_import_errors: Dict[str, Optional[str]] = {}  # family -> None (imports) or why not
_checks: Dict[str, Callable[[tuple, torch.device], None]] = {}
_verdicts: Dict[Tuple[str, str, tuple], bool] = {}
_in_flight: Dict[Tuple[str, str, tuple], '_InFlight'] = {}
_warned = set()


class KernelMismatch(AssertionError):
    """A kernel's result differs from the PyTorch path beyond the tolerance."""


class DeviceUnusable(RuntimeError):
    """A kernel left its CUDA device unusable (a sticky error): no fallback can run."""


#: CUDA errors that stay set in the context once raised (cudaError_t codes) ...
_STICKY_CODES = frozenset((700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 720, 214))
#: ... and how the CUDA runtime / driver (through PyTorch or Triton) words them
_STICKY_WORDS = ('illegal memory access', 'illegal address', 'illegal instruction',
                 'misaligned address', 'unspecified launch failure', 'device-side assert',
                 'hardware stack error', 'invalid program counter', 'launch timed out',
                 'uncorrectable ecc', 'cuda_error_illegal', 'cuda_error_launch_failed',
                 'cuda_error_assert', 'cuda_error_misaligned')


def leaves_device_unusable(error: BaseException) -> bool:
    """Whether ``error`` is a sticky CUDA error: after it every CUDA call of the process
    fails, so a fallback on the device would only fail with an unrelated message."""
    if getattr(error, 'error_code', None) in _STICKY_CODES:
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in _STICKY_WORDS)


def _unusable(family: str, key: tuple, device: torch.device, error: BaseException,
              when: str) -> DeviceUnusable:
    op, dtype = (key + ('?', '?'))[:2]
    msg = str(error).strip().splitlines()
    return DeviceUnusable(
        f'flatten_mm: the {family} Triton kernel {op} ({dtype}) left {device} unusable '
        f'{when}: {type(error).__name__}: {msg[0] if msg else ""}. CUDA fails every later '
        'call of this process, so there is no fallback: restart it, and set '
        'FLATTEN_MM_TRITON=0 (or use_triton=False) to run without the kernels; please '
        f'report the kernel and configuration {key}')


def triton_env_enabled() -> bool:
    """``False`` when ``FLATTEN_MM_TRITON`` is ``0`` / ``false`` / ``no`` / ``off``."""
    return os.environ.get(TRITON_ENV, '1').strip().lower() not in ('0', 'false', 'no', 'off')


def check_use_triton(use_triton: Optional[bool]) -> Optional[bool]:
    """Validate an operator's ``use_triton`` argument (``None``, ``True`` or ``False``)."""
    if not (use_triton is None or isinstance(use_triton, bool)):
        raise ValueError(f'use_triton must be None, True or False, got {use_triton!r}')
    return use_triton


def kernel_module(family: str):
    """The family's kernel module (imported once; the first failure is warned about and
    remembered: ``None`` then)."""
    with _lock:
        if family not in _import_errors:
            try:
                importlib.import_module(FAMILIES[family][0])
                _import_errors[family] = None
            except Exception as e:  # ImportError, or a Triton that fails to initialise
                _import_errors[family] = f'{type(e).__name__}: {e}'
                warnings.warn(f'flatten_mm: {family} Triton kernels unavailable, using the '
                              f'PyTorch path ({_import_errors[family]})', RuntimeWarning,
                              stacklevel=3)
        if _import_errors[family] is not None:
            return None
        return importlib.import_module(FAMILIES[family][0])


@torch.compiler.assume_constant_result  # (a constant under torch.compile: no graph break)
def kernels_import(family: str) -> bool:
    """Whether the family's kernel module imports (see ``kernel_module``)."""
    return kernel_module(family) is not None


def import_error(family: str) -> Optional[str]:
    """Why the family's kernels did not import (``None`` if they did or were not tried)."""
    return _import_errors.get(family)


def register_first_use_check(family: str, check: Callable[[tuple, torch.device], None]) -> None:
    """Set the family's first-use check: ``check(key, device)`` runs the kernels of ``key``
    forward and backward on a tiny input on ``device`` and raises (``KernelMismatch`` or the
    kernel's own error) if they do not match the PyTorch path. Registered by the operator
    modules, which own the reference."""
    _checks[family] = check


def device_description(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200, sm_90)``, or the device and what runs the kernels there."""
    if device.type == 'cuda':
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f'cuda:{index} ({props.name}, sm_{props.major}{props.minor})'
    return f'{device} (Triton interpreter)'


def _device_key(device: torch.device) -> str:
    if device.type == 'cuda' and device.index is None:
        return f'cuda:{torch.cuda.current_device()}'
    return str(device)


def is_rocm(device: torch.device) -> bool:
    return device.type == 'cuda' and torch.version.hip is not None


def gate_problem(family: str, device: torch.device, records_grad: bool) -> Optional[str]:
    """Why the family's kernels must not serve this device / mode (``None`` if they may):
    deterministic algorithms with a backward that uses atomics, or a ROCm device."""
    if (records_grad and FAMILIES[family][1]
            and torch.are_deterministic_algorithms_enabled()):
        return (f'deterministic algorithms are enabled and the {family} kernels\' backward '
                'accumulates with float atomics (not bitwise reproducible)')
    if is_rocm(device):
        return 'a ROCm (HIP) device: the kernels are built and checked for NVIDIA GPUs only'
    return None


def _auto_device(x: torch.Tensor) -> bool:
    return x.device.type in AUTO_DEVICE_TYPES


def wanted(use_triton: Optional[bool], family: str, x: torch.Tensor,
           records_grad: bool = False) -> bool:
    """The gates that do not depend on the inputs' shapes: whether the family's kernels may
    serve tensors like ``x`` (``use_triton=True``: ``RuntimeError`` where they cannot)."""
    if use_triton is False or use_triton is None and not _auto_device(x):
        return False  # (first: nothing else is looked at on the CPU path, e.g. under dynamo)
    if x.numel() == 0:
        return False  # (an empty batch: nothing to compute, the PyTorch path in every mode)
    if not triton_env_enabled():
        return False
    if use_triton is None:
        if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            return False
        if not kernels_import(family):
            return False
    elif use_triton is not True:
        raise ValueError(f'use_triton must be None, True or False, got {use_triton!r}')
    elif not kernels_import(family):
        raise RuntimeError(f'use_triton=True but the {family} Triton kernels do not import: '
                           f'{import_error(family)}')
    why = _gate_problem_constant(family, x.device.type, x.device.index, records_grad)
    if why is not None:
        if use_triton:
            raise RuntimeError(f'use_triton=True but {why}')
        return False
    return True


@torch.compiler.assume_constant_result
def _gate_problem_constant(family: str, device_type: str, index: Optional[int],
                           records_grad: bool) -> Optional[str]:
    return gate_problem(family, torch.device(device_type, index), records_grad)


def use_kernels(use_triton: Optional[bool], family: str, x: torch.Tensor,
                why_not: Callable[[], Optional[str]], key: Callable[[], tuple],
                records_grad: bool = False) -> bool:
    """Whether to run the family's kernel for this call: ``wanted``, then the inputs
    (``why_not()``: the family's ``check_inputs``; ``use_triton=True``: ``ValueError`` saying
    why not), then in auto mode the first-use check of ``key()`` on ``x``'s device."""
    if not wanted(use_triton, family, x, records_grad):
        return False
    why = why_not()
    if why is not None:
        if use_triton:
            raise ValueError(f'use_triton=True but the {family} Triton kernels cannot take '
                             f'these inputs: {why}')
        return False
    if use_triton:
        return True
    return verdict(family, x.device.type, x.device.index, key())


@torch.compiler.assume_constant_result
def verdict(family: str, device_type: str, index: Optional[int], key: tuple) -> bool:
    """Whether the kernel configuration ``key`` passed its first-use check on the device
    (run now if it was not checked yet in this process; ``False`` without a verdict during
    CUDA-graph capture, where the check cannot run). One check per configuration and
    device: a caller that meets it while another thread's check runs waits for that
    check's verdict."""
    device = torch.device(device_type, index)
    cache_key = (family, _device_key(device), key)
    while True:
        with _lock:
            if cache_key in _verdicts:
                return _verdicts[cache_key]
            flight = _in_flight.get(cache_key)
            if flight is None:
                if stream_capturing(device):
                    return False  # (the PyTorch path for this call; checked at an eager call)
                flight = _in_flight[cache_key] = _InFlight(cache_key)
                break
        # (another thread checks this configuration: its verdict, or if that check ended
        # without one -- an out-of-memory error, an interrupt -- this thread's own check)
        flight.done.wait()
    passed = None
    try:
        passed = _run_first_use_check(family, device, key, flight)
    finally:
        flight.leave('caller', passed)
    return passed


class _InFlight:
    """The first-use check of one (family, device, key) while it runs. Two parties leave
    it: the caller that started it and, once started, the check's thread; the verdict
    (if one was made) is published and the waiting callers woken when both have. A caller
    interrupted while its check runs leaves first, and the check's thread then judges its
    own outcome."""

    def __init__(self, cache_key: Tuple[str, str, tuple]):
        self.cache_key = cache_key
        self.done = threading.Event()
        self._parties = {'caller'}

    def enter(self, party: str) -> None:
        with _lock:
            self._parties.add(party)

    def abandoned(self) -> bool:
        """Whether the caller left before the check's thread ended (it was interrupted)."""
        with _lock:
            return 'caller' not in self._parties

    def leave(self, party: str, passed: Optional[bool]) -> None:
        with _lock:
            if passed is not None:
                _verdicts.setdefault(self.cache_key, passed)
            self._parties.discard(party)
            if self._parties:
                return
            if _in_flight.get(self.cache_key) is self:
                del _in_flight[self.cache_key]
        self.done.set()


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return (device.type == 'cuda' and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


def _run_first_use_check(family: str, device: torch.device, key: tuple,
                         flight: Optional[_InFlight] = None) -> bool:
    check = _checks.get(family)
    if check is None:
        return True  # (no check registered: the operator module was not imported)
    # (under torch.compile the inputs' alignment is the compiler's: both variants)
    keys = ([specialisation.resolved(key, True), specialisation.resolved(key, False)]
            if specialisation.unknown_alignment(key) else [key])
    finished = None
    if flight is not None:
        flight.enter('check')
        finished = functools.partial(_check_ended, family, device, key, flight)
    error = run_isolated(lambda: [_checked(check, k, device) for k in keys], device, finished)
    return _judged(family, device, key, error)


def _check_ended(family: str, device: torch.device, key: tuple, flight: _InFlight,
                 error: Optional[BaseException]) -> None:
    """The check's thread leaves its ``flight``, judging the outcome itself if the caller
    was interrupted meanwhile (nobody else will)."""
    passed = None
    if flight.abandoned():
        with contextlib.suppress(Exception):  # (out of memory, unusable: no verdict)
            passed = _judged(family, device, key, error)
    flight.leave('check', passed)


def _judged(family: str, device: torch.device, key: tuple,
            error: Optional[BaseException]) -> bool:
    """The verdict of a first-use check that raised ``error`` (``None``: it passed)."""
    if error is None:
        return True
    if isinstance(error, torch.cuda.OutOfMemoryError):
        raise error
    if leaves_device_unusable(error):
        raise _unusable(family, key, device, error, 'in its first-use check') from error
    what = ('disagreed with the PyTorch path in its first-use check'
            if isinstance(error, KernelMismatch) else 'raised in its first-use check')
    report_failure(family, key, device, error, what)
    return False


def _checked(check: Callable[[tuple, torch.device], None], key: tuple,
             device: torch.device) -> None:
    with device_guard(device):
        check(key, device)
        if device.type == 'cuda':
            torch.cuda.synchronize(device)


def run_isolated(fn: Callable[[], None], device: torch.device,
                 finished: Optional[Callable[[Optional[BaseException]], None]] = None
                 ) -> Optional[BaseException]:
    """Run ``fn`` in a new thread and return what it raised (``None`` if nothing): the
    thread starts with PyTorch's defaults -- grad mode on, no inference mode, autocast off,
    no saved-tensor hooks, no ``torch.func`` transform, no compile tracing, no dispatch
    mode -- whatever the caller's thread has on, and what ``fn`` records is its own. (The
    global settings stay: deterministic algorithms, anomaly mode, TF32 flags.)

    An interrupt of the caller while it waits propagates at once; the thread runs on to
    the end of ``fn``. ``finished(error)`` is called exactly once, in the thread when ``fn``
    has ended, whether or not the caller still waits (or in the caller, with ``None``, if
    the thread could not start)."""
    outcome: Dict[str, BaseException] = {}

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # (handed to the caller's thread)
            outcome['error'] = e
        if finished is not None:
            finished(outcome.get('error'))

    thread = threading.Thread(target=target, name='flatten_mm-first-use-check', daemon=True)
    try:
        thread.start()
    except BaseException:
        if finished is not None:
            finished(None)
        raise
    thread.join()
    return outcome.get('error')


def report_failure(family: str, key: tuple, device: torch.device, error: BaseException,
                   what: str) -> None:
    """The one warning of a failed kernel configuration (and its verdict: not used again)."""
    op, dtype = (key + ('?', '?'))[:2]
    # (one warning per op, dtype, device and kind of failure: the configurations of one
    # op differ in layouts and sizes, and the same failure of each is one message)
    seen = (family, op, dtype, _device_key(device), what, type(error).__name__)
    with _lock:
        _verdicts[(family, _device_key(device), key)] = False
        if seen in _warned:
            return
        _warned.add(seen)
    msg = str(error).strip().splitlines()
    warnings.warn(
        f'flatten_mm: the {family} Triton kernel {op} ({dtype}) {what} on '
        f'{device_description(device)}: {type(error).__name__}: '
        f'{msg[0] if msg else ""}; it runs on the PyTorch path from now on in this process '
        f'(configuration {key}; FLATTEN_MM_TRITON=0 turns the kernels off)',
        RuntimeWarning, stacklevel=3)


def guarded(family: str, key: tuple, device: torch.device, forced: bool,
            kernel: Callable[[], object], fallback: Callable[[], object]):
    """``kernel()``, or in auto mode, eagerly, if it raises (a compilation or resource error
    of a specialisation the first-use check did not compile): the one warning and
    ``fallback()``. Out-of-memory errors and errors under ``use_triton=True`` propagate, and
    an error that leaves the device unusable raises ``DeviceUnusable`` (no fallback could
    run); under ``torch.compile`` the kernel call is traced as it is."""
    if forced or torch.compiler.is_compiling():
        return kernel()
    try:
        return kernel()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:
        if leaves_device_unusable(e):
            raise _unusable(family, key, device, e, 'when it ran') from e
        report_failure(family, key, device, e, 'raised')
        return fallback()


def device_guard(device: torch.device):
    """The context in which a kernel for tensors on ``device`` is launched: that CUDA
    device made current (Triton launches on the current device), else nothing."""
    if device.type == 'cuda' and not torch.compiler.is_compiling():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def precision_name(dtype: torch.dtype) -> str:
    """The tolerance class of a float32 kernel output: ``'tf32'`` when TF32 matmuls are
    allowed (the kernels and the PyTorch path then both use them), else the dtype's name."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return 'tf32'
    return str(dtype).replace('torch.', '')


def assert_close(name: str, got: Optional[torch.Tensor], ref: Optional[torch.Tensor],
                 tolerance: float) -> None:
    """Raise ``KernelMismatch`` unless ``got`` matches ``ref``: same shape, non-finite
    values in the same places, and the largest difference of the finite ones within
    ``tolerance`` of the largest reference value."""
    if got is None or ref is None:
        if got is not ref:
            raise KernelMismatch(f'{name}: one path gives no value')
        return
    if got.shape != ref.shape:
        raise KernelMismatch(f'{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}')
    g, r = got.detach().double(), ref.detach().double()
    if not torch.equal(g.isnan(), r.isnan()) or not torch.equal(g.isinf(), r.isinf()):
        raise KernelMismatch(f'{name}: NaN / Inf in other places than the PyTorch path')
    finite = r.isfinite()
    if not finite.any():
        return
    scale = r[finite].abs().max().clamp_min(1e-30)
    err = float((g[finite] - r[finite]).abs().max() / scale)
    if not err <= tolerance:
        raise KernelMismatch(f'{name}: largest difference {err:.2e} of the largest value, '
                             f'tolerance {tolerance:.1e}')


def compare_paths(op: str, run: Callable[[bool], torch.Tensor], leaves, gen: torch.Generator,
                  tolerance: float) -> None:
    """The core of a first-use check: ``run(True)`` (the kernels) and ``run(False)`` (the
    PyTorch path), each with a backward of the same random output gradient into
    ``leaves``; ``KernelMismatch`` unless output and every gradient agree (``assert_close``)."""
    grad_out, results = None, []
    for use_triton in (True, False):
        out = run(use_triton)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=gen).to(out)
        results.append((out, torch.autograd.grad(out, leaves, grad_out)))
    (out_k, grads_k), (out_r, grads_r) = results
    assert_close(f'{op} output', out_k, out_r, tolerance)
    for i, (a, b) in enumerate(zip(grads_k, grads_r)):
        assert_close(f'{op} gradient of input {i}', a, b, tolerance)


def check_generator(seed: int = 0) -> torch.Generator:
    """A CPU generator for the first-use checks' inputs (the caller's RNG is not drawn)."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def reset() -> None:
    """Forget every verdict, warning and import failure (tests; a new process starts so)."""
    with _lock:
        _verdicts.clear()
        _in_flight.clear()
        _warned.clear()
        _import_errors.clear()


def verdicts() -> Dict[Tuple[str, str, tuple], bool]:
    """The first-use verdicts made so far: ``{(family, device, key): passed}``."""
    with _lock:
        return dict(_verdicts)
