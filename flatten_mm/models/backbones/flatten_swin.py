"""FLatten-Swin: Swin Transformer with focused linear attention in its early stages.

Paper: Han et al., "FLatten Transformer", ICCV 2023, https://arxiv.org/abs/2308.00442;
upstream classification model ``models/flatten_swin.py`` of
https://github.com/LeapLabTHU/FLatten-Transformer @ abdb115 (MIT licence). Dense design:
``shared/spec/backbones.md`` §1.3 and §5.3 (option 1), no official dense code exists.

One Swin skeleton (patch embedding, four stages of pre-norm blocks, ``PatchMerging``
between stages) with one attention config per stage. The released models are ``LLSS``:

* stages 1-2 (``L``): ``FocusedLinearAttentionQKV`` with ``window_size=None``: global FLA
  over the whole unpadded stage map. At the pretraining resolution the official linear
  window covers the whole map (56x56 / 28x28 at 224, 96x96 / 48x48 at 384), so this is
  the pretrained computation; at other sizes the positional table (stage grid at
  ``pretrain_img_size``) is resized to the map (exact identity at the pretraining grid).
* stages 3-4 (``S``): ``ShiftedWindowAttention`` (Swin W-MSA / SW-MSA, window 7, or 12
  for the 384 model), maps zero-padded to window multiples, shifted windows in odd
  blocks with masks computed for the actual padded size (cached per shape).

Outputs follow the Swin dense convention: stage ``i`` tokens before ``PatchMerging``,
passed through a new LayerNorm ``norm{i}`` (random init, not in the classification
checkpoint), as NCHW maps with strides 4, 8, 16, 32 (``ceil(H / s)``; the patch
embedding and ``PatchMerging`` zero-pad odd sizes at the bottom/right).
"""
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...registry import MODELS
from ..layers import PreNormBlock, PVTPatchEmbed, build_attention
from .base import DoublingStageBackbone, check_input, set_use_triton

#: global focused linear attention (the ``L`` stages of the released models)
SWIN_LINEAR = dict(type='FocusedLinearAttentionQKV', window_size=None, focusing_factor=3,
                   kernel_size=5)
#: Swin shifted-window softmax attention (the ``S`` stages); window from the backbone
SWIN_SOFTMAX = dict(type='ShiftedWindowAttention')


class PatchMerging(nn.Module):
    """Swin down-sampling: 2x2 neighbours concatenated (order ``x[0::2, 0::2]``,
    ``x[1::2, 0::2]``, ``x[0::2, 1::2]``, ``x[1::2, 1::2]``), LayerNorm(4C), Linear
    4C -> 2C without bias. Odd maps are zero-padded at the bottom/right first, so the
    output grid is ``ceil(H / 2) x ceil(W / 2)``.

    Args:
        in_channels: ``C``.
        norm_eps: LayerNorm epsilon.
    """

    def __init__(self, in_channels: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * in_channels, eps=norm_eps)
        self.reduction = nn.Linear(4 * in_channels, 2 * in_channels, bias=False)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]
                ) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Args: x ``(B, H*W, C)``. Returns ``(B, H'*W', 2C)`` and ``(H', W')``."""
        B, N, C = x.shape
        H, W = hw_shape
        x = x.reshape(B, H, W, C)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        hw = (x.shape[1] // 2, x.shape[2] // 2)
        # channels [x(2i, 2j), x(2i+1, 2j), x(2i, 2j+1), x(2i+1, 2j+1)] (the official
        # concat of the four strided slices) as one permute: (dw, dh) become the
        # outer channel index, dh fastest (one Transpose in ONNX instead of 4 Slice + Concat)
        x = x.view(B, hw[0], 2, hw[1], 2, C).permute(0, 1, 3, 4, 2, 5)
        return self.reduction(self.norm(x.reshape(B, hw[0] * hw[1], 4 * C))), hw


class SwinStage(nn.Module):
    """Blocks of one stage and the ``PatchMerging`` that follows them (stages 1-3)."""

    def __init__(self, blocks: List[nn.Module], downsample: Optional[PatchMerging]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.downsample = downsample


@MODELS.register_module()
class FLattenSwin(DoublingStageBackbone):
    """FLatten-Swin backbone (stage widths ``C, 2C, 4C, 8C``; strides 4, 8, 16, 32).

    ``arch`` (name or dict with ``embed_dims, depths, num_heads`` and optionally
    ``pretrain_img_size`` (default 224) and ``window_size`` (default 7)):

    ==============  ======  ===========  ============  ========  ======
    arch            C       depths       num_heads     pretrain  window
    ==============  ======  ===========  ============  ========  ======
    t, tiny         96      2, 2, 6, 2   3, 6, 12, 24  224       7
    s, small        96      2, 2, 18, 2  3, 6, 12, 24  224       7
    b, base         128     2, 2, 18, 2  4, 8, 16, 32  224       7
    b-384, base-384 128     2, 2, 18, 2  4, 8, 16, 32  384       12
    ==============  ======  ===========  ============  ========  ======

    The B-384 model is the arch ``'b-384'``: the same structure as ``'b'`` with positional
    tables of the 384 grid (96x96 / 48x48) and 12x12 softmax windows, i.e. the official
    ``flatten_swin_b_384`` checkpoint loads as is.

    Args:
        arch: variant name or custom dict (see above).
        in_channels: image channels.
        attn_cfg: attention per stage (one dict for all stages or four). A dict without
            ``type`` updates the default of its stage; with ``type`` it replaces it.
            Default ``LLSS``: ``SWIN_LINEAR`` (global FLA) for stages 1-2,
            ``SWIN_SOFTMAX`` (shifted windows) for stages 3-4. ``dict(window_size=7)`` on
            a linear stage gives FLA inside shifted 7x7 windows (official ``window_size=7``
            models; cyclic shift without mask). Operators with a ``window_size`` argument
            get the backbone's ``window_size`` unless their config sets it
            (``SWIN_LINEAR`` sets ``None``: global).
        pretrain_img_size: pretraining resolution; fixes the grid of the stored FLA
            positional tables (default: from ``arch``).
        window_size: window of the softmax stages (default: from ``arch``).
        mlp_ratio: hidden/``C`` ratio of the MLPs.
        qkv_bias: bias of the qkv projections.
        drop_rate: dropout after the patch embedding (``pos_drop``), after the attention
            projections and in the MLPs, as in the official Swin.
        attn_drop_rate: attention-weight dropout of the operators that have one (the
            shifted-window softmax stages); FLA stages have none and do not get it (the
            official FLA modules ignore it too). Setting ``attn_drop`` in the
            ``attn_cfg`` of an FLA stage is an error.
        drop_path_rate: stochastic depth, linearly increasing over all blocks (official
            ImageNet values: 0.2 T, 0.3 S, 0.5 B).
        out_indices: stages whose (normalised) maps are returned.
        frozen_stages: as mmdet's Swin: ``-1`` nothing, ``0`` the patch embedding
            (and the dropout after it), ``k >= 1`` also stages ``0..k-1`` with their
            ``PatchMerging`` and output norms, ``4`` everything (see
            ``base.StageFreezing``). Stages after the deepest of ``out_indices`` (and
            that stage's ``PatchMerging``) are never run and are always frozen.
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
        **dict.fromkeys(['t', 'tiny'], dict(embed_dims=96, depths=(2, 2, 6, 2),
                                            num_heads=(3, 6, 12, 24))),
        **dict.fromkeys(['s', 'small'], dict(embed_dims=96, depths=(2, 2, 18, 2),
                                             num_heads=(3, 6, 12, 24))),
        **dict.fromkeys(['b', 'base'], dict(embed_dims=128, depths=(2, 2, 18, 2),
                                            num_heads=(4, 8, 16, 32))),
        **dict.fromkeys(['b-384', 'base-384'],
                        dict(embed_dims=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32),
                             pretrain_img_size=384, window_size=12)),
    }
    #: optional arch keys and their defaults
    arch_geometry = dict(pretrain_img_size=224, window_size=7)
    default_attn_cfg = (SWIN_LINEAR, SWIN_LINEAR, SWIN_SOFTMAX, SWIN_SOFTMAX)
    #: parameters not in the official checkpoints (the new output norms)
    dense_only_prefixes = ('norm0.', 'norm1.', 'norm2.', 'norm3.')
    #: frozen with ``frozen_stages >= 0`` (``pos_drop``: the dropout after it, if any)
    stem_names = ('patch_embed', 'pos_drop')

    def __init__(self,
                 arch: Union[str, dict] = 't',
                 in_channels: int = 3,
                 attn_cfg: Optional[Union[dict, Sequence[dict]]] = None,
                 pretrain_img_size: Optional[Union[int, Tuple[int, int]]] = None,
                 window_size: Optional[int] = None,
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
        self.window_size = int(settings['window_size'] if window_size is None else window_size)
        C = self.embed_dims[0]

        self.patch_embed = PVTPatchEmbed(in_channels, C, stride=4, overlap=False)
        self.pos_drop = nn.Dropout(drop_rate)  # official Swin: dropout after the embedding
        dpr = torch.linspace(0, drop_path_rate, sum(self.depths)).tolist()
        self.stages = nn.ModuleList()
        cur = 0
        for i in range(self.num_stages):
            dims = self.embed_dims[i]
            blocks = []
            for j in range(self.depths[i]):
                attn = build_attention(
                    self.attn_cfgs[i], embed_dims=dims, num_heads=self.num_heads[i],
                    qkv_bias=qkv_bias, attn_drop=attn_drop_rate, proj_drop=drop_rate,
                    window_size=self.window_size, shift=j % 2 == 1,
                    pretrain_hw_shape=self.stage_grid(i))
                blocks.append(PreNormBlock(dims, attn, mlp_ratio=mlp_ratio, drop_rate=drop_rate,
                                           drop_path=dpr[cur + j],
                                           recompute_mlp_act=recompute_mlp_act,
                                           recompute_norms=recompute_norms))
            downsample = PatchMerging(dims) if i < self.num_stages - 1 else None
            self.stages.append(SwinStage(blocks, downsample))
            cur += self.depths[i]
        self._add_output_norms()  # norm0..norm3 (Swin dense convention)
        self._freeze_stages()
        set_use_triton(self, use_triton)

    def unused_parts(self) -> List[nn.Module]:
        """The stages after the deepest of ``out_indices`` and the ``PatchMerging`` after
        that stage: never run by ``forward``."""
        last = max(self.out_indices)
        merge = self.stages[last].downsample
        return ([merge] if merge is not None else []) + super().unused_parts()

    def iter_stages(self, x: torch.Tensor, last: Optional[int] = None
                    ) -> Iterator[Tuple[int, torch.Tensor, Tuple[int, int]]]:
        """Yield ``(i, tokens (B, H_i*W_i, C_i), (H_i, W_i))`` of each stage ``0..last``:
        the output of its last block, before ``PatchMerging`` and before ``norm{i}``."""
        check_input(x, self.in_channels, type(self).__name__)
        last = self.num_stages - 1 if last is None else last
        x, hw = self.patch_embed(x)
        x = self.pos_drop(x)
        for i, stage in enumerate(self.stages):
            for block in stage.blocks:
                x = self._run_block(block, x, hw)
            yield i, x, hw
            if i == last:
                return
            x, hw = stage.downsample(x, hw)
