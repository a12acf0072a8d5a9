"""Autocast helpers for the fused paths that run their matmuls outside autocast."""
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
