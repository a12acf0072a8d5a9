"""Depth-wise convolution with a fast CPU path, and convolutions on token sequences.

On CPU, PyTorch's oneDNN depth-wise convolution is an order of magnitude faster in the
backward pass with channels-last inputs (a 5x5 DWC on a 2x32x64x96 map: 1.09 s vs 68 ms
forward+backward, torch 2.14, 2 threads). The result is numerically the same convolution.

Tokens ``(B, N, C)`` of an ``(H, W)`` map already *are* that map in channels-last memory
order: ``x.view(B, H, W, C).permute(0, 3, 1, 2)`` is a ``(B, C, H, W)`` tensor with
channels-last strides, no copy. ``token_conv`` runs a convolution on that view and
views its (channels-last) output back as tokens, so neither side pays the two transposed
copies of ``nlc_to_nchw`` / ``nchw_to_nlc`` (a 3x3 DWC of the PVTv2 MLP at 1024x1024,
256 channels: ~55 ms instead of ~200 ms for the convolution plus ~500 ms for the copies,
torch 2.14, one CPU thread).

The weight gradient of a depth-wise convolution larger than 3x3 is slow in oneDNN
(FLA's 5x5 DWC, 96 channels, 256x256 map: 62 ms for the weight gradient against 7 ms
for the forward; 1.6 s at 832x832). ``DepthwiseConvCPU`` computes it as a sum over bands
of rows of grouped convolutions whose kernels are the output gradient's rows (each band
stays in cache): 25 ms and 0.35 s there, the same values up to float rounding (more
exact, fewer terms per sum). For 3x3 oneDNN's own is faster and is kept.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.autograd_paths import (autocast_operands, differentiate_reference, recorded_eagerly,
                                  records_backward_graph)
from ..ops.layout import map_as_tokens, tokens_as_map

#: rows of the output gradient per grouped convolution in the weight gradient
_BAND_ROWS = 16


def depthwise_weight_grad(grad: torch.Tensor, img: torch.Tensor, kernel: Tuple[int, int],
                          padding: Tuple[int, int]) -> torch.Tensor:
    """Weight gradient ``(C, 1, kh, kw)`` of a stride-1 depth-wise convolution of ``img``
    ``(B, C, H, W)`` with zero ``padding`` whose output gradient is ``grad``: for every
    image and band of output rows, a grouped convolution of the padded input rows with
    the gradient rows as kernels (one channel each)."""
    B, C, H, W = grad.shape
    (kh, kw), (ph, pw) = kernel, padding
    padded = F.pad(img, (pw, pw, ph, ph))
    dw = grad.new_zeros(1, C, kh, kw)
    for b in range(B):
        for r0 in range(0, H, _BAND_ROWS):
            r1 = min(H, r0 + _BAND_ROWS)
            rows = padded[b:b + 1, :, r0:r1 + kh - 1].contiguous()
            dw += F.conv2d(rows, grad[b, :, r0:r1].unsqueeze(1).contiguous(), None, 1, 0, 1, C)
    return dw.reshape(C, 1, kh, kw)


class DepthwiseConvCPU(torch.autograd.Function):
    """``F.conv2d(img, weight, bias, 1, padding, 1, C)`` for a depth-wise convolution with
    an odd kernel and "same" padding, whose backward computes the input gradient as the
    convolution with the flipped kernel, the weight gradient by ``depthwise_weight_grad``
    and the bias gradient as a sum (see the module docstring): the gradients of the plain
    convolution up to float rounding, faster on CPU for kernels above 3x3."""

    @staticmethod
    def forward(ctx, img: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                padding: Tuple[int, int]) -> torch.Tensor:
        ctx.save_for_backward(img, weight, bias)
        ctx.padding, ctx.has_bias = tuple(padding), bias is not None
        return F.conv2d(img, weight, bias, 1, padding, 1, img.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if records_backward_graph():  # (create_graph: the plain convolution, differentiable)
            img, weight, bias = ctx.saved_tensors
            grads = differentiate_reference(
                lambda i, w, b: F.conv2d(i, w, b, 1, ctx.padding, 1, i.shape[1]),
                (img, weight, bias), ctx.needs_input_grad[:3], (grad, ))
            return (*grads, None)
        img, weight, _ = ctx.saved_tensors
        # (one dtype for the three: a gradient, or weights changed in place since the
        # forward, in another dtype would fail the convolutions; autograd casts back)
        grad, weight = grad.to(img.dtype), weight.to(img.dtype)
        needs = ctx.needs_input_grad
        C = img.shape[1]
        dx = dw = db = None
        if needs[0]:
            dx = F.conv2d(grad, weight.flip(-2, -1), None, 1, ctx.padding, 1, C)
        if needs[1]:
            dw = depthwise_weight_grad(grad, img, weight.shape[-2:], ctx.padding)
        if ctx.has_bias and needs[2]:
            db = grad.sum((0, 2, 3))
        return dx, dw, db, None


def _fast_depthwise(img: torch.Tensor, weight: torch.Tensor, conv: nn.Conv2d) -> bool:
    """Whether ``DepthwiseConvCPU`` runs: a recorded CPU training step, a depth-wise conv
    (``weight`` ``(C, 1, k, k)``, one group per channel of ``img``) with an odd kernel
    above 3x3, stride 1, dilation 1 and zero "same" padding."""
    kh, kw = weight.shape[-2:]
    return (img.device.type == 'cpu' and weight.shape[1] == 1
            and weight.shape[0] == img.shape[1] and kh % 2 == 1 and kw % 2 == 1
            and kh * kw > 9 and tuple(conv.padding) == (kh // 2, kw // 2)
            and conv.stride == (1, 1) and conv.dilation == (1, 1)
            and conv.padding_mode == 'zeros'
            and recorded_eagerly(img, weight))


def depthwise_conv(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for a (depth-wise) ``nn.Conv2d``; channels-last on CPU.

    Returns a tensor in the default (contiguous) memory format.
    """
    if x.device.type == 'cpu':
        y = conv(x.contiguous(memory_format=torch.channels_last))
        return y.contiguous()
    return conv(x)


def repeat_depthwise(conv: nn.Conv2d, repeat: int):
    """The weight ``(repeat * C, 1, k, k)`` and bias of a depth-wise ``conv`` of ``C``
    channels applied with the same weights to ``repeat`` consecutive channel groups (FLA's
    DWC shared by the heads)."""
    if conv.groups != conv.in_channels or conv.out_channels != conv.in_channels:
        raise ValueError('repeating a conv over channel groups needs a depth-wise conv')
    bias = None if conv.bias is None else conv.bias.repeat(repeat)
    return conv.weight.repeat(repeat, 1, 1, 1), bias


def token_conv(conv: nn.Conv2d, x: torch.Tensor, hw_shape: Tuple[int, int],
               repeat: int = 1) -> torch.Tensor:
    """Apply a size-preserving ``nn.Conv2d`` to tokens, as a channels-last map.

    Args:
        conv: the convolution (stride 1 and "same" padding, so the grid is kept).
        x: ``(B, N, C)`` tokens of the ``hw_shape`` map (``C = repeat * conv.in_channels``).
        hw_shape: ``(H, W)``.
        repeat: apply a depth-wise ``conv`` of ``C / repeat`` channels to each of
            ``repeat`` consecutive channel groups (heads) with the same weights; the
            result equals folding the heads into the batch (FLA's DWC shared by heads).

    Returns:
        ``(B, N, C_out)`` tokens (a view of the channels-last conv output).
    """
    img = tokens_as_map(x, hw_shape)
    weight, bias = (conv.weight, conv.bias) if repeat == 1 else repeat_depthwise(conv, repeat)
    if _fast_depthwise(img, weight, conv):
        # (cast as the conv would be under autocast, then run without it)
        img, weight, bias = autocast_operands(img, weight, bias)
        with torch.autocast(device_type='cpu', enabled=False):
            y = DepthwiseConvCPU.apply(img, weight, bias, tuple(conv.padding))
    elif repeat == 1:
        y = conv(img)
    else:
        y = F.conv2d(img, weight, bias, conv.stride, conv.padding, conv.dilation,
                     conv.groups * repeat)
    if y.shape[-2:] != img.shape[-2:]:
        raise ValueError(f'token_conv needs a size-preserving conv, {tuple(img.shape[-2:])} '
                         f'became {tuple(y.shape[-2:])}')
    return map_as_tokens(y)
