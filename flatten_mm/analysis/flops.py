"""Exact FLOP counts of whole detectors / segmentors with custom attention operators.

Module-hook counters (mmcv's ``get_model_complexity_info``) only see ``nn.Conv2d`` /
``nn.Linear`` / norm modules, so the matrix products, normalisations, softmaxes and
top-K selections written as tensor code inside attention operators are missed. Here
every attention operator has an analytic count (``ATTENTION_FLOPS``, keyed by the
operator class and computed from its attributes and the input shape), and
``FlopCounter`` combines them with hook counts of the ordinary layers:

* an attention operator's subtree is counted **only** by its formula (its own Linear /
  Conv / norm children are part of the formula; their hooks are recorded separately
  for comparison, never added to the total);
* every other leaf layer is counted by its hook.

Conventions (fvcore / mmengine ``FlopAnalyzer``; the "FLOPs" of papers in this field are
multiply-adds):

==============================  ========================================================
operation                       count
==============================  ========================================================
Linear / matmul ``(m,k)(k,n)``  ``m k n`` multiply-adds (bias not counted)
Conv                            ``out_elements * C_in / groups * kh * kw``
ConvTranspose                   ``in_elements * C_out / groups * kh * kw``
LayerNorm / GroupNorm           5 per element (4 without affine); BatchNorm (eval) 2
Upsample                        nearest 1, bilinear 4 per output element
(adaptive) average pooling      1 per input element
normalisation inside attention  1 per element for the reduction (square/abs + accumulate),
                                1 per element for each divide/multiply, 1 per row for a
                                sqrt / reciprocal / clamp
softmax                         3 per logit (exp, sum, divide); temperature 1 per logit
element-wise                    1 per element and operation (+eps, division by the FLA
                                scale, power ``p`` = ``p - 1`` multiplies, adds of
                                DWC / LePE / positional tables / level messages)
top-K selection                 1 comparison per candidate
==============================  ========================================================

Products (linear / conv / matmul terms) are exactly what the implementations execute
(tests compare them with ``torch.utils.flop_counter``); element-wise and normalisation
terms follow each operator's reference formulation (``shared/spec/attention.md``), of
which a fused implementation may execute slightly fewer.

Not counted (as in fvcore/mmcv): activations, dropout, residual additions, reshapes,
gathers / index arithmetic (QuadTree's gathered products are counted as products),
operations on parameters alone (softplus of the FLA scale, resizing a positional table,
relative-position-bias lookup), functional ops outside attention operators
(``F.interpolate`` in FPN / UperNet, ~0.1 % of a model), mmcv ops (RoIAlign, NMS).
"""
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn

from ..apis.forward import build_model, dense_forward
from ..models.layers import (CrossShapedAttention, FocusedLinearAttention,
                             FocusedLinearAttentionQKV, FocusedLinearQKV, LePEAttention,
                             QuadTreeAttention, ShiftedWindowAttention, SimAAttention,
                             SpatialReductionAttention)

#: categories whose counts ``torch.utils.flop_counter`` also sees (products)
PRODUCT_CATEGORIES = ('linear', 'conv', 'matmul')

#: formula terms of the operators' projection layers: what a module-hook counter sees
#: of an attention operator (plus, depending on how the implementation calls them, its
#: depth-wise convs ``conv:dwc`` / ``conv:lepe``)
MODULE_TERMS = frozenset({
    'linear:q', 'linear:kv', 'linear:qkv', 'linear:proj', 'conv:sr', 'norm:sr_ln',
    'pool:sr', 'conv:qkv_proj', 'conv:value_branch', 'norm:value_gn'
})

Flops = Counter  # term -> count; a term is '<category>:<name>'

FlopFormula = Callable[[nn.Module, Tuple[int, int, int], Tuple[int, int]], Flops]

#: analytic count of each attention operator class: ``fn(module, (B, N, C), (H, W))``
ATTENTION_FLOPS: Dict[Type[nn.Module], FlopFormula] = {}


def register_flops(cls: Type[nn.Module]):
    """Decorator: ``fn(module, x_shape, hw_shape) -> Counter`` is the count of ``cls``."""

    def wrap(fn: FlopFormula) -> FlopFormula:
        ATTENTION_FLOPS[cls] = fn
        return fn

    return wrap


def formula_for(module: nn.Module) -> Optional[FlopFormula]:
    """The formula of ``module``'s class (or of its nearest registered base class)."""
    for cls in type(module).__mro__:
        if cls in ATTENTION_FLOPS:
            return ATTENTION_FLOPS[cls]
    return None


def by_category(flops: Flops) -> Counter:
    """Sum the terms of a count per category (``'matmul:kv'`` -> ``'matmul'``)."""
    out = Counter()
    for term, n in flops.items():
        out[term.split(':', 1)[0]] += n
    return out


def attention_flops(module: nn.Module, x_shape: Sequence[int],
                    hw_shape: Sequence[int]) -> Flops:
    """Analytic count of one call of an attention operator on ``x (B, N, C)`` with grid
    ``hw_shape``, by term. Raises ``KeyError`` for classes without a formula."""
    fn = formula_for(module)
    if fn is None:
        raise KeyError(f'no FLOP formula for {type(module).__name__}; registered: '
                       f'{sorted(c.__name__ for c in ATTENTION_FLOPS)}')
    B, N, C = (int(v) for v in x_shape)
    H, W = (int(v) for v in hw_shape)
    if N != H * W:
        raise ValueError(f'{N} tokens do not match hw_shape {(H, W)}')
    return fn(module, (B, N, C), (H, W))


# ------------------------------------------------------------------------------ pieces
def _kernel_map(elems: int, rows: int, p: int, name: str) -> Flops:
    """FLA feature map ``phi_p`` on ``elems`` entries in ``rows`` tokens: +eps, /scale,
    two full-channel L2 norms, power p, norm restoration (/new norm, *old norm)."""
    return Counter({
        f'elementwise:phi_{name}': (p + 3) * elems,  # +eps, /s, x^p (p-1), /n1, *n0
        f'norm:phi_{name}': 2 * elems + 2 * rows,  # two L2 norms (+ sqrt per row)
    })


def fla_core(Bq: int, N: int, n: int, C: int, h: int, p: int) -> Flops:
    """``focused_linear_core``: kernel on q (N tokens) and k (n tokens), then
    ``Q (K^T V / n) / (Q . mean(K) + eps)`` per head, for ``Bq`` independent regions."""
    d = C // h
    f = _kernel_map(Bq * N * C, Bq * N, p, 'q') + _kernel_map(Bq * n * C, Bq * n, p, 'k')
    f.update({
        'norm:k_mean': Bq * n * C + Bq * C,
        'matmul:q_kmean': Bq * N * C,
        'norm:z': 2 * Bq * h * N,  # + eps, reciprocal
        'elementwise:kv_scale': 2 * Bq * n * C,  # K and V times n^-1/2
        'matmul:kv': Bq * n * C * d,
        'matmul:q_kv': Bq * N * C * d,
        'elementwise:z': Bq * N * C,
    })
    return f


def softmax_core(Bq: int, N: int, n: int, C: int, h: int, bias: bool = False) -> Flops:
    """``softmax(Q K^T / sqrt(d) [+ bias]) V`` for ``Bq`` independent regions."""
    logits = Bq * h * N * n
    f = Counter({
        'matmul:qk': Bq * N * n * C,
        'elementwise:temperature': logits,
        'softmax:attn': 3 * logits,
        'matmul:attn_v': Bq * N * n * C,
    })
    if bias:
        f['elementwise:bias'] = logits
    return f


def _reduction(module: nn.Module, B: int, N: int, C: int, hw: Tuple[int, int]
               ) -> Tuple[Flops, int]:
    """Key/value reduction of PVT attentions (``sr_ratio`` conv + LN, or PVTv2-li
    pooling); returns its count and the key/value token count ``n``."""
    f = Counter()
    if module.linear:
        f['pool:sr'] = B * N * C
        f['conv:sr'] = B * 49 * C * C
        f['norm:sr_ln'] = 5 * B * 49 * C
        return f, 49
    if module.sr_ratio > 1:
        r = module.sr_ratio
        n = (hw[0] // r) * (hw[1] // r)
        f['conv:sr'] = B * n * C * C * r * r
        f['norm:sr_ln'] = 5 * B * n * C
        return f, n
    return f, N


def _dwc(Bq: int, N: int, C: int, k: int) -> Flops:
    return Counter({'conv:dwc': Bq * N * C * k * k, 'elementwise:dwc_add': Bq * N * C})


def _lepe(Bq: int, n: int, C: int) -> Flops:
    return Counter({'conv:lepe': Bq * n * C * 9, 'elementwise:lepe_add': Bq * n * C})


def _padded(extent: int, multiple: int) -> int:
    return extent + (-extent) % multiple


# ------------------------------------------------------------------------------ formulas
@register_flops(SpatialReductionAttention)
def _sra_flops(m: SpatialReductionAttention, x_shape, hw) -> Flops:
    B, N, C = x_shape
    red, n = _reduction(m, B, N, C, hw)
    f = Counter({'linear:q': B * N * C * C, 'linear:kv': B * n * C * 2 * C,
                 'linear:proj': B * N * C * C})
    return f + red + softmax_core(B, N, n, C, m.num_heads)


@register_flops(FocusedLinearAttention)
def _fla_flops(m: FocusedLinearAttention, x_shape, hw) -> Flops:
    B, N, C = x_shape
    red, n = _reduction(m, B, N, C, hw)
    f = Counter({'linear:q': B * N * C * C, 'linear:kv': B * n * C * 2 * C,
                 'linear:proj': B * N * C * C, 'elementwise:pe_add': B * n * C})
    f += red + fla_core(B, N, n, C, m.num_heads, m.focusing_factor)
    if n != N:  # V interpolated along the token sequence to N tokens (2 per output)
        f['elementwise:v_interp'] = 2 * B * N * C
    return f + _dwc(B, N, C, m.dwc.kernel_size[0])


def _fla_region_flops(m, Bq: int, n: int, C: int) -> Flops:
    """``_FocusedLinearRegion.attend_region`` on ``Bq`` regions of ``n`` tokens."""
    f = Counter({'elementwise:pe_add': Bq * n * C})
    f += fla_core(Bq, n, n, C, m.num_heads, m.focusing_factor)
    f += _dwc(Bq, n, C, m.dwc.kernel_size[0])
    if m.get_v is not None:
        f += _lepe(Bq, n, C)
    return f


@register_flops(FocusedLinearAttentionQKV)
def _fla_qkv_flops(m: FocusedLinearAttentionQKV, x_shape, hw) -> Flops:
    B, N, C = x_shape
    if m.window_size is None:
        Bq, n, Np = B, N, N
    else:
        w = m.window_size
        Hp, Wp = _padded(hw[0], w), _padded(hw[1], w)
        Bq, n, Np = B * (Hp // w) * (Wp // w), w * w, Hp * Wp
    f = Counter({'linear:qkv': B * Np * C * 3 * C, 'linear:proj': B * Np * C * C})
    return f + _fla_region_flops(m, Bq, n, C)


@register_flops(FocusedLinearQKV)
def _fla_branch_flops(m: FocusedLinearQKV, x_shape, hw) -> Flops:
    B, N, C = x_shape
    return _fla_region_flops(m, B, N, C)


@register_flops(ShiftedWindowAttention)
def _swin_flops(m: ShiftedWindowAttention, x_shape, hw) -> Flops:
    B, N, C = x_shape
    w = m.window_size
    Hp, Wp = _padded(hw[0], w), _padded(hw[1], w)
    nW, Np = (Hp // w) * (Wp // w), Hp * Wp
    f = Counter({'linear:qkv': B * Np * C * 3 * C, 'linear:proj': B * Np * C * C})
    return f + softmax_core(B * nW, w * w, w * w, C, m.num_heads, bias=True)


@register_flops(LePEAttention)
def _lepe_attn_flops(m: LePEAttention, x_shape, hw) -> Flops:
    Bq, n, C = x_shape
    return softmax_core(Bq, n, n, C, m.num_heads) + _lepe(Bq, n, C)


@register_flops(CrossShapedAttention)
def _cswin_flops(m: CrossShapedAttention, x_shape, hw) -> Flops:
    B, N, C = x_shape
    f = Counter({'linear:qkv': B * N * C * 3 * C, 'linear:proj': B * N * C * C})
    Cb = C // len(m.branches)
    for b, branch in enumerate(m.branches):
        rh, rw = m.stripe(b, hw)
        Hp, Wp = _padded(hw[0], rh), _padded(hw[1], rw)
        Bq = B * (Hp // rh) * (Wp // rw)
        f += formula_for(branch)(branch, (Bq, rh * rw, Cb), (rh, rw))
    return f


@register_flops(SimAAttention)
def _sima_flops(m: SimAAttention, x_shape, hw) -> Flops:
    B, N, C = x_shape
    d = m.head_dims
    f = Counter({'linear:qkv': B * N * C * 3 * C, 'linear:proj': B * N * C * C,
                 # L1 over tokens for q and k: |x| + accumulate, clamp per column, divide
                 'norm:l1_qk': 2 * (2 * B * N * C + B * C)})
    if m.resolved_order(N) == 'kv_first':
        f.update({'matmul:kv': B * N * C * d, 'matmul:q_kv': B * N * C * d})
    else:
        f.update({'matmul:qk': B * N * N * C, 'matmul:attn_v': B * N * N * C})
    return f


@register_flops(QuadTreeAttention)
def _quadtree_flops(m: QuadTreeAttention, x_shape, hw) -> Flops:
    B, N, C = x_shape
    h, S = m.num_heads, m.num_levels
    fdiv = m.size_divisor
    Hp, Wp = _padded(hw[0], fdiv), _padded(hw[1], fdiv)
    tokens = [(Hp >> t) * (Wp >> t) for t in range(S)]  # finest (t=0) ... coarsest
    f = Counter({'conv:qkv_proj': 3 * B * tokens[0] * C * C, 'linear:proj': B * N * C * C})
    for t in range(S - 1):  # pyramid: level t -> t + 1
        f['pool:qk_pyramid'] += 2 * B * C * tokens[t]
        if m.attn_type == 'B':
            f['norm:value_gn'] += 5 * B * C * (tokens[t] + tokens[t + 1])
            f['conv:value_branch'] += B * C * tokens[t + 1] * C * (4 + 1)
        else:
            f['pool:v_pyramid'] += B * C * tokens[t]
    # coarsest level: full softmax attention (+ top-K for the next level)
    L = tokens[-1]
    f += softmax_core(B, L, L, C, h)
    if m.uses_topk:
        f['select:topk'] += B * h * L * L
    # finer levels: each query scores the 4 children of its parent's top-K keys
    for i in range(1, S):
        M = tokens[S - 1 - i]
        cand = 4 * m.topks[i - 1]
        scores = B * h * M * cand
        f['matmul:gathered_qk'] += B * M * cand * C
        f['elementwise:temperature'] += scores
        f['softmax:attn'] += 3 * scores
        if m.attn_type == 'A':
            f['elementwise:score_redistribution'] += scores
        if i < S - 1:
            f['select:topk'] += scores
        f['matmul:gathered_av'] += B * M * cand * C
    # merge coarse -> fine
    if m.attn_type == 'B':
        f['conv:level_lepe'] += sum(B * C * n * 9 for n in tokens)  # functional conv
        f['elementwise:merge'] += sum(2 * B * C * n for n in tokens)  # + LePE, * weight
    f['elementwise:merge'] += sum(B * C * n for n in tokens[:-1])  # upsampled + level
    return f


# ------------------------------------------------------------------------------ layer hooks
def _prod(xs) -> int:
    return int(math.prod(int(x) for x in xs))


def _conv_hook(m: nn.modules.conv._ConvNd, inputs, output) -> Flops:
    k = _prod(m.kernel_size)
    if m.transposed:
        return Counter({'conv:conv': inputs[0].numel() * (m.out_channels // m.groups) * k})
    return Counter({'conv:conv': output.numel() * (m.in_channels // m.groups) * k})


def _linear_hook(m: nn.Linear, inputs, output) -> Flops:
    return Counter({'linear:linear': inputs[0].numel() * m.out_features})


def _bn_hook(m: nn.modules.batchnorm._BatchNorm, inputs, output) -> Flops:
    n = inputs[0].numel()
    if m.training:
        return Counter({'norm:bn': n * (5 if m.affine else 4)})
    return Counter({'norm:bn': n * (2 if m.affine else 1)})


def _affine_norm_hook(m: nn.Module, inputs, output) -> Flops:
    affine = getattr(m, 'elementwise_affine', getattr(m, 'affine', True))
    return Counter({'norm:norm': inputs[0].numel() * (5 if affine else 4)})


def _upsample_hook(m: nn.Upsample, inputs, output) -> Flops:
    per = 1 if m.mode == 'nearest' else 4
    return Counter({'upsample:upsample': output.numel() * per})


def _adaptive_pool_hook(m: nn.Module, inputs, output) -> Flops:
    return Counter({'pool:adaptive_avg': inputs[0].numel()})


#: hook count of each ordinary layer type (first match along the class order)
LAYER_FLOPS: Tuple[Tuple[Tuple[Type[nn.Module], ...], Callable], ...] = (
    ((nn.modules.conv._ConvNd, ), _conv_hook),
    ((nn.Linear, ), _linear_hook),
    ((nn.modules.batchnorm._BatchNorm, ), _bn_hook),
    ((nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm), _affine_norm_hook),
    ((nn.Upsample, ), _upsample_hook),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d), _adaptive_pool_hook),
)


def layer_hook_for(module: nn.Module) -> Optional[Callable]:
    for types, fn in LAYER_FLOPS:
        if isinstance(module, types):
            return fn
    return None


# ------------------------------------------------------------------------------ counter
@dataclass
class FlopReport:
    """Result of a count.

    Attributes:
        by_module: count of every counted module (attention operators and layers) by
            its qualified name, per term.
        attention: names of the attention operators (whose counts are analytic).
        hidden_measured: what the hooks of the attention operators' own child layers
            measured (``None`` when the operators were stubbed and did not run): the
            ``MODULE_TERMS`` part of their formulas plus the depth-wise convs that the
            implementation calls as modules.
    """

    by_module: Dict[str, Flops] = field(default_factory=dict)
    attention: List[str] = field(default_factory=list)
    hidden_measured: Optional[int] = None
    #: classes that look like attention (name contains 'attention' / 'msa') but have no
    #: formula, e.g. mmdet's own ``WindowMSA``: their matmuls are not counted
    uncounted: List[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.by_module.values())

    @property
    def attention_total(self) -> int:
        return sum(sum(self.by_module[n].values()) for n in self.attention)

    @property
    def hooks_only(self) -> int:
        """The part of the attention operators that module hooks see (their projection
        layers, ``MODULE_TERMS``)."""
        return sum(v for n in self.attention for k, v in self.by_module[n].items()
                   if k in MODULE_TERMS)

    @property
    def hooks_total(self) -> int:
        """About what a hook-only counter reports: everything except the attention maths
        (products, normalisations, softmax, DWC/LePE) inside the operators."""
        return self.total - self.attention_total + self.hooks_only

    def categories(self) -> Counter:
        out = Counter()
        for c in self.by_module.values():
            out += by_category(c)
        return out

    def by_prefix(self, depth: int = 1) -> Counter:
        """Totals per module-name prefix of ``depth`` components (``backbone``, ``neck``...)."""
        out = Counter()
        for name, c in self.by_module.items():
            out['.'.join(name.split('.')[:depth]) or '(root)'] += sum(c.values())
        return out


def _add(store: Dict[str, Flops], name: str, flops: Flops) -> None:
    if name in store:
        store[name] = store[name] + flops
    else:
        store[name] = Counter(flops)


class FlopCounter:
    """Context manager that counts every forward of ``model`` run inside it.

    Args:
        model: any ``nn.Module``.
        stub_attention: replace every attention operator's computation by zeros of
            the output shape while counting (its count is analytic and needs only the
            shapes). Much faster on CPU; the values downstream are then meaningless,
            which does not change any count as long as no control flow depends on
            values (true for backbones, necks, dense heads and ``dense_forward``'s fixed
            proposals).
    """

    def __init__(self, model: nn.Module, stub_attention: bool = False) -> None:
        self.model = model
        self.stub_attention = stub_attention
        self.report = FlopReport()
        self._handles = []
        self._stubbed = []

    def __enter__(self) -> 'FlopCounter':
        attention_roots: List[str] = []
        for name, module in self.model.named_modules():
            inside = any(name.startswith(r + '.') for r in attention_roots)
            if not inside and formula_for(module) is not None:
                attention_roots.append(name)
                self.report.attention.append(name)
                self._handles.append(module.register_forward_hook(
                    self._attention_hook(name), with_kwargs=True))
                if self.stub_attention:
                    module.forward = _zeros_like_first
                    self._stubbed.append(module)
                continue
            cls_name = type(module).__name__
            if (not inside and cls_name not in self.report.uncounted
                    and re.search('attention|msa', cls_name, flags=re.I)):
                self.report.uncounted.append(cls_name)
            fn = layer_hook_for(module)
            if fn is not None:
                self._handles.append(module.register_forward_hook(self._layer_hook(name, fn,
                                                                                   inside)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        for m in self._stubbed:
            del m.forward
        self._handles, self._stubbed = [], []

    def _attention_hook(self, name: str):

        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs['x']
            hw = args[-1] if len(args) > 1 else kwargs.get('hw_shape')
            if len(args) == 4:  # region operators: (q, k, v, hw)
                hw = args[3]
            _add(self.report.by_module, name, attention_flops(module, x.shape, hw))

        return hook

    def _layer_hook(self, name: str, fn, hidden: bool):

        def hook(module, inputs, output):
            flops = fn(module, inputs, output)
            if hidden:
                self.report.hidden_measured = (self.report.hidden_measured or 0) + \
                    sum(flops.values())
            else:
                _add(self.report.by_module, name, flops)

        return hook


def _zeros_like_first(*args, **kwargs) -> torch.Tensor:
    x = args[0] if args else next(iter(kwargs.values()))
    return torch.zeros_like(x)


def count_flops(model: nn.Module, inputs: torch.Tensor,
                forward: Optional[Callable] = None, stub_attention: bool = False) -> FlopReport:
    """Count one forward of ``model`` on ``inputs`` (``forward(model, inputs)`` if given,
    else ``model(inputs)``), under ``torch.no_grad``."""
    forward = forward or (lambda m, x: m(x))
    with torch.no_grad(), FlopCounter(model, stub_attention=stub_attention) as counter:
        forward(model, inputs)
    return counter.report


def count_params(model: nn.Module) -> Counter:
    """Parameters per top-level child (and ``'total'``)."""
    out = Counter()
    for name, p in model.named_parameters():
        out[name.split('.', 1)[0]] += p.numel()
        out['total'] += p.numel()
    return out


def model_complexity(cfg, input_hw: Tuple[int, int], stub_attention: bool = True,
                     num_proposals: int = 1000) -> Tuple[FlopReport, Counter]:
    """FLOPs and parameters of the model of an mmdet / mmseg config for one
    ``(1, 3, *input_hw)`` image (``forward.dense_forward``: RoI heads on
    ``num_proposals`` fixed proposals)."""
    model = build_model(cfg)
    x = torch.zeros(1, 3, *input_hw)
    report = count_flops(model, x, lambda m, t: dense_forward(m, t, num_proposals),
                         stub_attention=stub_attention)
    return report, count_params(model)


def format_report(report: FlopReport, params: Counter, title: str = '',
                  skip_params: Sequence[str] = ()) -> str:
    """Human-readable summary (G = 1e9 multiply-adds, M = 1e6 parameters)."""
    lines = [title] if title else []
    parts = ', '.join(f'{k} {v / 1e6:.2f}M' for k, v in params.items()
                      if k != 'total' and k not in skip_params)
    lines.append(f'params: {params["total"] / 1e6:.2f}M ({parts})')
    prefix = report.by_prefix(1)
    lines.append(f'FLOPs:  {report.total / 1e9:.2f}G multiply-adds (' +
                 ', '.join(f'{k} {v / 1e9:.2f}G' for k, v in prefix.most_common()) + ')')
    lines.append(f'        attention operators {report.attention_total / 1e9:.2f}G in '
                 f'{len(report.attention)} calls (analytic); module hooks alone would '
                 f'report {report.hooks_total / 1e9:.2f}G')
    cats = report.categories()
    lines.append('        by category: ' + ', '.join(
        f'{k} {v / 1e9:.2f}G' for k, v in cats.most_common()))
    if report.uncounted:
        lines.append('warning: no formula for ' + ', '.join(report.uncounted) + ': only their '
                     'Linear / Conv layers are counted, not their attention maths')
    return '\n'.join(lines)
