"""Feed-forward blocks (the PVT family's, also the MLP of every other backbone's blocks)."""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.autograd_paths import (autocast_operands, differentiate_reference, recorded_eagerly,
                                  records_backward_graph)
from ..ops.layout import map_as_tokens, tokens_as_map
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
        ctx.save_for_backward(z, weight, bias)
        ctx.has_bias = bias is not None
        ctx.approximate = approximate
        return _GELULinear.reference(z, weight, bias, approximate)

    @staticmethod
    def reference(z, weight, bias, approximate):
        return F.linear(F.gelu(z, approximate=approximate), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if records_backward_graph():  # (create_graph: the plain ops, differentiable)
            z, weight, bias = ctx.saved_tensors
            return (*differentiate_reference(_GELULinear.reference, (z, weight, bias,
                                                                     ctx.approximate),
                                             ctx.needs_input_grad, (grad, )), )
        z, weight, _ = ctx.saved_tensors
        a = F.gelu(z, approximate=ctx.approximate)  # recomputed
        g2 = grad.reshape(-1, grad.shape[-1])
        dw = g2.t().mm(a.reshape(-1, a.shape[-1]))
        db = g2.sum(0) if ctx.has_bias else None
        return _gelu_input_grad(grad, weight, z, a, ctx.approximate), dw, db, None


def _gelu_input_grad(grad: torch.Tensor, weight: torch.Tensor, z: torch.Tensor,
                     buffer: torch.Tensor, approximate: str) -> torch.Tensor:
    """``gelu_backward(grad @ weight, z)`` written into ``buffer`` (the recomputed GELU
    output, no longer needed, of ``z``'s shape): one hidden-size buffer for the backward
    instead of three fresh ones (each a page-faulted allocation for large maps on CPU);
    the same kernels, so the same values."""
    if buffer.dtype != torch.promote_types(grad.dtype, weight.dtype) \
            or not buffer.is_contiguous():
        return torch.ops.aten.gelu_backward(grad.matmul(weight), z, approximate=approximate)
    torch.matmul(grad, weight, out=buffer)
    return torch.ops.aten.gelu_backward.grad_input(buffer, z, approximate=approximate,
                                                  grad_input=buffer)


class _DWConvGELULinear(torch.autograd.Function):
    """``fc2(gelu(dwconv(u)))`` on tokens whose backward recomputes the depth-wise conv and
    the GELU from ``u`` instead of keeping ``dwconv(u)`` (the conv keeps ``u`` anyway): two
    of the PVTv2 MLP's three hidden-size activations are not kept, for one depth-wise conv
    and one GELU more in the backward. The backward runs the ops autograd would run
    (``convolution_backward``, ``gelu_backward``, the ``mm`` and ``sum`` of the linear), so
    outputs and gradients are those of the plain modules."""

    @staticmethod
    def _conv(u, hw_shape, weight, bias, padding):
        img = tokens_as_map(u, hw_shape)
        return map_as_tokens(F.conv2d(img, weight, bias, 1, padding, 1, img.shape[1]))

    @staticmethod
    def forward(ctx, u, hw_shape, conv_weight, conv_bias, padding, weight, bias,
                approximate):
        ctx.save_for_backward(u, conv_weight, conv_bias, weight, bias)
        ctx.args = (hw_shape, padding, bias is not None, approximate)
        return _DWConvGELULinear.reference(u, hw_shape, conv_weight, conv_bias, padding,
                                           weight, bias, approximate)

    @staticmethod
    def reference(u, hw_shape, conv_weight, conv_bias, padding, weight, bias, approximate):
        z = _DWConvGELULinear._conv(u, hw_shape, conv_weight, conv_bias, padding)
        return F.linear(F.gelu(z, approximate=approximate), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        u, conv_weight, conv_bias, weight, bias = ctx.saved_tensors
        hw_shape, padding, has_bias, approximate = ctx.args
        if records_backward_graph():  # (create_graph: the plain ops, differentiable)
            return (*differentiate_reference(
                _DWConvGELULinear.reference, (u, hw_shape, conv_weight, conv_bias, padding,
                                              weight, bias, approximate),
                ctx.needs_input_grad, (grad, )), )
        z = _DWConvGELULinear._conv(u, hw_shape, conv_weight, conv_bias, padding)
        a = F.gelu(z, approximate=approximate)  # recomputed
        g2 = grad.reshape(-1, grad.shape[-1])
        dw = g2.t().mm(a.reshape(-1, a.shape[-1]))
        db = g2.sum(0) if has_bias else None
        dz = _gelu_input_grad(grad, weight, z, a, approximate)
        del a
        needs = ctx.needs_input_grad
        img = tokens_as_map(u, hw_shape)
        du, dcw, dcb = torch.ops.aten.convolution_backward(
            tokens_as_map(dz, hw_shape), img, conv_weight,
            None if conv_bias is None else list(conv_bias.shape), [1, 1], list(padding),
            [1, 1], False, [0, 0], img.shape[1],
            [needs[0], needs[2], conv_bias is not None and needs[3]])
        du = None if du is None else map_as_tokens(du)
        return du, None, dcw, dcb, None, dw, db, None


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
            is inactive), the GELU's output -- and with ``dwconv`` the conv's output too --
            is recomputed in the backward instead of kept (``_GELULinear``,
            ``_DWConvGELULinear``): the same outputs and gradients with one (two with
            ``dwconv``) of the MLP's three hidden-size activations not kept, for a GELU
            (and a depth-wise conv) more in the backward. ``False``: plain modules.
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

    def _fuses_dwconv(self, x: torch.Tensor) -> bool:
        """Whether ``_DWConvGELULinear`` runs: the activation is recomputed and the conv is
        the 3x3 depth-wise, stride-1 one this module builds."""
        c = self.dwconv
        return (c is not None and c.groups == c.in_channels == c.out_channels
                and c.stride == (1, 1) and c.dilation == (1, 1) and c.padding_mode == 'zeros'
                and 2 * c.padding[0] + 1 == c.kernel_size[0]
                and 2 * c.padding[1] + 1 == c.kernel_size[1]
                and self._recomputes_act(x))

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        if self._fuses_dwconv(x):
            # (cast as the conv and fc2 would be under autocast, then run without it)
            x, cw, cb, w, b = autocast_operands(x, self.dwconv.weight, self.dwconv.bias,
                                                self.fc2.weight, self.fc2.bias)
            with torch.autocast(device_type=x.device.type, enabled=False):
                x = _DWConvGELULinear.apply(x, hw_shape, cw, cb, self.dwconv.padding, w, b,
                                            self.act.approximate)
            return self.drop(x)
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
