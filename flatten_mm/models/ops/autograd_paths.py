"""Helpers of the layers' own autograd paths (custom ``autograd.Function``s, recomputation):
when they apply, and the autocast casts of the fused paths that run outside autocast."""
from typing import Optional, Tuple

import torch


def autocast_operands(*tensors: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """The tensors cast as autocast casts a matmul's operands on the first one's device:
    inside an autocast region, floating tensors other than float64 to its dtype; outside,
    unchanged (``None`` stays ``None``). A fused path that casts once with this and then
    runs with autocast off computes what the autocast-dispatched ops would (the same
    cast, made once and shared, e.g. kept once for the backward)."""
    dev = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if t is not None and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


def recorded_eagerly(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` (one of them requires a gradient, in
    grad mode) outside tracing, scripting and ONNX export: where the memory-saving
    autograd paths (custom functions, checkpoints) apply."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and not (torch.jit.is_scripting() or torch.jit.is_tracing()
                     or torch.onnx.is_in_onnx_export()))
