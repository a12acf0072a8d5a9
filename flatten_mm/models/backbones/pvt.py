"""One PVT-family skeleton with pluggable attention per stage.

FLatten-PVT (PVT v1 base), FLatten-PVTv2 and QuadTree-PVTv2 differ only in the patch
embedding, the MLP, the output norms, the absolute position table and -- mostly -- the
attention operator of each stage. ``PyramidVisionBackbone`` holds all of it; the
registered classes set class-level defaults and an ``arch_zoo``.

Stage ``i`` (0-based) has stride ``4 * 2**i``. Its attention is built from
``attn_cfg[i]`` with ``flatten_mm.models.layers.build_attention``; the skeleton supplies
``embed_dims``, ``num_heads``, ``qkv_bias``, ``attn_drop``, ``proj_drop``, ``linear`` and
``pretrain_hw_shape`` (the stage grid at ``pretrain_img_size``) to operators that accept
them. Any attention type may sit in any stage.
"""
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from timm.layers import DropPath

from ...registry import MODELS
from ..layers import PVTMlp, PVTPatchEmbed, build_attention, resize_pos_table
from ..layers.pos_embed import resize_loaded_pos_table
from .base import (StageFreezing, StridePyramidOutputs, check_frozen_stages, check_input,
                   check_out_indices, init_weights_or_load, merge_stage_cfgs, resolve_arch,
                   set_use_triton)

FLA = dict(type='FocusedLinearAttention', sr_ratio=1, focusing_factor=3, kernel_size=5)


class PVTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(LN(x))``, ``x + mlp(LN(x))``.

    Args:
        embed_dims: channels ``C``.
        num_heads: attention heads.
        mlp_ratio: hidden/``C`` ratio of the MLP.
        attn_cfg: attention operator config (see ``build_attention``).
        qkv_bias: bias of the q/k/v projections.
        drop_rate: dropout after projections and in the MLP.
        attn_drop_rate: attention-weight dropout (operators that have one).
        drop_path: stochastic-depth rate of this block.
        mlp_dwconv: PVTv2 depth-wise conv in the MLP.
        linear: PVTv2-li mode (pooled keys in attention, ReLU in the MLP).
        pretrain_hw_shape: the stage grid at the pretraining resolution.
        recompute_mlp_act: the MLP's GELU output recomputed in the backward instead of
            kept (``PVTMlp(recompute_act=...)``).
    """

    def __init__(self, embed_dims: int, num_heads: int, mlp_ratio: float, attn_cfg: dict,
                 qkv_bias: bool = True, drop_rate: float = 0., attn_drop_rate: float = 0.,
                 drop_path: float = 0., mlp_dwconv: bool = True, linear: bool = False,
                 pretrain_hw_shape: Tuple[int, int] = (56, 56),
                 recompute_mlp_act: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.attn = build_attention(
            attn_cfg, embed_dims=embed_dims, num_heads=num_heads, qkv_bias=qkv_bias,
            attn_drop=attn_drop_rate, proj_drop=drop_rate, linear=linear,
            pretrain_hw_shape=pretrain_hw_shape)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.mlp = PVTMlp(embed_dims, int(embed_dims * mlp_ratio), drop=drop_rate,
                          dwconv=mlp_dwconv, linear=linear, recompute_act=recompute_mlp_act)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), hw_shape))
        return x + self.drop_path(self.mlp(self.norm2(x), hw_shape))


class PVTStage(nn.Module):
    """Patch embedding, optional absolute position table, blocks, optional norm."""

    def __init__(self, patch_embed: PVTPatchEmbed, blocks: List[PVTBlock],
                 norm: Optional[nn.Module], pos_embed_hw: Optional[Tuple[int, int]],
                 embed_dims: int, drop_rate: float = 0.) -> None:
        super().__init__()
        self.patch_embed = patch_embed
        self.pos_embed_hw = pos_embed_hw
        if pos_embed_hw is not None:
            self.pos_embed = nn.Parameter(
                torch.zeros(1, pos_embed_hw[0] * pos_embed_hw[1], embed_dims))
            self.pos_drop = nn.Dropout(drop_rate)
        else:
            self.pos_embed = None
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm

    def resize_loaded_tables(self, state_dict: dict, prefix: str) -> list:
        """Resize, in ``state_dict``, a ``pos_embed`` stored for another square grid (a
        checkpoint pretrained at another ``pretrain_img_size``) to ``pos_embed_hw``,
        bilinearly as the run-time resize (see ``resize_loaded_pos_table``). Returns the
        ``(key, old shape, new shape)`` of each resized table."""
        if self.pos_embed is None:
            return []
        done = resize_loaded_pos_table(state_dict, prefix + 'pos_embed', self.pos_embed,
                                       self.pos_embed_hw, 'bilinear')
        return [done] if done else []

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.resize_loaded_tables(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class PyramidVisionBackbone(StageFreezing, StridePyramidOutputs, BaseModule):
    """PVT / PVTv2 skeleton producing NCHW maps at strides 4, 8, 16, 32.

    Subclasses set ``arch_zoo`` and the class attributes below; see
    ``FLattenPVTv2`` for the meaning of the constructor arguments.
    """

    arch_zoo: Dict[str, dict] = {}
    arch_keys = ('embed_dims', 'depths', 'num_heads', 'mlp_ratios')
    default_attn_cfg: Union[dict, Sequence[dict]] = FLA
    overlap_patch_embed = True  # PVTv2 overlapping embeddings (False: PVT v1)
    use_abs_pos_embed = False  # PVT v1 per-stage absolute position tables
    mlp_dwconv = True  # PVTv2 MLP with depth-wise conv
    stage_norm = True  # LayerNorm after every stage (PVTv2); v1 outputs are un-normalised
    #: PVTv2's ``_init_weights`` gives convs a fan-out normal init; the PVT v1 model keeps
    #: PyTorch's default conv init (it initialises only Linear and LayerNorm)
    conv_fan_out_init = True
    num_stages = 4
    #: frozen with ``frozen_stages >= 0``: the first patch embedding and what is applied to
    #: its tokens before the first block (PVT v1's absolute table and its dropout)
    stem_names = ('stages.0.patch_embed', 'stages.0.pos_embed', 'stages.0.pos_drop')

    def __init__(self,
                 arch: Union[str, dict] = 'b0',
                 in_channels: int = 3,
                 attn_cfg: Optional[Union[dict, Sequence[dict]]] = None,
                 pretrain_img_size: Union[int, Tuple[int, int]] = 224,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.,
                 attn_drop_rate: float = 0.,
                 drop_path_rate: float = 0.1,
                 linear: bool = False,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 with_cp: bool = False,
                 recompute_mlp_act: bool = True,
                 use_triton: Optional[bool] = None,
                 init_cfg: Optional[Union[dict, List[dict]]] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        name = type(self).__name__
        self.arch_settings = resolve_arch(arch, self.arch_zoo, self.arch_keys, name)
        embed_dims = tuple(self.arch_settings['embed_dims'])
        depths = tuple(self.arch_settings['depths'])
        num_heads = tuple(self.arch_settings['num_heads'])
        mlp_ratios = tuple(self.arch_settings['mlp_ratios'])
        for key, val in (('embed_dims', embed_dims), ('depths', depths),
                         ('num_heads', num_heads), ('mlp_ratios', mlp_ratios)):
            if len(val) != self.num_stages:
                raise ValueError(f'{name}: arch {key} needs {self.num_stages} entries, got {val}')
        self.embed_dims = embed_dims
        self.depths = depths
        self.out_indices = check_out_indices(out_indices, self.num_stages, name)
        self.frozen_stages = check_frozen_stages(frozen_stages, self.num_stages + 1, name)
        self.with_cp = with_cp
        self.attn_cfgs = merge_stage_cfgs(self.default_attn_cfg, attn_cfg, self.num_stages)

        if isinstance(pretrain_img_size, int):
            pretrain_img_size = (pretrain_img_size, pretrain_img_size)
        dpr = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        grid = tuple(pretrain_img_size)
        self.stages = nn.ModuleList()
        cur, prev_dims = 0, in_channels
        for i in range(self.num_stages):
            stride = 4 if i == 0 else 2
            grid = (grid[0] // stride, grid[1] // stride)
            patch_embed = PVTPatchEmbed(prev_dims, embed_dims[i], stride,
                                        overlap=self.overlap_patch_embed)
            blocks = [
                PVTBlock(embed_dims[i], num_heads[i], mlp_ratios[i], self.attn_cfgs[i],
                         qkv_bias=qkv_bias, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                         drop_path=dpr[cur + j], mlp_dwconv=self.mlp_dwconv, linear=linear,
                         pretrain_hw_shape=grid, recompute_mlp_act=recompute_mlp_act)
                for j in range(depths[i])
            ]
            norm = nn.LayerNorm(embed_dims[i], eps=1e-6) if self.stage_norm else None
            self.stages.append(
                PVTStage(patch_embed, blocks, norm, grid if self.use_abs_pos_embed else None,
                         embed_dims[i], drop_rate))
            cur += depths[i]
            prev_dims = embed_dims[i]
        self._freeze_stages()
        set_use_triton(self, use_triton)

    # ------------------------------------------------------------------ init / freezing
    def init_weights(self) -> None:
        """The official model's initialisation (truncated-normal linears and position
        tables, unit LayerNorms; PVTv2 also fan-out normal convs, ``conv_fan_out_init``),
        or the ``Pretrained`` checkpoint(s) of ``init_cfg`` (see
        ``base.init_weights_or_load``)."""

        def pos_tables() -> None:
            for stage in self.stages:
                if stage.pos_embed is not None:
                    trunc_normal_(stage.pos_embed, std=.02)

        init_weights_or_load(self, self.init_cfg, conv_fan_out=self.conv_fan_out_init,
                             default_init=pos_tables)

    # ------------------------------------------------------------------ input sizes
    def _check_stage_maps(self, hw: Tuple[int, int]) -> None:
        """Run the ``check_map_size`` of every attention that declares one (QuadTree's
        top-k needs a minimum map) on its stage map for an ``hw`` input."""
        H, W = hw
        for i, stage in enumerate(self.stages):
            stride = 4 * 2**i
            grid = (math.ceil(H / stride), math.ceil(W / stride))
            for block in stage.blocks:
                check = getattr(block.attn, 'check_map_size', None)
                if check is not None:
                    try:
                        check(grid)
                    except ValueError as err:
                        raise ValueError(f'stage {i + 1} (stride {stride}, {grid[0]}x{grid[1]} '
                                         f'map): {err}') from None

    def min_input_size(self) -> Tuple[int, int]:
        """Smallest square input ``(S, S)`` the backbone accepts: ``(1, 1)`` (any size is
        padded) unless an attention operator needs a minimum map (QuadTree top-k)."""

        def ok(side: int) -> bool:
            try:
                self._check_stage_maps((side, side))
                return True
            except ValueError:
                return False

        hi = 1
        while not ok(hi):
            hi *= 2
            if hi > 2**20:
                raise ValueError(f'{type(self).__name__}: no input size satisfies the attention '
                                 'operators of every stage')
        lo = hi // 2  # fails (or 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi, hi

    def check_input_size(self, hw: Tuple[int, int]) -> None:
        """Raise ``ValueError`` naming the minimum if an ``hw=(H, W)`` input is too small."""
        H, W = hw
        name = type(self).__name__
        if H < 1 or W < 1:
            side = self.min_input_size()[0]
            raise ValueError(f'{name} needs an input of at least {side}x{side} pixels, got {H}x{W}')
        try:
            self._check_stage_maps(hw)
        except ValueError as err:
            side = self.min_input_size()[0]
            raise ValueError(f'{name}: a {H}x{W} input is too small: {err}. The smallest square '
                             f'input is {side}x{side}.') from None

    # ------------------------------------------------------------------ forward
    def _run_block(self, block: PVTBlock, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(block, x, hw, use_reentrant=False)
        return block(x, hw)

    def forward_stage(self, i: int, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Run stage ``i`` on a map ``(B, C_in, H, W)``; returns tokens ``(B, N, C_i)``
        after the blocks and the stage norm (if any), and their grid."""
        stage = self.stages[i]
        x, hw = stage.patch_embed(x)
        if stage.pos_embed is not None:
            x = stage.pos_drop(x + resize_pos_table(stage.pos_embed, stage.pos_embed_hw, hw))
        for block in stage.blocks:
            x = self._run_block(block, x, hw)
        if stage.norm is not None:
            x = stage.norm(x)
        return x, hw

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Args: x ``(B, C_in, H, W)``, any H, W of at least ``min_input_size()``. Returns the
        maps of ``out_indices``, ``(B, out_channels[k], ceil(H / s), ceil(W / s))`` for
        ``s = out_strides[k]``. Stages after the deepest of ``out_indices`` are not run."""
        check_input(x, self.stages[0].patch_embed.proj.in_channels, type(self).__name__,
                    size_note=None)
        self.check_input_size((x.shape[2], x.shape[3]))
        outs = []
        for i in range(max(self.out_indices) + 1):
            tokens, hw = self.forward_stage(i, x)
            # the next stage takes the tokens as a channels-last map (a view, no copy);
            # returned maps are contiguous NCHW
            x = tokens.reshape(tokens.shape[0], hw[0], hw[1], tokens.shape[2]).permute(0, 3, 1, 2)
            if i in self.out_indices:
                outs.append(x.contiguous())
        return tuple(outs)


@MODELS.register_module()
class FLattenPVTv2(PyramidVisionBackbone):
    """FLatten-PVTv2: PVTv2 with Focused Linear Attention in every stage.

    ``arch`` (``'b0'`` ... ``'b5'``, or a dict with the same keys):

    ====  =================  ===========  =========  ===========
    arch  embed_dims         depths       num_heads  mlp_ratios
    ====  =================  ===========  =========  ===========
    b0    32, 64, 160, 256   2, 2, 2, 2   1, 2, 5, 8  8, 8, 4, 4
    b1    64, 128, 320, 512  2, 2, 2, 2   1, 2, 5, 8  8, 8, 4, 4
    b2    64, 128, 320, 512  3, 4, 6, 3   1, 2, 5, 8  8, 8, 4, 4
    b3    64, 128, 320, 512  3, 4, 18, 3  1, 2, 5, 8  8, 8, 4, 4
    b4    64, 128, 320, 512  3, 8, 27, 3  1, 2, 5, 8  8, 8, 4, 4
    b5    64, 128, 320, 512  3, 6, 40, 3  1, 2, 5, 8  4, 4, 4, 4
    ====  =================  ===========  =========  ===========

    Args:
        arch: variant name or custom dict (keys ``embed_dims, depths, num_heads,
            mlp_ratios``).
        in_channels: image channels.
        attn_cfg: attention config, one dict for all stages or one per stage. A dict
            without ``type`` updates the default (FLA: ``sr_ratio=1, focusing_factor=3,
            kernel_size=5``); with ``type`` it replaces it, e.g.
            ``dict(type='SpatialReductionAttention', sr_ratio=2)`` for a softmax stage.
        pretrain_img_size: resolution of the pretraining; fixes the stored grid of the
            FLA positional tables, which are resized to the actual grid at run time.
        qkv_bias: bias of the q/k/v projections.
        drop_rate: dropout after projections and in the MLPs.
        attn_drop_rate: attention-weight dropout (softmax stages).
        drop_path_rate: stochastic depth, linearly increasing over all blocks.
        linear: PVTv2-li mode (7x7 pooled keys, ReLU in the MLP).
        out_indices: stages whose maps are returned (strides 4, 8, 16, 32); the
            stages after the deepest one are not run (their parameters are kept and
            frozen, so full checkpoints load).
        frozen_stages: as mmdet's Swin / ResNet: ``-1`` nothing, ``0`` the first patch
            embedding (with PVT v1's stage-1 position table and its dropout), ``k >= 1``
            also stages ``0..k-1`` (each with its patch embedding, position table and
            norm), ``4`` everything (see ``base.StageFreezing``). Stages after the
            deepest of ``out_indices`` are never run and are always frozen.
        with_cp: gradient checkpointing of every block (same outputs, less memory).
        recompute_mlp_act: when training, each MLP's GELU output is recomputed in the
            backward instead of kept (``PVTMlp``): the same outputs and gradients, a third
            less MLP activation memory for one elementwise pass per block in the backward
            (``docs/benchmarks/``); ``False`` keeps it, as timm / mmdet do.
        init_cfg: e.g. ``dict(type='Pretrained', checkpoint='converted.pth')`` with a
            checkpoint produced by ``tools/convert_checkpoint.py``.
    """

    arch_zoo = {
        **dict.fromkeys(['b0'], dict(embed_dims=(32, 64, 160, 256), depths=(2, 2, 2, 2),
                                     num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4))),
        **dict.fromkeys(['b1'], dict(embed_dims=(64, 128, 320, 512), depths=(2, 2, 2, 2),
                                     num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4))),
        **dict.fromkeys(['b2'], dict(embed_dims=(64, 128, 320, 512), depths=(3, 4, 6, 3),
                                     num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4))),
        **dict.fromkeys(['b3'], dict(embed_dims=(64, 128, 320, 512), depths=(3, 4, 18, 3),
                                     num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4))),
        **dict.fromkeys(['b4'], dict(embed_dims=(64, 128, 320, 512), depths=(3, 8, 27, 3),
                                     num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4))),
        **dict.fromkeys(['b5'], dict(embed_dims=(64, 128, 320, 512), depths=(3, 6, 40, 3),
                                     num_heads=(1, 2, 5, 8), mlp_ratios=(4, 4, 4, 4))),
    }
    default_attn_cfg = FLA


@MODELS.register_module()
class FLattenPVT(PyramidVisionBackbone):
    """FLatten-PVT: PVT v1 (non-overlapping patch embeddings, absolute per-stage position
    tables resized bilinearly to the stage grid, plain MLP, un-normalised outputs) with
    Focused Linear Attention in every stage.

    ``arch`` (aliases ``t``/``tiny``, ``s``/``small``, ``m``/``medium``, ``b``/``large``):

    ========  =================  ============  ==========  ==========
    arch      embed_dims         depths        num_heads   mlp_ratios
    ========  =================  ============  ==========  ==========
    tiny      64, 128, 320, 512  2, 2, 2, 2    1, 2, 5, 8  8, 8, 4, 4
    small     64, 128, 320, 512  3, 4, 6, 3    1, 2, 5, 8  8, 8, 4, 4
    medium    64, 128, 320, 512  3, 4, 18, 3   1, 2, 5, 8  8, 8, 4, 4
    large(b)  64, 128, 320, 512  3, 8, 27, 3   1, 2, 5, 8  8, 8, 4, 4
    ========  =================  ============  ==========  ==========

    Inputs of any size are padded (bottom/right) to the patch stride of each stage, so
    output sizes are ``ceil(H / stride)``. Arguments as ``FLattenPVTv2``.
    """

    _common = dict(embed_dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8),
                   mlp_ratios=(8, 8, 4, 4))
    arch_zoo = {
        **dict.fromkeys(['t', 'tiny'], dict(depths=(2, 2, 2, 2), **_common)),
        **dict.fromkeys(['s', 'small'], dict(depths=(3, 4, 6, 3), **_common)),
        **dict.fromkeys(['m', 'medium'], dict(depths=(3, 4, 18, 3), **_common)),
        **dict.fromkeys(['b', 'base', 'l', 'large'], dict(depths=(3, 8, 27, 3), **_common)),
    }
    default_attn_cfg = FLA
    overlap_patch_embed = False
    use_abs_pos_embed = True
    mlp_dwconv = False
    stage_norm = False
    conv_fan_out_init = False  # official FLatten-PVT (v1): convs keep PyTorch's init

    def __init__(self, arch: Union[str, dict] = 'tiny', **kwargs) -> None:
        super().__init__(arch=arch, **kwargs)
