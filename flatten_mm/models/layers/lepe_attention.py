"""Cross-shaped window attention of CSWin with locally-enhanced positional encoding (LePE).

Paper: Dong et al., "CSWin Transformer: A General Vision Transformer Backbone with
Cross-Shaped Windows", CVPR 2022, https://arxiv.org/abs/2107.00652. Upstream:
https://github.com/microsoft/CSWin-Transformer @ f111ae2 (MIT licence; dense padding of
``segmentation/backbone/cswin_transformer.py``), as used by
LeapLabTHU/FLatten-Transformer @ abdb115 (``models/flatten_cswin.py``). Independent
re-implementation of ``shared/spec/attention.md`` §1.3.3-1.3.4 and ``backbones.md``
§1.4 / §5.4.

A CSWin block projects its tokens with one ``qkv`` Linear and hands q, k, v to one or
two *branches*, each attending inside regions of the map:

* ``split_size=None``: one branch with all ``C`` channels and ``h`` heads over the whole
  map (CSWin's last stage; FLatten-CSwin's linear stages);
* ``split_size=s``: two branches with ``C/2`` channels and ``h/2`` heads each; branch 0
  attends inside vertical stripes (full height x ``s``), branch 1 inside horizontal
  stripes (``s`` x full width). The q/k/v maps are zero-padded *centred* to multiples of
  ``s`` (CSWin-seg), the stripes are processed independently (padded tokens take part
  as zero keys/values) and the padding is cropped.

The branches are concatenated (branch 0 first) and projected by ``proj`` (no dropout
after it: the official block defines ``proj_drop`` but does not apply it). A branch is a
region operator ``forward(q, k, v, hw_shape) -> (B, N, Cm)``: ``LePEAttention``
(softmax + LePE) or ``focused_linear_attention.FocusedLinearQKV`` (FLA + DWC + LePE).
"""
import copy
import inspect
from typing import Dict, Optional, Tuple, Type

import torch
import torch.nn as nn
import torch.nn.functional as F

from .conv import token_conv
from .focused_linear_attention import FocusedLinearQKV
from .window import crop_padding, pad_to_multiple, window_partition, window_reverse


class LePEAttention(nn.Module):
    """Softmax attention inside one region plus LePE: ``softmax(q k^T / sqrt(d)) v +
    get_v(V)``, with ``get_v`` a 3x3 depth-wise conv (with bias) on the region's V map.

    Args:
        embed_dims: channels ``Cm`` of q, k, v.
        num_heads: heads ``h``; scale ``(Cm/h)^-0.5``.
        attn_drop: dropout on the attention weights (training only).
    """

    def __init__(self, embed_dims: int, num_heads: int, attn_drop: float = 0.) -> None:
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.attn_drop = attn_drop
        self.get_v = nn.Conv2d(embed_dims, embed_dims, kernel_size=3, padding=1,
                               groups=embed_dims)

    @classmethod
    def has_attention_dropout(cls, cfg: dict) -> bool:
        """Dropout on the softmax weights (``attn_drop``)."""
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: q, k, v ``(B, N, Cm)`` tokens of a region with grid ``hw_shape``.
        Returns ``(B, N, Cm)``."""
        B, N, C = q.shape
        h = self.num_heads
        lepe = token_conv(self.get_v, v, hw_shape)
        q, k, v = (t.reshape(B, N, h, C // h).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        return out.transpose(1, 2).reshape(B, N, C) + lepe.to(out.dtype)

    def extra_repr(self) -> str:
        return f'embed_dims={self.embed_dims}, num_heads={self.num_heads}'


#: region operators a ``CrossShapedAttention`` branch can be built from
BRANCHES: Dict[str, Type[nn.Module]] = {
    'LePEAttention': LePEAttention,
    'FocusedLinearQKV': FocusedLinearQKV,
}


def branch_class(cfg: dict) -> Type[nn.Module]:
    """The region operator class named by ``cfg['type']`` (``flatten_mm.`` prefix allowed)."""
    name = dict(cfg).get('type', None)
    if isinstance(name, str) and name.startswith('flatten_mm.'):
        name = name.split('.', 1)[1]
    if name not in BRANCHES:
        raise KeyError(f'unknown CSWin branch type {name!r}; available: {sorted(BRANCHES)}')
    return BRANCHES[name]


def build_branch(cfg: dict, **defaults) -> nn.Module:
    """Build a region operator from ``dict(type=NAME, ...)``; ``defaults`` are passed
    only when its constructor accepts them, keys of ``cfg`` win."""
    cls = branch_class(cfg)
    cfg = copy.deepcopy(dict(cfg))
    cfg.pop('type')
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in params}
    kwargs.update(cfg)
    return cls(**kwargs)


class CrossShapedAttention(nn.Module):
    """CSWin block attention: ``qkv`` -> branches over stripes or the whole map -> ``proj``.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h`` (split evenly between two branches).
        qkv_bias: bias of ``qkv``.
        attn_drop: attention-weight dropout of softmax branches; must be 0 with branches
            that have none (FLA). There is no dropout after ``proj``: the official CSWin
            block defines ``proj_drop`` but never applies it.
        split_size: stripe width ``s`` (two cross-shaped branches) or ``None`` (one
            branch over the whole map).
        branch_cfg: region operator of the branches, ``dict(type='LePEAttention')``
            (default) or ``dict(type='FocusedLinearQKV', lepe=True, focusing_factor=3,
            kernel_size=5)``. The released FLatten-CSwin models use FLA only with
            ``split_size=None``; FLA on stripes is well defined here (one positional
            table per stripe shape) but has no official reference (the official code
            cannot run it).
        pretrain_hw_shape: stage grid at the pretraining resolution; a branch with a
            positional table (FLA) gets its region at that resolution (the whole grid,
            or the stripe ``(H, s)`` / ``(s, W)``).
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 split_size: Optional[int] = None,
                 branch_cfg: Optional[dict] = None,
                 pretrain_hw_shape: Tuple[int, int] = (56, 56)) -> None:
        super().__init__()
        if split_size is not None and (not isinstance(split_size, int) or split_size < 1):
            raise ValueError(f'split_size must be None or a positive int, got {split_size!r}')
        num_branches = 1 if split_size is None else 2
        if embed_dims % num_branches or num_heads % num_branches:
            raise ValueError(f'two cross-shaped branches need even embed_dims and num_heads, '
                             f'got {embed_dims} and {num_heads}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.split_size = split_size
        branch_cfg = dict(type='LePEAttention') if branch_cfg is None else branch_cfg
        branch_drop = self.has_attention_dropout(dict(branch_cfg=branch_cfg))
        if attn_drop != 0 and not branch_drop:
            raise NotImplementedError(
                f'CrossShapedAttention with {branch_cfg.get("type")} branches has no attention '
                f'dropout (got attn_drop={attn_drop} in its attn_cfg); a backbone\'s '
                'attn_drop_rate only reaches operators that have one')
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims, bias=qkv_bias)
        Hp, Wp = pretrain_hw_shape
        regions = [(Hp, Wp)] if split_size is None else [(Hp, split_size), (split_size, Wp)]
        self.branches = nn.ModuleList(
            build_branch(branch_cfg, embed_dims=embed_dims // num_branches,
                         num_heads=num_heads // num_branches,
                         **(dict(attn_drop=attn_drop) if branch_drop else {}),
                         pretrain_hw_shape=region) for region in regions)
        self.proj = nn.Linear(embed_dims, embed_dims)

    @classmethod
    def has_attention_dropout(cls, cfg: dict) -> bool:
        """Whether the branches of ``cfg['branch_cfg']`` (default LePE softmax) have
        attention dropout."""
        branch_cfg = cfg.get('branch_cfg') or dict(type='LePEAttention')
        try:
            branch = branch_class(branch_cfg)
        except KeyError:
            return True  # the unknown type is reported when the branches are built
        fn = getattr(branch, 'has_attention_dropout', None)
        return True if fn is None else bool(fn(dict(branch_cfg)))

    def stripe(self, branch: int, hw_shape: Tuple[int, int]) -> Tuple[int, int]:
        """Region ``(H_sp, W_sp)`` of ``branch`` on an ``(H, W)`` map."""
        H, W = hw_shape
        if self.split_size is None:
            return H, W
        return (H, self.split_size) if branch == 0 else (self.split_size, W)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        B, N, C = x.shape
        H, W = hw_shape
        if N != H * W:
            raise ValueError(f'token count {N} does not match hw_shape {tuple(hw_shape)}')
        qkv = self.qkv(x)  # (B, N, 3C): [Q | K | V]
        Cb = C // len(self.branches)
        outs = []
        for b, branch in enumerate(self.branches):
            # this branch's channel slice of q, k and v, as one (B, H, W, 3*Cb) map
            sl = qkv.reshape(B, N, 3, C)[..., b * Cb:(b + 1) * Cb].reshape(B, H, W, 3 * Cb)
            region = self.stripe(b, (H, W))
            sl, pads = pad_to_multiple(sl, region, centred=True)
            padded = (sl.shape[1], sl.shape[2])
            q, k, v = window_partition(sl, region).chunk(3, dim=-1)
            out = window_reverse(branch(q, k, v, region), region, padded)
            outs.append(crop_padding(out, pads).reshape(B, N, Cb))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return self.proj(out)  # no dropout here, as in the official CSWin block

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'split_size={self.split_size}')
