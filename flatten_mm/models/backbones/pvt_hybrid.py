"""PVTv2 with any attention operator in any stage.

``PVTv2`` is the plain PVTv2 (Wang et al., https://arxiv.org/abs/2106.13797; upstream
https://github.com/whai362/PVT, Apache-2.0): the ``PyramidVisionBackbone`` skeleton with
spatial-reduction softmax attention (reduction ratios 8, 4, 2, 1) as its default. Its
``attn_cfg`` (one dict, or one per stage) swaps the operator of any stage for any
registered attention (``flatten_mm.models.layers.ATTENTIONS``), so hybrids need no new
class, e.g. QuadTree in stages 1-2 and softmax SR in 3-4::

    backbone=dict(type='flatten_mm.PVTv2', arch='b1', attn_cfg=[
        dict(type='QuadTreeAttention', num_levels=4, topk=32),
        dict(type='QuadTreeAttention', num_levels=3, topk=32),
        dict(sr_ratio=2),   # no 'type': updates this stage's default (SR attention)
        dict(sr_ratio=1)])
"""
from ...registry import MODELS
from .pvt import FLattenPVTv2, PyramidVisionBackbone

#: the original PVTv2 attention of each stage
PVT_V2_SRA = tuple(
    dict(type='SpatialReductionAttention', sr_ratio=sr) for sr in (8, 4, 2, 1))


@MODELS.register_module()
class PVTv2(PyramidVisionBackbone):
    """PVTv2 (overlapping patch embeddings, depth-wise-conv MLPs, a LayerNorm after every
    stage) with a pluggable attention per stage.

    ``arch``: ``'b0'`` ... ``'b5'`` as :class:`FLattenPVTv2`, or a dict with the keys
    ``embed_dims, depths, num_heads, mlp_ratios``.

    Args:
        attn_cfg: ``None`` (PVTv2's spatial-reduction softmax attention, ratios
            8, 4, 2, 1), one dict for all stages or one per stage. A dict without
            ``type`` updates the stage's default (e.g. ``dict(sr_ratio=1)``); a dict
            with ``type`` replaces it by any registered operator
            (``FocusedLinearAttention``, ``SimAAttention``, ``QuadTreeAttention``,
            ``ShiftedWindowAttention``, ``CrossShapedAttention``, ...). Operators
            receive ``embed_dims, num_heads, qkv_bias, attn_drop, proj_drop, linear,
            pretrain_hw_shape`` when their constructor accepts them.
        **kwargs: the other arguments of :class:`FLattenPVTv2` (``arch``,
            ``in_channels``, ``pretrain_img_size``, ``drop_path_rate``, ``out_indices``,
            ``frozen_stages``, ``with_cp``, ``init_cfg``...).
    """

    arch_zoo = FLattenPVTv2.arch_zoo
    default_attn_cfg = PVT_V2_SRA
