"""Token <-> feature-map conversions.

Tokens are ``(B, N, C)`` with ``N = H * W`` in row-major order (index ``y * W + x``);
maps are ``(B, C, H, W)``.
"""
from typing import Tuple

import torch


def nlc_to_nchw(x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
    """Reshape tokens ``(B, N, C)`` to a map ``(B, C, H, W)``."""
    H, W = hw_shape
    B, N, C = x.shape
    if N != H * W:
        raise ValueError(f'token count {N} does not match hw_shape {hw_shape}')
    return x.transpose(1, 2).reshape(B, C, H, W)


def nchw_to_nlc(x: torch.Tensor) -> torch.Tensor:
    """Flatten a map ``(B, C, H, W)`` to tokens ``(B, H * W, C)``."""
    return x.flatten(2).transpose(1, 2)
