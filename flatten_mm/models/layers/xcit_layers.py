"""Building blocks of the XCiT layout (used by SimA): conv patch embedding, Fourier
positional encoding, local patch interaction.

Paper: El-Nouby et al., "XCiT: Cross-Covariance Image Transformers", NeurIPS 2021,
https://arxiv.org/abs/2106.09681. Upstream: https://github.com/facebookresearch/xcit
@ 82f5291 (Apache-2.0) and its fork https://github.com/UCDvision/sima @ 3ec3b8e (MIT);
independent re-implementation of ``shared/spec/attention.md`` §2.3-2.4 and
``backbones.md`` §2. Parameter names follow upstream (``proj.{2i}.{0,1}``,
``token_projection``, ``conv1``/``bn``/``conv2``) so official SimA/XCiT checkpoints load
by key.

The batch norms are created by a ``norm_layer`` factory (``channels -> nn.Module``;
default ``nn.BatchNorm2d``) instead of the hard-coded ``SyncBatchNorm`` of upstream, so
the layers run on CPU and a single GPU; the backbone maps its ``norm_cfg`` to the
factory.
"""
import math
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..ops.autograd_paths import (differentiate_reference, recorded_eagerly,
                                  records_backward_graph)
from .conv import map_as_tokens, tokens_as_map
from .shape import nchw_to_nlc

NormFactory = Callable[[int], nn.Module]


class ConvPatchEmbed(nn.Module):
    """XCiT convolutional patch embedding: stride-2 ``3x3`` convs with norm, GELU between.

    ``patch_size=16``: 4 convs of widths ``C/8, C/4, C/2, C``; ``patch_size=8``: 3 convs
    of widths ``C/4, C/2, C``. Each conv has padding 1 and no bias and is followed by
    ``norm_layer``; a GELU sits between consecutive conv+norm pairs (not after the last).
    Every conv maps a size ``s`` to ``ceil(s / 2)``, so the token grid is
    ``(ceil(H / p), ceil(W / p))``.

    Args:
        in_channels: image channels.
        embed_dims: output channels ``C``.
        patch_size: 16 or 8.
        norm_layer: factory of the norm after every conv.
    """

    def __init__(self, in_channels: int = 3, embed_dims: int = 384, patch_size: int = 16,
                 norm_layer: NormFactory = nn.BatchNorm2d) -> None:
        super().__init__()
        if patch_size not in (8, 16):
            raise ValueError(f'ConvPatchEmbed supports patch_size 16 or 8, got {patch_size}')
        num_convs = int(math.log2(patch_size))
        if embed_dims % 2**(num_convs - 1) != 0:
            raise ValueError(f'embed_dims {embed_dims} must be divisible by '
                             f'{2**(num_convs - 1)} for patch_size {patch_size}')
        self.patch_size = patch_size
        self.in_channels = in_channels
        widths = [embed_dims // 2**(num_convs - 1 - i) for i in range(num_convs)]
        layers = []
        prev = in_channels
        for i, width in enumerate(widths):
            if i > 0:
                layers.append(nn.GELU())
            layers.append(
                nn.Sequential(
                    nn.Conv2d(prev, width, kernel_size=3, stride=2, padding=1, bias=False),
                    norm_layer(width)))
            prev = width
        # upstream key layout: proj.{0,2,4,6}.0 (conv) / .1 (norm); odd indices are GELU
        self.proj = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Args: x ``(B, C_in, H, W)``. Returns tokens ``(B, Hp*Wp, C)`` and ``(Hp, Wp)``."""
        x = self.proj(x)
        return nchw_to_nlc(x), (x.shape[2], x.shape[3])


class FourierPositionalEncoding(nn.Module):
    """XCiT's resolution-free sine/cosine positional encoding, projected to ``C``.

    For the grid ``(H, W)``: ``y = (1..H) / (H + 1e-6) * 2pi`` (``x`` likewise),
    frequencies ``t_i = temperature ** (2 * floor(i / 2) / hidden_dim)`` for
    ``i < hidden_dim``; channel ``i`` is ``sin(y / t_i)`` for even and ``cos(y / t_i)``
    for odd ``i``; ``[pos_y, pos_x]`` (``2 * hidden_dim`` channels) go through a ``1x1``
    conv (``token_projection``). The Fourier features are always computed in float32
    (as upstream) and cast to the dtype of ``token_projection``.

    Args:
        hidden_dim: Fourier channels per axis.
        dim: output channels ``C``.
        temperature: base of the frequencies.
    """

    def __init__(self, hidden_dim: int = 32, dim: int = 768,
                 temperature: float = 10000.) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.dim = dim
        self.temperature = temperature
        self.scale = 2 * math.pi
        self.token_projection = nn.Conv2d(hidden_dim * 2, dim, kernel_size=1)

    def fourier_features(self, hw_shape: Tuple[int, int],
                         device: torch.device = None) -> torch.Tensor:
        """The float32 sin/cos features ``(1, 2 * hidden_dim, H, W)`` of the grid."""
        H, W = hw_shape
        eps = 1e-6
        y = torch.arange(1, H + 1, dtype=torch.float32, device=device)
        x = torch.arange(1, W + 1, dtype=torch.float32, device=device)
        y = y / (y[-1:] + eps) * self.scale
        x = x / (x[-1:] + eps) * self.scale
        dim_t = torch.arange(self.hidden_dim, dtype=torch.float32, device=device)
        dim_t = self.temperature**(2 * torch.div(dim_t, 2, rounding_mode='floor') / self.hidden_dim)

        def encode(pos: torch.Tensor) -> torch.Tensor:  # (L,) -> (L, hidden_dim)
            pos = pos[:, None] / dim_t
            return torch.stack((pos[:, 0::2].sin(), pos[:, 1::2].cos()), dim=2).flatten(1)

        pos_y = encode(y)[:, None, :].expand(H, W, self.hidden_dim)
        pos_x = encode(x)[None, :, :].expand(H, W, self.hidden_dim)
        return torch.cat((pos_y, pos_x), dim=2).permute(2, 0, 1).unsqueeze(0)

    def forward(self, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: hw_shape ``(H, W)`` of the token grid. Returns ``(1, H*W, C)`` tokens
        (broadcast over the batch)."""
        weight = self.token_projection.weight
        feats = self.fourier_features(hw_shape, weight.device).to(weight.dtype)
        return nchw_to_nlc(self.token_projection(feats))

    def extra_repr(self) -> str:
        return f'hidden_dim={self.hidden_dim}, dim={self.dim}, temperature={self.temperature}'


class _GELUBatchNorm(torch.autograd.Function):
    """``bn(gelu(z))`` of a batch norm in training mode whose backward recomputes
    ``gelu(z)`` and the batch statistics instead of keeping the GELU output: only ``z`` is
    kept, which the GELU's own gradient needs anyway. The forward calls the module itself
    (its running statistics are updated as usual); the backward runs the ops autograd would
    run (``native_batch_norm_backward`` in training mode, ``gelu_backward``), so the
    gradients are the plain modules'."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], bn: nn.Module, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(z, weight, bias)
        ctx.eps, ctx.approximate = bn.eps, approximate
        return bn(F.gelu(z, approximate=approximate))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, weight, bias = ctx.saved_tensors
        if records_backward_graph():  # (create_graph: the plain ops, differentiable)
            def reference(z, weight, bias):
                return F.batch_norm(F.gelu(z, approximate=ctx.approximate), None, None,
                                    weight, bias, True, 0.0, ctx.eps)
            return (*differentiate_reference(reference, (z, weight, bias),
                                             ctx.needs_input_grad[:3], (grad, )), None, None)
        a = F.gelu(z, approximate=ctx.approximate)  # recomputed
        # the batch statistics by the kernel that computed them in the forward (the same
        # values; its normalised output is dropped)
        _, mean, invstd = torch.ops.aten.native_batch_norm(a, None, None, None, None, True,
                                                           0.0, ctx.eps)
        needs = ctx.needs_input_grad
        da, dw, db = torch.ops.aten.native_batch_norm_backward(
            grad, a, weight, None, None, mean, invstd, True, ctx.eps,
            [True, weight is not None and needs[1], needs[2]])
        dz = torch.ops.aten.gelu_backward(da, z, approximate=ctx.approximate)
        return dz, dw, db, None, None


class LPI(nn.Module):
    """XCiT local patch interaction on the token image.

    ``depthwise conv k x k (bias) -> GELU -> norm -> depthwise conv k x k (bias)``.

    Args:
        embed_dims: channels ``C``.
        kernel_size: odd kernel size (upstream: 3).
        norm_layer: factory of the norm between the convs.
        recompute_act: when autograd records a training step with a batch norm that
            normalises with the local batch (``BatchNorm2d``, mmengine's reverted SyncBN;
            ``SyncBatchNorm`` outside a process group), outside autocast, the GELU output
            is recomputed in the backward instead of kept (``_GELUBatchNorm``): the same
            outputs and gradients, one of the LPI's four kept maps less. ``False``: plain
            modules.
    """

    def __init__(self, embed_dims: int, kernel_size: int = 3,
                 norm_layer: NormFactory = nn.BatchNorm2d, recompute_act: bool = True) -> None:
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f'LPI kernel_size must be odd, got {kernel_size}')
        padding = kernel_size // 2
        self.conv1 = nn.Conv2d(embed_dims, embed_dims, kernel_size, padding=padding,
                               groups=embed_dims)
        self.act = nn.GELU()
        self.bn = norm_layer(embed_dims)
        self.conv2 = nn.Conv2d(embed_dims, embed_dims, kernel_size, padding=padding,
                               groups=embed_dims)
        self.recompute_act = bool(recompute_act)

    def _recomputes_act(self, z: torch.Tensor) -> bool:
        """Whether ``_GELUBatchNorm`` runs (see ``recompute_act``); a synchronising batch
        norm, eval mode, autocast, an empty batch, a swapped activation or norm keep the
        plain modules."""
        bn = self.bn
        # (a _BatchNorm with the base forward: BatchNorm2d, mmengine's reverted SyncBN)
        local_bn = isinstance(bn, _BatchNorm) and (
            type(bn).forward is _BatchNorm.forward
            or (type(bn).forward is nn.SyncBatchNorm.forward
                and not (dist.is_available() and dist.is_initialized())))
        return (self.recompute_act and type(self.act) is nn.GELU and local_bn
                and bn.training and z.numel() > 0 and not torch.is_autocast_enabled(z.device.type)
                and recorded_eagerly(z, *bn.parameters()))

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape`` grid. Returns ``(B, N, C)``."""
        # tokens viewed as a channels-last map: no transposed copies
        z = self.conv1(tokens_as_map(x, hw_shape))
        if self._recomputes_act(z):
            y = _GELUBatchNorm.apply(z, self.bn.weight, self.bn.bias, self.bn,
                                     self.act.approximate)
        else:
            y = self.bn(self.act(z))
        return map_as_tokens(self.conv2(y))
