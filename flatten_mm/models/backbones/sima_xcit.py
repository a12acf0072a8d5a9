"""SimA-XCiT: the SimA backbone in XCiT's dense (4-scale) layout.

SimA (https://arxiv.org/abs/2206.08898, UCDvision/sima @ 3ec3b8e) is XCiT
(https://arxiv.org/abs/2106.09681) with its cross-covariance attention replaced by
softmax-free SimA attention. The classification trunk is isotropic (one token grid at
stride ``patch_size``); the dense wrapper follows XCiT's official detection /
segmentation backbone (facebookresearch/xcit @ 82f5291, ``shared/spec/backbones.md``
§2.1): token maps after 4 chosen blocks are rescaled to strides 4/8/16/32 by
``fpn1..fpn4`` (transposed convs / identity / max-pooling). The class token,
class-attention blocks, final norm and head of the classifier are not part of it.
"""
import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from mmengine.model import BaseModule
from timm.layers import DropPath

from ...registry import MODELS
from ..layers import (LPI, ConvPatchEmbed, FourierPositionalEncoding, PVTMlp, build_attention,
                      nlc_to_nchw)
from .base import (check_frozen_stages, check_input, freeze, init_weights_or_load, resolve_arch,
                   set_use_triton)

SIMA = dict(type='SimAAttention')

#: ``norm_cfg['type']`` -> norm class (plain torch, so no mmcv is needed)
NORM_LAYERS: Dict[str, type] = {
    'BN': nn.BatchNorm2d,
    'BN2d': nn.BatchNorm2d,
    'SyncBN': nn.SyncBatchNorm,
}


def build_norm_factory(norm_cfg: dict) -> Callable[[int], nn.Module]:
    """Turn ``dict(type='BN'|'SyncBN', requires_grad=True, **kwargs)`` into a factory
    ``channels -> norm module`` (extra keys such as ``eps``/``momentum`` are passed on).

    ``'SyncBN'`` builds ``torch.nn.SyncBatchNorm`` (as mmcv's ``build_norm_layer`` does):
    it synchronises statistics across the processes of a CUDA DDP job and, when no
    process group is initialised (a plain single-process module), normalises with the
    local batch statistics like ``BatchNorm2d``. mmengine's runner reverts it to BN in
    non-distributed runs (``revert_sync_batchnorm``)."""
    cfg = dict(norm_cfg)
    if 'type' not in cfg:
        raise ValueError(f'norm_cfg needs a "type": {norm_cfg}')
    norm_type = cfg.pop('type')
    if norm_type not in NORM_LAYERS:
        raise ValueError(f'norm_cfg type {norm_type!r} is not supported; '
                         f'valid types: {sorted(NORM_LAYERS)}')
    requires_grad = cfg.pop('requires_grad', True)
    cls = NORM_LAYERS[norm_type]

    def make(channels: int) -> nn.Module:
        layer = cls(channels, **cfg)
        for p in layer.parameters():
            p.requires_grad = requires_grad
        return layer

    return make


class XCiTBlock(nn.Module):
    """XCiT token block (SimA variant by default), three pre-norm residual branches:

    ``x += g1 * attn(LN1(x)); x += g3 * LPI(LN3(x)); x += g2 * MLP(LN2(x))``, each
    with DropPath; ``g1, g2, g3`` are LayerScale vectors ``(C,)``.

    Args:
        embed_dims: channels ``C``.
        num_heads: attention heads.
        mlp_ratio: hidden/``C`` ratio of the MLP.
        attn_cfg: attention operator config (see ``build_attention``).
        qkv_bias: bias of the q/k/v projection.
        drop_rate: dropout after projections and in the MLP.
        attn_drop_rate: attention-map dropout (operators that have one).
        drop_path: stochastic-depth rate.
        layer_scale_init_value: initial value of ``gamma1..3`` (upstream ``eta``).
        norm_layer: factory of the LPI batch norm.
        recompute_mlp_act: the MLP's and the LPI's GELU outputs recomputed in the
            backward instead of kept (``PVTMlp`` / ``LPI`` ``recompute_act``).
    """

    def __init__(self, embed_dims: int, num_heads: int, mlp_ratio: float = 4.,
                 attn_cfg: dict = SIMA, qkv_bias: bool = True, drop_rate: float = 0.,
                 attn_drop_rate: float = 0., drop_path: float = 0.,
                 layer_scale_init_value: float = 1.0,
                 norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d,
                 recompute_mlp_act: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.attn = build_attention(attn_cfg, embed_dims=embed_dims, num_heads=num_heads,
                                    qkv_bias=qkv_bias, attn_drop=attn_drop_rate,
                                    proj_drop=drop_rate)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm3 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.local_mp = LPI(embed_dims, norm_layer=norm_layer, recompute_act=recompute_mlp_act)
        self.norm2 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.mlp = PVTMlp(embed_dims, int(embed_dims * mlp_ratio), drop=drop_rate, dwconv=False,
                          recompute_act=recompute_mlp_act)
        self.gamma1 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))
        self.gamma3 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))
        self.gamma2 = nn.Parameter(layer_scale_init_value * torch.ones(embed_dims))

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape`` grid. Returns ``(B, N, C)``."""
        if self.training and not isinstance(self.drop_path, nn.Identity):
            x = x + self.drop_path(self.gamma1 * self.attn(self.norm1(x), hw_shape))
            x = x + self.drop_path(self.gamma3 * self.local_mp(self.norm3(x), hw_shape))
            return x + self.drop_path(self.gamma2 * self.mlp(self.norm2(x), hw_shape))
        # no stochastic depth: LayerScale and residual in one pass (x + gamma * y)
        x = torch.addcmul(x, self.gamma1, self.attn(self.norm1(x), hw_shape))
        x = torch.addcmul(x, self.gamma3, self.local_mp(self.norm3(x), hw_shape))
        return torch.addcmul(x, self.gamma2, self.mlp(self.norm2(x), hw_shape))


def default_block_indices(depth: int) -> Tuple[int, ...]:
    """XCiT's choice of the blocks feeding ``fpn1..fpn4``: after blocks ``depth/3,
    depth/2, 2*depth/3, depth`` (1-based, rounded): ``(3, 5, 7, 11)`` for 12 and
    ``(7, 11, 15, 23)`` for 24 blocks (XCiT's own ``out_indices``)."""
    return tuple(max(0, round(depth * f) - 1) for f in (1 / 3, 1 / 2, 2 / 3, 1.))


@MODELS.register_module()
class SimAXCiT(BaseModule):
    """SimA-XCiT dense backbone: up to 4 maps of ``C`` channels at strides 4, 8, 16, 32.

    Pipeline: ``ConvPatchEmbed`` (any ``H x W``; grid ``ceil(H / patch_size)``, no
    padding needed) -> + Fourier positional encoding of the actual grid -> blocks
    (SimA attention, LPI, MLP) -> the token map after block ``block_indices[k]`` goes
    through ``fpn{k+1}`` and gives map ``k`` (stride ``4 * 2**k``); ``out_indices``
    selects the maps returned, like ``out_indices`` of every other backbone:

    * ``patch_size=16`` (tokens at stride 16): ``fpn1`` = deconv 2x2 - norm - GELU -
      deconv 2x2 (stride 4), ``fpn2`` = deconv 2x2 (8), ``fpn3`` = identity (16),
      ``fpn4`` = max-pool 2 (32);
    * ``patch_size=8`` (tokens at stride 8): ``fpn1`` = deconv 2x2 (4), ``fpn2`` =
      identity (8), ``fpn3`` = max-pool 2 (16), ``fpn4`` = max-pool 4 (32).

    Max-pooling uses ``ceil_mode`` and up-sampled maps are cropped, so map ``k`` is
    ``(B, C, ceil(H / s_k), ceil(W / s_k))`` for any input ``H x W`` (identical to
    XCiT's wrapper when ``H, W`` are multiples of 32, as mmdet/mmseg pad them).

    Only what the selected maps need is built and run: ``fpn{k+1}`` exists only for
    ``k`` in ``out_indices``, and the blocks after the deepest block feeding a selected
    map are never run. Those blocks are still built (so converted classification
    checkpoints and checkpoints of the 4-map model load with the checked ``Pretrained``
    loader unchanged) but frozen: ``requires_grad=False`` and eval mode, so nothing
    without a gradient is left for DDP (no ``find_unused_parameters`` needed) and the
    optimizer never updates them.

    ``arch`` (name or dict with keys ``embed_dims, depth, num_heads``; the patch size is
    the separate ``patch_size`` argument or a name suffix such as ``'s12-p8'``):

    ===================  ==========  =====  =========  ========  ===========
    arch (aliases)       embed_dims  depth  num_heads  head dim  LayerScale
    ===================  ==========  =====  =========  ========  ===========
    n12, nano_12         128         12     4          32        1.0
    t12, tiny_12         192         12     4          48        1.0
    s12, small_12        384         12     8          48        1.0
    t24, tiny_24         192         24     4          48        1e-5
    s24, small_24        384         24     8          48        1e-5
    m24, medium_24       512         24     8          64        1e-5
    l24, large_24        768         24     16         48        1e-5
    ===================  ==========  =====  =========  ========  ===========

    Args:
        arch: variant name or custom dict.
        patch_size: 16 or 8 (stride of the token grid). The arch name may carry it
            instead (``'s12-p8'``, ``'small_12_p8'``); default 16.
        in_channels: image channels.
        attn_cfg: attention config of every block; a dict without ``type`` updates the
            default ``dict(type='SimAAttention')`` (e.g. ``dict(order='kv_first')``).
        mlp_ratio: hidden/``C`` ratio of the MLPs.
        qkv_bias: bias of the q/k/v projections.
        drop_rate: dropout after the positional encoding, projections and MLPs.
        attn_drop_rate: attention-map dropout (must be 0 for SimA).
        drop_path_rate: stochastic depth, the SAME rate in every block (as upstream
            SimA/XCiT, not linearly increasing).
        layer_scale_init_value: initial LayerScale (upstream ``eta``); ``None`` picks
            1.0 for up to 12 blocks and 1e-5 for deeper models (upstream choice).
        use_pos_embed: add the Fourier positional encoding (upstream ``use_pos``).
        out_indices: the maps to return, increasing entries in ``0..3`` (negative
            counts from the end): map ``k`` comes from ``fpn{k+1}`` at stride
            ``4 * 2**k``; ``out_channels`` / ``out_strides`` follow. Default all four.
            Entries above 3 raise ``ValueError``: XCiT's block indices (its
            ``out_indices``, e.g. ``(3, 5, 7, 11)``) are ``block_indices`` here.
        block_indices: the 4 blocks (0-based, non-decreasing; negative counts from the
            end) whose outputs feed ``fpn1..fpn4`` (XCiT's ``out_indices``); ``None``:
            ``(3, 5, 7, 11)`` for 12, ``(7, 11, 15, 23)`` for 24 blocks (see
            ``default_block_indices``). Entries of maps not in ``out_indices`` are
            unused.
        frozen_stages: ``-1`` freezes nothing; ``0`` freezes the patch embedding and
            the positional encoding; ``k >= 1`` additionally freezes blocks
            ``0..k-1`` (parameters without gradient, norms in eval mode). The
            ``fpn`` adapters are never frozen.
        norm_cfg: batch norm of the patch embedding, LPI and ``fpn1``; ``'SyncBN'``
            (``torch.nn.SyncBatchNorm``) or ``'BN'``; keys ``eps``, ``momentum``,
            ``requires_grad`` are honoured. Default ``dict(type='SyncBN',
            requires_grad=True)`` as XCiT / SimA upstream. SyncBN needs no GPU outside
            a multi-process job: a bare module (no process group) normalises with the
            local batch like BN, mmengine's runner reverts SyncBN to BN in
            non-distributed runs, and ``tools/train.py`` replaces it by per-process BN
            under ``torchrun`` on CPU (gloo), where torch's SyncBatchNorm cannot run.
            ``dict(type='BN')`` gives per-GPU statistics.
        norm_eval: keep all batch norms in eval mode (frozen statistics) in training.
        with_cp: gradient checkpointing of every block (same outputs, less memory;
            batch-norm running statistics are updated again in the recomputation).
        recompute_mlp_act: when training, each MLP's GELU output (and, with a batch norm
            of the local batch, each LPI's) is recomputed in the backward instead of kept
            (``PVTMlp``, ``LPI``): the same outputs and gradients, a third
            less MLP activation memory for one elementwise pass per block in the backward;
            ``False`` keeps it, as timm / mmdet do.
        init_cfg: e.g. ``dict(type='Pretrained', checkpoint='converted.pth')`` with a
            checkpoint produced by ``tools/convert_checkpoint.py`` (the ``fpn``
            parameters are new and keep their random initialisation).
    """

    arch_keys = ('embed_dims', 'depth', 'num_heads')
    arch_zoo = {
        **dict.fromkeys(['n12', 'nano_12'], dict(embed_dims=128, depth=12, num_heads=4)),
        **dict.fromkeys(['t12', 'tiny_12'], dict(embed_dims=192, depth=12, num_heads=4)),
        **dict.fromkeys(['s12', 'small_12'], dict(embed_dims=384, depth=12, num_heads=8)),
        **dict.fromkeys(['t24', 'tiny_24'], dict(embed_dims=192, depth=24, num_heads=4)),
        **dict.fromkeys(['s24', 'small_24'], dict(embed_dims=384, depth=24, num_heads=8)),
        **dict.fromkeys(['m24', 'medium_24'], dict(embed_dims=512, depth=24, num_heads=8)),
        **dict.fromkeys(['l24', 'large_24'], dict(embed_dims=768, depth=24, num_heads=16)),
    }
    default_attn_cfg = SIMA
    #: ``norm_cfg`` when none is given: XCiT / SimA train with synchronised batch norm
    default_norm_cfg = dict(type='SyncBN', requires_grad=True)
    #: stride of map ``k`` (output of ``fpn{k+1}``)
    map_strides = (4, 8, 16, 32)
    #: parameters that the classification checkpoints do not have
    dense_only_prefixes = ('fpn1.', 'fpn2.', 'fpn3.', 'fpn4.')

    def __init__(self,
                 arch: Union[str, dict] = 's12',
                 patch_size: Optional[int] = None,
                 in_channels: int = 3,
                 attn_cfg: Optional[dict] = None,
                 mlp_ratio: float = 4.,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.,
                 attn_drop_rate: float = 0.,
                 drop_path_rate: float = 0.,
                 layer_scale_init_value: Optional[float] = None,
                 use_pos_embed: bool = True,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 block_indices: Optional[Sequence[int]] = None,
                 frozen_stages: int = -1,
                 norm_cfg: Optional[dict] = None,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 recompute_mlp_act: bool = True,
                 use_triton: Optional[bool] = None,
                 init_cfg: Optional[Union[dict, List[dict]]] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        name = type(self).__name__
        arch, patch_size = self._split_patch_suffix(arch, patch_size)
        self.arch_settings = resolve_arch(arch, self.arch_zoo, self.arch_keys, name)
        self.embed_dims = int(self.arch_settings['embed_dims'])
        self.depth = int(self.arch_settings['depth'])
        self.num_heads = int(self.arch_settings['num_heads'])
        if self.depth < 1:
            raise ValueError(f'{name}: depth must be >= 1, got {self.depth}')
        if self.embed_dims % self.num_heads != 0:
            raise ValueError(f'{name}: embed_dims {self.embed_dims} is not divisible by '
                             f'num_heads {self.num_heads}')
        if patch_size not in (8, 16):
            raise ValueError(f'{name}: patch_size must be 16 or 8, got {patch_size}')
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_indices = self._check_out_indices(out_indices)
        self.block_indices = self._check_block_indices(block_indices)
        #: deepest block that a returned map needs; later blocks are frozen, never run
        self.last_block = max(self.block_indices[k] for k in self.out_indices)
        # "stage" 0 = patch embedding + positional encoding, stage k = block k-1
        self.frozen_stages = check_frozen_stages(frozen_stages, self.depth + 1, name)
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.drop_path_rate = drop_path_rate
        if layer_scale_init_value is None:
            layer_scale_init_value = 1.0 if self.depth <= 12 else 1e-5
        self.layer_scale_init_value = layer_scale_init_value
        self.attn_cfg = dict(self.default_attn_cfg)
        if attn_cfg is not None:
            self.attn_cfg = dict(attn_cfg) if 'type' in attn_cfg else {**self.attn_cfg,
                                                                        **attn_cfg}
        self.norm_cfg = dict(norm_cfg if norm_cfg is not None else self.default_norm_cfg)
        norm_layer = build_norm_factory(self.norm_cfg)

        C = self.embed_dims
        self.patch_embed = ConvPatchEmbed(in_channels, C, patch_size, norm_layer=norm_layer)
        self.pos_embeder = FourierPositionalEncoding(32, C) if use_pos_embed else None
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.ModuleList([
            XCiTBlock(C, self.num_heads, mlp_ratio, self.attn_cfg, qkv_bias=qkv_bias,
                      drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                      drop_path=drop_path_rate, layer_scale_init_value=layer_scale_init_value,
                      norm_layer=norm_layer, recompute_mlp_act=recompute_mlp_act)
            for _ in range(self.depth)
        ])
        # XCiT's dense adapters (upstream names, so XCiT-dense checkpoints load by key),
        # only those of the returned maps
        for k in self.out_indices:
            self.add_module(f'fpn{k + 1}', self._build_fpn(k, C, norm_layer))
        self._freeze_stages()
        set_use_triton(self, use_triton)

    def _build_fpn(self, k: int, C: int, norm_layer: Callable[[int], nn.Module]) -> nn.Module:
        """XCiT's adapter ``fpn{k+1}``: token grid (stride ``patch_size``) -> stride
        ``4 * 2**k``."""
        up = lambda: nn.ConvTranspose2d(C, C, kernel_size=2, stride=2)  # noqa: E731
        ratio = self.map_strides[k] / self.patch_size
        if ratio == 0.25:  # patch 16 -> stride 4
            return nn.Sequential(up(), norm_layer(C), nn.GELU(), up())
        if ratio == 0.5:
            return nn.Sequential(up())
        if ratio == 1:
            return nn.Identity()
        return nn.MaxPool2d(kernel_size=int(ratio), stride=int(ratio), ceil_mode=True)

    # ------------------------------------------------------------------ contract
    @property
    def out_channels(self) -> Tuple[int, ...]:
        """Channels of each returned map (all ``embed_dims``)."""
        return (self.embed_dims, ) * len(self.out_indices)

    @property
    def out_strides(self) -> Tuple[int, ...]:
        """Stride (w.r.t. the input) of each returned map: ``4 * 2**k`` for ``k`` in
        ``out_indices``."""
        return tuple(self.map_strides[k] for k in self.out_indices)

    def min_input_size(self) -> Tuple[int, int]:
        """Smallest input ``(H, W)`` accepted: ``(1, 1)``, any size is padded."""
        return 1, 1

    # ------------------------------------------------------------------ build helpers
    @classmethod
    def _split_patch_suffix(cls, arch: Union[str, dict],
                            patch_size: Optional[int]) -> Tuple[Union[str, dict], int]:
        """``'s12-p8'`` / ``'small_12_p8'`` -> ``('s12', 8)``; checks it against
        ``patch_size``; the default patch size is 16."""
        suffix = None
        if isinstance(arch, str):
            m = re.fullmatch(r'(.+?)[-_]p(\d+)', arch.lower())
            if m is not None:
                arch, suffix = m.group(1), int(m.group(2))
        if suffix is not None and patch_size is not None and suffix != patch_size:
            raise ValueError(f'{cls.__name__}: arch suffix p{suffix} contradicts '
                             f'patch_size={patch_size}')
        return arch, suffix or patch_size or 16

    def _check_out_indices(self, out_indices: Union[int, Sequence[int]]) -> Tuple[int, ...]:
        """Map indices: increasing, in ``0..3`` (negative from the end). Entries above 3
        are XCiT-style block indices and get an error pointing at ``block_indices``."""
        name = type(self).__name__
        if isinstance(out_indices, int):
            out_indices = (out_indices, )
        given = tuple(out_indices)
        if any(i > 3 for i in given):
            hint = (f'block_indices={given}, out_indices=(0, 1, 2, 3)' if len(given) == 4
                    else 'block_indices=(4 block indices, one per fpn1..fpn4)')
            raise ValueError(
                f'{name}: out_indices {given} has entries out of range for the 4 output maps '
                '(valid 0..3 = fpn1..fpn4 at strides 4, 8, 16, 32; out_indices select maps as '
                'in every other backbone). XCiT block indices (XCiT\'s out_indices, e.g. '
                f'(3, 5, 7, 11)) are set by block_indices here: use {hint}')
        result = tuple(int(i + 4 if i < 0 else i) for i in given)
        if not result or any(not 0 <= i <= 3 for i in result) or \
                any(b <= a for a, b in zip(result, result[1:])):
            raise ValueError(f'{name}: out_indices {given} must be increasing map indices in '
                             '0..3 (fpn1..fpn4 at strides 4, 8, 16, 32; negative counts from '
                             'the end); block indices go to block_indices')
        return result

    def _check_block_indices(self, block_indices: Optional[Sequence[int]]) -> Tuple[int, ...]:
        name = type(self).__name__
        if block_indices is None:
            return default_block_indices(self.depth)
        if isinstance(block_indices, int) or len(block_indices) != 4:
            raise ValueError(f'{name}: block_indices must list 4 block indices (one per '
                             f'fpn1..fpn4), got {block_indices!r}')
        result = []
        for i in block_indices:
            j = i + self.depth if i < 0 else i
            if not 0 <= j < self.depth:
                raise ValueError(f'{name}: block_indices entry {i} is out of range for '
                                 f'{self.depth} blocks (valid 0..{self.depth - 1})')
            result.append(int(j))
        if any(b < a for a, b in zip(result, result[1:])):
            raise ValueError(f'{name}: block_indices {tuple(block_indices)} must be '
                             'non-decreasing (deeper blocks feed the coarser maps)')
        return tuple(result)

    def init_weights(self) -> None:
        """XCiT initialisation, or the ``Pretrained`` checkpoint of ``init_cfg``."""
        init_weights_or_load(self, self.init_cfg)

    def _freeze_stages(self) -> None:
        if self.frozen_stages >= 0:
            freeze(self.patch_embed)
            if self.pos_embeder is not None:
                freeze(self.pos_embeder)
        for i in range(self.frozen_stages):
            freeze(self.blocks[i])
        for block in self.blocks[self.last_block + 1:]:  # never run: no gradient
            freeze(block)

    def train(self, mode: bool = True) -> 'SimAXCiT':
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self

    # ------------------------------------------------------------------ forward
    def embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Embed ``(B, C_in, H, W)`` and add the positional encoding. Returns tokens
        ``(B, Hp*Wp, C)`` and ``(Hp, Wp)``, ``Hp = ceil(H / patch_size)``.

        No explicit padding: every stride-2 conv of the stem (padding 1) maps a size
        ``s`` to ``ceil(s / 2)``, so any ``H x W`` works and gives exactly the tokens of
        the upstream model for that input."""
        check_input(x, self.in_channels, type(self).__name__,
                    size_note='the stride-2 stem convs take any size')
        tokens, hw = self.patch_embed(x)
        if self.pos_embeder is not None:
            tokens = tokens + self.pos_embeder(hw).to(tokens.dtype)
        return self.pos_drop(tokens), hw

    def _run_block(self, block: XCiTBlock, x: torch.Tensor,
                   hw: Tuple[int, int]) -> torch.Tensor:
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(block, x, hw, use_reentrant=False)
        return block(x, hw)

    def forward_blocks(self, x: torch.Tensor,
                       indices: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
        """Token maps after blocks.

        Args:
            x: ``(B, C_in, H, W)`` input.
            indices: block indices to return (0-based); ``None`` returns every block.

        Returns:
            ``(B, C, Hp, Wp)`` maps in the order of ``indices`` (a repeated index gives
            the same tensor twice); blocks after the last requested one are not run.
        """
        wanted = list(range(self.depth)) if indices is None else list(indices)
        last = max(wanted)
        tokens, hw = self.embed(x)
        maps: Dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.blocks[:last + 1]):
            tokens = self._run_block(block, tokens, hw)
            if i in wanted:
                maps[i] = nlc_to_nchw(tokens, hw)
        return [maps[i] for i in wanted]

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Args: x ``(B, C_in, H, W)``, any H, W. Returns one map
        ``(B, C, ceil(H / s), ceil(W / s))`` per entry of ``out_indices``, ``s`` in
        ``out_strides``."""
        H, W = x.shape[-2:]
        feats = self.forward_blocks(x, [self.block_indices[k] for k in self.out_indices])
        outs = []
        for k, feat, stride in zip(self.out_indices, feats, self.out_strides):
            out = getattr(self, f'fpn{k + 1}')(feat)
            outs.append(out[..., :math.ceil(H / stride), :math.ceil(W / stride)])
        return tuple(outs)
