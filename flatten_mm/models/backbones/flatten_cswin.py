"""FLatten-CSwin: CSWin Transformer with focused linear attention in its early stages.

Paper: Han et al., "FLatten Transformer", ICCV 2023, https://arxiv.org/abs/2308.00442;
upstream classification model ``models/flatten_cswin.py`` of
https://github.com/LeapLabTHU/FLatten-Transformer @ abdb115 (MIT licence); dense design
``shared/spec/backbones.md`` §1.4 and §5.4 following the official CSWin segmentation
backbone (microsoft/CSWin-Transformer @ f111ae2). No official FLatten dense code exists.

Stages (strides 4, 8, 16, 32; widths ``C, 2C, 4C, 8C``): a conv embedding (stem
``Conv 7x7 / 4`` or merge ``Conv 3x3 / 2``, then LayerNorm) and pre-norm blocks whose
attention is a ``CrossShapedAttention`` (block ``qkv`` -> branches -> ``proj``). The
released models are ``LLSS``:

* stages 1-2 (``L``): one global branch of focused linear attention with DWC and LePE
  (``FocusedLinearQKV``) over the whole unpadded map; its positional table (the stage
  grid at ``pretrain_img_size``) is resized to the map (identity at the pretraining grid);
* stage 3 (``S``): two cross-shaped branches of LePE softmax attention in vertical /
  horizontal stripes of width ``split_size`` (7, or 12 for the 384 model), computed from
  the current ``H, W`` with centred zero padding to multiples of the split, then cropped;
* stage 4 (``S``): one global LePE softmax branch (CSWin's last stage), any size.

Outputs: stage ``i`` tokens through a new LayerNorm ``norm{i+1}`` (CSWin-seg naming;
not in the classification checkpoint), as NCHW maps of size ``ceil(H / s)``.
"""
import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...registry import MODELS
from ..layers import PreNormBlock, build_attention, nchw_to_nlc
from .base import DoublingStageBackbone, check_input, set_use_triton

#: global focused linear attention with LePE (the ``L`` stages of the released models)
CSWIN_LINEAR = dict(type='CrossShapedAttention', split_size=None,
                    branch_cfg=dict(type='FocusedLinearQKV', lepe=True, focusing_factor=3,
                                    kernel_size=5))
#: cross-shaped LePE softmax attention; stripe width from the backbone's ``split_size``
CSWIN_STRIPES = dict(type='CrossShapedAttention', branch_cfg=dict(type='LePEAttention'))
#: global LePE softmax attention (CSWin's last stage)
CSWIN_GLOBAL = dict(type='CrossShapedAttention', split_size=None,
                    branch_cfg=dict(type='LePEAttention'))


class CSWinPatchEmbed(nn.Module):
    """Strided conv + LayerNorm producing tokens of size ``ceil(H / stride)``.

    As in CSWin: stem ``k=7, s=4, p=2`` (``stage1_conv_embed``), merge ``k=3, s=2, p=1``
    (``merge{i}``). When the conv alone would floor (e.g. the stem at ``H % 4`` in
    {1, 2}), the input is zero-padded at the bottom/right just enough for
    ``ceil(H / stride)`` outputs; the values of the other outputs do not change.

    Args:
        in_channels: input channels.
        embed_dims: output channels.
        kernel_size: conv kernel.
        stride: conv stride.
        padding: conv padding (both sides).
    """

    def __init__(self, in_channels: int, embed_dims: int, kernel_size: int, stride: int,
                 padding: int) -> None:
        super().__init__()
        self.stride = stride
        self.proj = nn.Conv2d(in_channels, embed_dims, kernel_size, stride, padding)
        self.norm = nn.LayerNorm(embed_dims)

    def extra_pad(self, size: int) -> int:
        """Bottom/right padding giving ``ceil(size / stride)`` outputs."""
        k, s, p = self.proj.kernel_size[0], self.stride, self.proj.padding[0]
        return max(0, s * math.ceil(size / s) - s - size - 2 * p + k)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Args: x ``(B, C_in, H, W)``. Returns tokens ``(B, N, C)`` and their ``(H', W')``."""
        pad_h, pad_w = self.extra_pad(x.shape[2]), self.extra_pad(x.shape[3])
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        x = self.proj(x)
        hw = (x.shape[2], x.shape[3])
        return self.norm(nchw_to_nlc(x)), hw


class CSWinStage(nn.Module):
    """Embedding (stem or merge) and blocks of one stage."""

    def __init__(self, patch_embed: CSWinPatchEmbed, blocks: List[nn.Module]) -> None:
        super().__init__()
        self.patch_embed = patch_embed
        self.blocks = nn.ModuleList(blocks)


@MODELS.register_module()
class FLattenCSWin(DoublingStageBackbone):
    """FLatten-CSwin backbone (stage widths ``C, 2C, 4C, 8C``; strides 4, 8, 16, 32).

    ``arch`` (name or dict with ``embed_dims, depths, num_heads`` and optionally
    ``pretrain_img_size`` (default 224) and ``split_size`` (stage-3 stripe width,
    default 7)):

    ==============  ==  ===========  =============  ========  =====
    arch            C   depths       num_heads      pretrain  split
    ==============  ==  ===========  =============  ========  =====
    t, tiny         64  2, 4, 18, 1  2, 4, 8, 16    224       7
    s, small        64  2, 4, 32, 2  2, 4, 8, 16    224       7
    b, base         96  3, 6, 29, 2  4, 8, 16, 32   224       7
    b-384, base-384 96  3, 6, 29, 2  4, 8, 16, 32   384       12
    ==============  ==  ===========  =============  ========  =====

    ``'b-384'`` loads the official ``FLatten_CSWin_96_36292_base_384`` checkpoint as is
    (positional tables of the 96x96 / 48x48 grids, 12-wide stripes).

    Args:
        arch: variant name or custom dict (see above).
        in_channels: image channels.
        attn_cfg: attention per stage (one dict or four). A dict without ``type``
            updates the default of its stage, one with ``type`` replaces it. Default
            ``LLSS``: ``CSWIN_LINEAR`` (stages 1-2), ``CSWIN_STRIPES`` (stage 3),
            ``CSWIN_GLOBAL`` (stage 4). Configs without ``split_size`` get the
            backbone's ``split_size``.
        pretrain_img_size: pretraining resolution (grid of the FLA positional tables);
            default from ``arch``.
        split_size: stripe width of the cross-shaped stages (default from ``arch``).
        mlp_ratio: hidden/``C`` ratio of the MLPs.
        qkv_bias: bias of the qkv projections.
        drop_rate: dropout in the MLPs. As in the official CSWin block there is none
            after the attention projection (its ``proj_drop`` is never applied) and none
            after the embeddings.
        attn_drop_rate: attention-weight dropout of the softmax (LePE) branches; FLA
            stages have none and do not get it (the official FLA branches ignore it).
            Setting ``attn_drop`` in the ``attn_cfg`` of an FLA stage is an error.
        drop_path_rate: stochastic depth, linearly increasing over all blocks (official
            ImageNet values: 0.2 T, 0.4 S, 0.5 B, 0.7 B-384).
        out_indices: stages whose (normalised) maps are returned.
        frozen_stages: as mmdet's Swin: ``-1`` nothing, ``0`` the stem embedding
            (``stages[0].patch_embed``), ``k >= 1`` also stages ``0..k-1`` with their
            embeddings and output norms, ``4`` everything (see ``base.StageFreezing``).
            Stages after the deepest of ``out_indices`` are never run and are always
            frozen.
        with_cp: gradient checkpointing of every block (same outputs, less memory).
        recompute_mlp_act: when training, each MLP's GELU output is recomputed in the
            backward instead of kept (``PVTMlp``): the same outputs and gradients, a third
            less MLP activation memory for one elementwise pass per block in the backward;
            ``False`` keeps it, as timm / mmdet do.
        recompute_norms: when training, each block's LayerNorm outputs are recomputed in
            the backward instead of kept (``PreNormBlock``): the same outputs and
            gradients, two activations less per block for two LayerNorms in the
            backward; ``False`` keeps them, as timm / mmdet do.
        init_cfg: e.g. ``dict(type='Pretrained', checkpoint='converted.pth')`` with a
            checkpoint produced by ``tools/convert_checkpoint.py``.
    """

    arch_zoo: Dict[str, dict] = {
        **dict.fromkeys(['t', 'tiny'], dict(embed_dims=64, depths=(2, 4, 18, 1),
                                            num_heads=(2, 4, 8, 16))),
        **dict.fromkeys(['s', 'small'], dict(embed_dims=64, depths=(2, 4, 32, 2),
                                             num_heads=(2, 4, 8, 16))),
        **dict.fromkeys(['b', 'base'], dict(embed_dims=96, depths=(3, 6, 29, 2),
                                            num_heads=(4, 8, 16, 32))),
        **dict.fromkeys(['b-384', 'base-384'],
                        dict(embed_dims=96, depths=(3, 6, 29, 2), num_heads=(4, 8, 16, 32),
                             pretrain_img_size=384, split_size=12)),
    }
    #: optional arch keys and their defaults
    arch_geometry = dict(pretrain_img_size=224, split_size=7)
    default_attn_cfg = (CSWIN_LINEAR, CSWIN_LINEAR, CSWIN_STRIPES, CSWIN_GLOBAL)
    #: parameters not in the official checkpoints (the new output norms)
    dense_only_prefixes = ('norm1.', 'norm2.', 'norm3.', 'norm4.')
    norm_offset = 1
    #: frozen with ``frozen_stages >= 0``: the conv stem
    stem_names = ('stages.0.patch_embed', )

    def __init__(self,
                 arch: Union[str, dict] = 't',
                 in_channels: int = 3,
                 attn_cfg: Optional[Union[dict, Sequence[dict]]] = None,
                 pretrain_img_size: Optional[Union[int, Tuple[int, int]]] = None,
                 split_size: Optional[int] = None,
                 mlp_ratio: float = 4.,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.,
                 attn_drop_rate: float = 0.,
                 drop_path_rate: float = 0.1,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 with_cp: bool = False,
                 recompute_mlp_act: bool = True,
                 recompute_norms: bool = True,
                 use_triton: Optional[bool] = None,
                 init_cfg: Optional[Union[dict, List[dict]]] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        settings = self._setup(arch, in_channels, attn_cfg, pretrain_img_size, out_indices,
                               frozen_stages, with_cp)
        self.split_size = int(settings['split_size'] if split_size is None else split_size)

        dpr = torch.linspace(0, drop_path_rate, sum(self.depths)).tolist()
        self.stages = nn.ModuleList()
        cur, prev = 0, in_channels
        for i in range(self.num_stages):
            dims = self.embed_dims[i]
            embed = CSWinPatchEmbed(prev, dims, 7, 4, 2) if i == 0 else \
                CSWinPatchEmbed(prev, dims, 3, 2, 1)
            blocks = []
            for j in range(self.depths[i]):
                attn = build_attention(
                    self.attn_cfgs[i], embed_dims=dims, num_heads=self.num_heads[i],
                    qkv_bias=qkv_bias, attn_drop=attn_drop_rate,
                    split_size=self.split_size, pretrain_hw_shape=self.stage_grid(i))
                blocks.append(PreNormBlock(dims, attn, mlp_ratio=mlp_ratio, drop_rate=drop_rate,
                                           drop_path=dpr[cur + j],
                                           recompute_mlp_act=recompute_mlp_act,
                                           recompute_norms=recompute_norms))
            self.stages.append(CSWinStage(embed, blocks))
            cur += self.depths[i]
            prev = dims
        self._add_output_norms()  # norm1..norm4 (CSWin-seg naming)
        self._freeze_stages()
        set_use_triton(self, use_triton)

    def iter_stages(self, x: torch.Tensor, last: Optional[int] = None
                    ) -> Iterator[Tuple[int, torch.Tensor, Tuple[int, int]]]:
        """Yield ``(i, tokens (B, H_i*W_i, C_i), (H_i, W_i))`` of each stage ``0..last``:
        the output of its last block, before the output norm."""
        check_input(x, self.in_channels, type(self).__name__)
        last = self.num_stages - 1 if last is None else last
        for i, stage in enumerate(self.stages):
            x, hw = stage.patch_embed(x)
            for block in stage.blocks:
                x = self._run_block(block, x, hw)
            yield i, x, hw
            if i == last:
                return
            x = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], *hw)
