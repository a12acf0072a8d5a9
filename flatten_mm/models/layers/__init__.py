"""Attention operators and building blocks (plain PyTorch, no OpenMMLab imports).

Every attention operator has the interface ``forward(x: (B, N, C), hw_shape) -> (B, N, C)``
and the constructor arguments ``embed_dims, num_heads, qkv_bias, attn_drop, proj_drop``
(plus its own). ``build_attention`` turns a config dict into an operator; it is what the
backbones use for their per-stage ``attn_cfg``.
"""
import copy
import inspect
from typing import Callable, Dict, Optional, Type, Union

import torch.nn as nn

from .ffn import PVTMlp
from .focused_linear_attention import (FocusedLinearAttention, FocusedLinearAttentionQKV,
                                       FocusedLinearQKV)
from .lepe_attention import CrossShapedAttention, LePEAttention
from .patch_embed import PVTPatchEmbed
from .pos_embed import resize_pos_table
from .quadtree_attention import QuadTreeAttention
from .shape import nchw_to_nlc, nlc_to_nchw
from .sima_attention import SimAAttention
from .softmax_attention import SpatialReductionAttention
from .transformer_block import PreNormBlock
from .window_attention import ShiftedWindowAttention
from .xcit_layers import LPI, ConvPatchEmbed, FourierPositionalEncoding

ATTENTIONS: Dict[str, Type[nn.Module]] = {}


def register_attention(cls: Type[nn.Module]) -> Type[nn.Module]:
    """Make ``cls`` buildable by name (``'X'`` or ``'flatten_mm.X'``) in ``attn_cfg``."""
    ATTENTIONS[cls.__name__] = cls
    return cls


for _cls in (FocusedLinearAttention, SpatialReductionAttention, SimAAttention,
             QuadTreeAttention, FocusedLinearAttentionQKV, ShiftedWindowAttention,
             CrossShapedAttention):
    register_attention(_cls)


def build_attention(cfg: Union[dict, Callable], **defaults) -> nn.Module:
    """Build an attention operator.

    Args:
        cfg: ``dict(type=NAME_OR_CLASS, **kwargs)``; ``NAME`` may carry the
            ``flatten_mm.`` scope prefix. Keys in ``cfg`` override ``defaults``.
        **defaults: arguments the backbone supplies (``embed_dims``, ``num_heads``...).
            A default is only passed when the operator's constructor accepts it, and
            ``attn_drop`` only to operators with attention dropout (see
            ``has_attention_dropout``).
    """
    cfg = copy.deepcopy(dict(cfg))
    if 'type' not in cfg:
        raise ValueError(f'attention config needs a "type": {cfg}')
    op = cfg.pop('type')
    if isinstance(op, str):
        name = op.split('.', 1)[1] if op.startswith('flatten_mm.') else op
        if name not in ATTENTIONS:
            raise KeyError(f'unknown attention type {op!r}; available: {sorted(ATTENTIONS)}')
        op = ATTENTIONS[name]
    params = inspect.signature(op.__init__).parameters
    if 'attn_drop' in defaults and not has_attention_dropout(op, cfg):
        # the backbone's attn_drop_rate is for operators with an attention map (as in the
        # official models, whose FLA stages accept and ignore it); an attn_drop set in
        # ``cfg`` itself still reaches the operator, which refuses it
        defaults = {k: v for k, v in defaults.items() if k != 'attn_drop'}
    kwargs = {k: v for k, v in defaults.items() if k in params}
    kwargs.update(cfg)
    return op(**kwargs)


def has_attention_dropout(op: Type[nn.Module], cfg: Optional[dict] = None) -> bool:
    """Whether operator class ``op`` built from ``cfg`` (without ``type``) applies
    attention-weight dropout. Operators declare it with a classmethod
    ``has_attention_dropout(cfg)``; operators without one are assumed to have it."""
    fn = getattr(op, 'has_attention_dropout', None)
    return True if fn is None else bool(fn(dict(cfg or {})))


__all__ = [
    'ATTENTIONS', 'FocusedLinearAttention', 'PVTMlp', 'PVTPatchEmbed',
    'SpatialReductionAttention', 'build_attention', 'nchw_to_nlc', 'nlc_to_nchw',
    'has_attention_dropout', 'register_attention', 'resize_pos_table', 'QuadTreeAttention',
    'SimAAttention', 'ConvPatchEmbed', 'FourierPositionalEncoding', 'LPI',
    'FocusedLinearAttentionQKV', 'FocusedLinearQKV', 'CrossShapedAttention', 'LePEAttention',
    'PreNormBlock', 'ShiftedWindowAttention'
]
