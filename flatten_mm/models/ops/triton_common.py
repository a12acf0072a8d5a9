"""What the Triton kernel modules share: NaN-preserving rounding, the device check, and the
device's shared-memory limit against the compiled tiles (``kernel_limits``)."""
import functools
from typing import Callable, Iterable, Optional

import torch
import triton
import triton.language as tl

from . import dispatch, kernel_limits

#: whether kernels decorated now are interpreted (Triton reads ``TRITON_INTERPRET`` when a
#: kernel is decorated, i.e. when its module is imported): then they run on CPU tensors
INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """float32 -> ``dtype`` rounding to nearest even, bfloat16 included by integer arithmetic
    (Triton's interpreter truncates on ``.to(tl.bfloat16)``; this way CPU tests and GPU round
    alike). NaN stays NaN: the rounding bias would carry NVIDIA's canonical NaN
    ``0x7FFFFFFF`` into the sign bit (-0.0), so a NaN's quiet bit is set and nothing added."""
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = tl.where(x != x, u | 0x00400000, u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def relu(x):
    """``max(x, 0)`` propagating NaN as ``torch.relu`` does (a plain ``tl.maximum`` compiles
    to ``max.f32``, which returns 0 for NaN on NVIDIA GPUs)."""
    return tl.maximum(x, 0., propagate_nan=tl.PropagateNan.ALL)


def device_problem(tensors: Iterable[torch.Tensor], module: str) -> Optional[str]:
    """Why Triton kernels decorated in ``module`` cannot run on the devices of ``tensors``
    (``None`` if they can): one device, CUDA, or the CPU under Triton's interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return f'tensors on several devices {sorted(map(str, devices))}'
    dev = devices.pop()
    if dev.type == 'cpu':
        if not INTERPRETED:
            return ('CPU tensors need Triton\'s interpreter: set TRITON_INTERPRET=1 before '
                    f'{module} is imported')
    elif dev.type != 'cuda':
        return f'device {dev} (the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)'
    return None


def shared_memory_problem(family: str, keys: Callable[[], Iterable[str]],
                          device: torch.device) -> Optional[str]:
    """Why the compiled kernels of a call (``keys()``: their rows of the ahead-of-time limit
    table, ``kernel_limits``) would not fit the shared memory of ``device`` (``None`` if they
    fit, off CUDA, or where the table does not know them: the first-use check decides)."""
    if device.type != 'cuda':
        return None
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, 'shared_memory_per_block_optin', 0) or props.shared_memory_per_block
    for key in keys():
        need = kernel_limits.shared_bytes(family, key, (props.major, props.minor))
        if need is not None and need > limit:
            return (f'{key.split("|")[0]} needs {need} B of shared memory per block, '
                    f'{props.name} has {limit} B')
    return None


def on_tensor_device(launcher: Callable) -> Callable:
    """Decorate a function that launches kernels: it runs with the device of its first
    tensor argument made current (``dispatch.device_guard``), since Triton launches on the
    current CUDA device -- a model on ``cuda:1`` while ``cuda:0`` is current would otherwise
    read another device's memory."""
    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        tensor = next(a for a in list(args) + list(kwargs.values())
                      if isinstance(a, torch.Tensor))
        with dispatch.device_guard(tensor.device):
            return launcher(*args, **kwargs)
    return launch

