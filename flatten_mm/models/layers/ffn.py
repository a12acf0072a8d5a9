"""Feed-forward blocks (the PVT family's, also the MLP of every other backbone's blocks)."""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.autograd_paths import autocast_operands, recorded_eagerly
from .conv import token_conv


class _GELULinear(torch.autograd.Function):
    """``F.linear(F.gelu(z), weight, bias)`` whose backward recomputes ``gelu(z)`` (one
    elementwise pass) instead of keeping it: only ``z`` is kept, which the GELU's own
    gradient needs anyway (``PVTMlp(recompute_act=True)``). The backward runs the
    operations autograd would run for the two ops (``mm`` for the weight, ``sum`` for the
    bias, ``gelu_backward``), so the gradients are the same."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                approximate: str) -> torch.Tensor:
        ctx.save_for_backward(z, weight)
        ctx.has_bias = bias is not None
        ctx.approximate = approximate
        return F.linear(F.gelu(z, approximate=approximate), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, weight = ctx.saved_tensors
        a = F.gelu(z, approximate=ctx.approximate)  # recomputed
        g2 = grad.reshape(-1, grad.shape[-1])
        dw = g2.t().mm(a.reshape(-1, a.shape[-1]))
        db = g2.sum(0) if ctx.has_bias else None
        dz = torch.ops.aten.gelu_backward(grad.matmul(weight), z, approximate=ctx.approximate)
        return dz, dw, db, None


class PVTMlp(nn.Module):
    """``fc1 -> [ReLU] -> [DWConv 3x3] -> GELU -> fc2`` on tokens.

    With ``dwconv=False`` this is PVT v1's plain MLP; with ``dwconv=True`` PVTv2's
    depth-wise-conv MLP (the conv sees the ``hw_shape`` map of the hidden tokens), and
    ``linear=True`` adds PVTv2-li's ReLU after ``fc1``.

    Args:
        in_features: input/output channels ``C``.
        hidden_features: hidden channels.
        drop: dropout after the activation and after ``fc2``.
        dwconv: insert the 3x3 depth-wise conv (PVTv2).
        linear: ReLU after ``fc1`` (PVTv2-li).
        recompute_act: when autograd records the MLP (and the dropout after the activation
            is inactive), the GELU's output is recomputed in the backward from its input
            instead of kept for ``fc2``'s weight gradient (``_GELULinear``): the same
            outputs and gradients, one of the MLP's three hidden-size activations less
            per block (e.g. a quarter less activation memory of a PVTv2-b0 training step),
            for one elementwise GELU pass more in the backward. ``False``: plain modules.
    """

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.,
                 dwconv: bool = True, linear: bool = False, recompute_act: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.relu = nn.ReLU() if linear else nn.Identity()
        self.dwconv = nn.Conv2d(hidden_features, hidden_features, 3, 1, 1,
                                groups=hidden_features) if dwconv else None
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop = nn.Dropout(drop)
        self.recompute_act = bool(recompute_act)

    def _recomputes_act(self, x: torch.Tensor) -> bool:
        """Whether ``_GELULinear`` runs: asked for, autograd records it (eagerly: not under
        tracing, scripting or ONNX export), the activation is a GELU (it may have been
        swapped) and no dropout sits between it and ``fc2``."""
        return (self.recompute_act and type(self.act) is nn.GELU
                and not (self.training and self.drop.p > 0)
                and recorded_eagerly(x, *self.fc2.parameters()))

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        if self.dwconv is not None:
            x = token_conv(self.dwconv, x, hw_shape)  # channels-last view, no copies
        if self._recomputes_act(x):
            # (cast as fc2 would be under autocast, then run without it)
            x, w, b = autocast_operands(x, self.fc2.weight, self.fc2.bias)
            with torch.autocast(device_type=x.device.type, enabled=False):
                x = _GELULinear.apply(x, w, b, self.act.approximate)
            return self.drop(x)
        x = self.drop(self.act(x))
        return self.drop(self.fc2(x))
