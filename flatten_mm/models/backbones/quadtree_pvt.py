"""QuadTree-PVTv2: the PVTv2 skeleton with QuadTree attention in every stage.

Paper: Tang et al., "QuadTree Attention for Vision Transformers", ICLR 2022,
https://arxiv.org/abs/2201.02767; upstream https://github.com/Tangshitao/QuadTreeAttention
@ 549a1ef (Apache-2.0), ``classification/quadtree.py`` and ``detection/quadtree.py``.
"""
from typing import Optional, Sequence, Union

from ...registry import MODELS
from .base import expand_per_stage
from .pvt import PyramidVisionBackbone

#: per-stage pyramid levels of the released models (the official ``sr_ratios``)
QUADTREE_LEVELS = (4, 3, 2, 1)


def _quadtree_cfgs(attn_type: str = 'B', topk: int = 32, value_act: str = 'relu') -> tuple:
    return tuple(
        dict(type='QuadTreeAttention', attn_type=attn_type, num_levels=s, topk=topk,
             value_act=value_act) for s in QUADTREE_LEVELS)


@MODELS.register_module()
class QuadTreePVTv2(PyramidVisionBackbone):
    """QuadTree-PVTv2 (QuadTree-B, and QuadTree-A as ``arch='a-b0'``).

    Identical to PVTv2 (overlapping patch embeddings, depth-wise-conv MLPs, LayerNorm after
    every stage, outputs after that norm) except the attention of every block, which is
    :class:`~flatten_mm.models.layers.QuadTreeAttention` with 4, 3, 2, 1 pyramid levels in
    stages 1-4.

    ``arch``:

    =====  =================  ============  ==========  ==========  =========
    arch   embed_dims         depths        num_heads   mlp_ratios  attention
    =====  =================  ============  ==========  ==========  =========
    b0     32, 64, 160, 256   2, 2, 2, 2    1, 2, 5, 8  8, 8, 4, 4  B
    b1     64, 128, 320, 512  2, 2, 2, 2    1, 2, 5, 8  8, 8, 4, 4  B
    b2     64, 128, 320, 512  3, 4, 6, 3    1, 2, 5, 8  8, 8, 4, 4  B
    b3     64, 128, 320, 512  3, 4, 18, 3   1, 2, 5, 8  8, 8, 4, 4  B
    b4     64, 128, 320, 512  3, 8, 27, 3   1, 2, 5, 8  8, 8, 4, 4  B
    a-b0   32, 64, 160, 256   2, 2, 2, 2    1, 2, 5, 8  8, 8, 4, 4  A
    =====  =================  ============  ==========  ==========  =========

    The default attention is the official dense (detection/segmentation) setting:
    ``topk=32`` and ReLU in the B value branches. The ImageNet models were trained with
    ``attn_cfg=dict(topk=8, value_act='gelu')`` (same parameters).

    Input sizes: any ``H x W``. Stage maps whose size is not a multiple of the stage's
    ``2**(levels-1)`` are zero-padded at the bottom/right inside the attention and
    cropped back (the official models need inputs that are multiples of 32). The coarsest
    pyramid level of every stage (the stride-32 grid for the default levels) must hold at
    least ``topk`` tokens: ``ceil(H/32) * ceil(W/32) >= 32`` by default, so the smallest
    square input is 161x161 (192x192 among multiples of 32); ``min_input_size()`` gives it
    for the actual configuration and smaller inputs raise ``ValueError`` naming it.

    Args:
        arch: variant name or custom dict (keys ``embed_dims, depths, num_heads,
            mlp_ratios``).
        attn_cfg: one dict for all stages or one per stage. A dict without ``type``
            updates the default ``dict(type='QuadTreeAttention', attn_type='B',
            num_levels=(4, 3, 2, 1)[i], topk=32, value_act='relu')``, e.g.
            ``dict(topk=8, value_act='gelu')`` for the classification setting or
            ``dict(attn_type='A')``; a dict with ``type`` replaces it.
        drop_path_rate: stochastic depth (0.1 in all official dense configs).
        **kwargs: the other arguments of ``FLattenPVTv2`` (``in_channels``, ``qkv_bias``,
            ``drop_rate``, ``out_indices``, ``frozen_stages``, ``with_cp``,
            ``recompute_mlp_act``, ``init_cfg``...).
    """

    _b = dict(num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4))
    _wide = (64, 128, 320, 512)
    arch_zoo = {
        'b0': dict(embed_dims=(32, 64, 160, 256), depths=(2, 2, 2, 2), **_b),
        'b1': dict(embed_dims=_wide, depths=(2, 2, 2, 2), **_b),
        'b2': dict(embed_dims=_wide, depths=(3, 4, 6, 3), **_b),
        'b3': dict(embed_dims=_wide, depths=(3, 4, 18, 3), **_b),
        'b4': dict(embed_dims=_wide, depths=(3, 8, 27, 3), **_b),
        'a-b0': dict(embed_dims=(32, 64, 160, 256), depths=(2, 2, 2, 2), attn_type='A', **_b),
    }
    default_attn_cfg = _quadtree_cfgs()

    def __init__(self,
                 arch: Union[str, dict] = 'b0',
                 attn_cfg: Optional[Union[dict, Sequence[dict]]] = None,
                 drop_path_rate: float = 0.1,
                 **kwargs) -> None:
        zoo_attn_type = None
        if isinstance(arch, str) and arch.lower() in self.arch_zoo:
            zoo_attn_type = self.arch_zoo[arch.lower()].get('attn_type')
        if zoo_attn_type is not None:
            stage_cfgs = expand_per_stage(attn_cfg if attn_cfg is not None else {},
                                          self.num_stages, 'attn_cfg')
            for cfg in stage_cfgs:
                if 'type' not in cfg:
                    cfg.setdefault('attn_type', zoo_attn_type)
            attn_cfg = stage_cfgs
        super().__init__(arch=arch, attn_cfg=attn_cfg, drop_path_rate=drop_path_rate,
                         **kwargs)
