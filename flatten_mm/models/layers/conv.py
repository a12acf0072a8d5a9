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
"""
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.layout import map_as_tokens, tokens_as_map


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
    if repeat == 1:
        y = conv(img)
    else:
        weight, bias = repeat_depthwise(conv, repeat)
        y = F.conv2d(img, weight, bias, conv.stride, conv.padding, conv.dilation,
                     conv.groups * repeat)
    if y.shape[-2:] != img.shape[-2:]:
        raise ValueError(f'token_conv needs a size-preserving conv, {tuple(img.shape[-2:])} '
                         f'became {tuple(y.shape[-2:])}')
    return map_as_tokens(y)
