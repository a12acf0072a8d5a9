"""Shifted-window softmax attention with relative position bias (Swin W-MSA / SW-MSA),
the softmax ('S') stages of FLatten-Swin.

Paper: Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted
Windows", ICCV 2021, https://arxiv.org/abs/2103.14030. Upstream:
https://github.com/microsoft/Swin-Transformer (MIT licence), as kept unchanged inside
LeapLabTHU/FLatten-Transformer @ abdb115 (``models/flatten_swin.py``); dense handling as
in mmdet's Swin (zero padding to window multiples, cyclic shift with masks computed for
the actual size, crop). Independent re-implementation of ``shared/spec/attention.md``
§1.3.3 and ``backbones.md`` §1.3 / §5.3.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .window import (crop_padding, effective_shift, pad_to_multiple, shifted_window_mask,
                     window_partition, window_reverse)


def relative_position_index(window: int) -> torch.Tensor:
    """``(w*w, w*w)`` index into a ``((2w-1)^2, h)`` bias table: entry ``[i, j]`` is
    ``(dy + w - 1) * (2w - 1) + (dx + w - 1)`` for the offset ``(dy, dx)`` of token ``i``
    relative to token ``j`` (row-major tokens of one window)."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                        indexing='ij')).flatten(1)  # (2, n)
    rel = coords[:, :, None] - coords[:, None, :] + (window - 1)  # (2, n, n)
    return rel[0] * (2 * window - 1) + rel[1]


class ShiftedWindowAttention(nn.Module):
    """Multi-head softmax attention inside (shifted) ``w x w`` windows, any map size.

    The map is zero-padded at the bottom/right to multiples of ``w`` (padded tokens take
    part as keys, as in mmdet's Swin), cyclically shifted by ``w // 2`` when ``shift``
    (along each axis that holds more than one window, see ``window.effective_shift``),
    cut into windows; attention adds the learned relative position bias and, for shifted
    windows, the region mask. The result is shifted back and cropped.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h``; scale ``(C/h)^-0.5``.
        qkv_bias: bias of ``qkv``.
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after ``proj``.
        window_size: window side ``w``.
        shift: shifted windows (the odd blocks of a Swin stage).
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 window_size: int = 7,
                 shift: bool = False) -> None:
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f'window_size must be a positive int, got {window_size!r}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.window_size = window_size
        self.shift = shift
        self.attn_drop = attn_drop
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window_size - 1)**2, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=.02)
        # recomputed from window_size: not part of the state dict (converters drop it)
        self.register_buffer('relative_position_index', relative_position_index(window_size),
                             persistent=False)
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def resize_loaded_tables(self, state_dict: dict, prefix: str) -> list:
        """Resize, in ``state_dict``, a ``relative_position_bias_table`` of another window
        size (``((2w'-1)^2, h)``, e.g. 7 -> 12 for a 384 model) bicubically to this
        module's ``((2w-1)^2, h)``, as Swin's fine-tuning loaders do. Tables with other
        heads are left alone. Called before loading (``_load_from_state_dict``, and by
        ``flatten_mm.models.pretrained`` before its checks). Returns the
        ``(key, old shape, new shape)`` of each resized table."""
        key = prefix + 'relative_position_bias_table'
        table = state_dict.get(key)
        own = self.relative_position_bias_table
        if table is None or table.shape == own.shape or table.dim() != 2 \
                or table.shape[1] != own.shape[1]:
            return []
        side = math.isqrt(table.shape[0])
        if side * side != table.shape[0]:
            return []
        new = 2 * self.window_size - 1
        grid = table.t().reshape(1, -1, side, side).float()
        grid = F.interpolate(grid, size=(new, new), mode='bicubic', align_corners=False)
        state_dict[key] = grid.reshape(-1, new * new).t().to(table.dtype)
        return [(key, tuple(table.shape), tuple(state_dict[key].shape))]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.resize_loaded_tables(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def relative_position_bias(self) -> torch.Tensor:
        """``(h, w*w, w*w)`` bias added to the attention logits of every window."""
        n = self.window_size**2
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]
        return bias.reshape(n, n, self.num_heads).permute(2, 0, 1)

    def window_attention(self, windows: torch.Tensor, mask) -> torch.Tensor:
        """Attention inside windows.

        Args:
            windows: ``(B * nW, n, C)`` tokens of the windows (``n = w*w``).
            mask: ``None`` or the ``(nW, n, n)`` additive shifted-window mask.

        Returns:
            ``(B * nW, n, C)`` after ``proj``.
        """
        Bw, n, C = windows.shape
        h = self.num_heads
        q, k, v = self.qkv(windows).reshape(Bw, n, 3, h, C // h).permute(2, 0, 3, 1, 4)
        bias = self.attention_bias(mask, q.dtype)  # (h, n, n) or (nW, h, n, n)
        if bias.dim() == 4:
            nW = bias.shape[0]
            q, k, v = (t.reshape(Bw // nW, nW, h, n, C // h) for t in (q, k, v))
        if self.training and self.attn_drop > 0:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                 dropout_p=self.attn_drop)
        else:
            # explicit softmax(q k^T * scale + bias) v: with an additive float mask,
            # SDPA's CPU path runs the same matmuls plus fully-masked-row checks
            attn = (q * (C // h)**-0.5) @ k.transpose(-2, -1)
            attn = torch.softmax(attn + bias, dim=-1)
            out = attn @ v
        out = out.reshape(Bw, h, n, C // h).transpose(1, 2).reshape(Bw, n, C)
        return self.proj_drop(self.proj(out))

    def attention_bias(self, mask: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Relative position bias ``(h, n, n)``, plus the shifted-window ``mask``
        ``(nW, n, n)`` as ``(nW, h, n, n)``, in ``dtype``.

        Computed from the table in every call, never cached, so it always follows the
        current weights (see the ``pos_embed`` module docstring)."""
        bias = self.relative_position_bias()
        if mask is not None:
            bias = bias.unsqueeze(0) + mask.unsqueeze(1)
        return bias.to(dtype)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        B, N, C = x.shape
        H, W = hw_shape
        if N != H * W:
            raise ValueError(f'token count {N} does not match hw_shape {hw_shape}')
        w = (self.window_size, self.window_size)
        x, pads = pad_to_multiple(x.reshape(B, H, W, C), w)
        padded = (x.shape[1], x.shape[2])
        shift = effective_shift(padded, w, (self.window_size // 2, ) * 2 if self.shift else (0, 0))
        if any(shift):
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        mask = shifted_window_mask(padded, w, shift, x.device)
        out = self.window_attention(window_partition(x, w), mask)
        x = window_reverse(out, w, padded)
        if any(shift):
            x = torch.roll(x, shifts=shift, dims=(1, 2))
        return crop_padding(x, pads).reshape(B, N, C)

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'window_size={self.window_size}, shift={self.shift}')
