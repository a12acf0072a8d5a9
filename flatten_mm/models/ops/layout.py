"""Token <-> map views shared by the operators and their fast paths.

Tokens ``(B, N, C)`` of an ``(H, W)`` map already *are* that map in channels-last memory
order, so these are views, not copies (see ``layers/conv.py``).
"""
from typing import Tuple

import torch


def tokens_as_map(x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
    """View tokens ``(B, N, C)`` as a ``(B, C, H, W)`` map in channels-last order (no copy
    for contiguous tokens)."""
    B, N, C = x.shape
    H, W = hw_shape
    if N != H * W:
        raise ValueError(f'token count {N} does not match hw_shape {tuple(hw_shape)}')
    return x.reshape(B, H, W, C).permute(0, 3, 1, 2)


def map_as_tokens(x: torch.Tensor) -> torch.Tensor:
    """View a ``(B, C, H, W)`` map as tokens ``(B, H*W, C)`` (no copy for a
    channels-last map)."""
    B, C, H, W = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, H * W, C)
