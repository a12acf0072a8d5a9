"""FLOP counting (flatten_mm.analysis.flops): per-operator formulas, scaling, whole models.

Three independent references:
* hand-derived closed forms of every operator at two sizes (below, written per operator
  from the maths in shared/spec/attention.md, not from flops.py);
* torch's dispatcher-level counter (``torch.utils.flop_counter.FlopCounterMode``, which
  sees every matmul / conv / linear actually executed, 2 FLOPs per multiply-add) for the
  product terms, per operator and for whole backbones / detectors ("exactly once").
  These reference runs keep autograd on and QuadTree's compiled CPU kernels off: its
  no-grad fast path aggregates values with a weighted ``embedding_bag`` and the kernels
  do the products in C++ (the same multiply-adds), which torch's counter does not see;
* mmengine's jit ``FlopAnalyzer`` for the hook conventions of ordinary layers.
"""
import math

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from flatten_mm.analysis.flops import (ATTENTION_FLOPS, PRODUCT_CATEGORIES, FlopCounter,
                                       attention_flops, by_category, count_flops)
from flatten_mm.models.backbones import PVTv2
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels
from flatten_mm.models.layers import (ATTENTIONS, CrossShapedAttention, FocusedLinearAttention,
                                      FocusedLinearAttentionQKV, QuadTreeAttention,
                                      ShiftedWindowAttention, SimAAttention,
                                      SpatialReductionAttention)

torch.set_num_threads(1)
C, HEADS, B = 32, 2, 2
D = C // HEADS
SIZES = [(8, 12), (16, 24)]  # two sizes, 4x the tokens


def pad(x, m):
    return x + (-x) % m


# ---------------------------------------------------------------- hand-derived formulas
def fla_kernel_and_attention(Bq, N, n, p=3):
    """phi_p on q (N tokens) and k (n tokens), then Q (K^T V / n) / (Q . mean K + eps)."""
    phi = lambda t: (p + 3) * t * C + 2 * t * C + 2 * t  # elementwise + two L2 norms
    return Bq * (phi(N) + phi(n)            # feature maps
                 + n * C + C                # mean of K
                 + N * C                    # q . mean(K)
                 + 2 * HEADS * N            # + eps, reciprocal
                 + 2 * n * C                # K, V times n^-1/2
                 + n * C * D + N * C * D    # K^T V, Q (K^T V)
                 + N * C)                   # times z


def hand_fla(H, W, sr=1, k=5):
    N = H * W
    n = (H // sr) * (W // sr)
    f = B * (N * C * C + n * 2 * C * C + N * C * C)  # q, kv, proj
    f += B * n * C  # + positional encoding
    if sr > 1:
        f += B * (n * C * C * sr * sr + 5 * n * C)  # sr conv + LayerNorm
        f += 2 * B * N * C  # V interpolated to N tokens
    f += fla_kernel_and_attention(B, N, n)
    return f + B * (N * C * k * k + N * C)  # DWC + add


def hand_sra(H, W, sr):
    N, n = H * W, (H // sr) * (W // sr)
    f = B * (N * C * C + n * 2 * C * C + N * C * C)
    if sr > 1:
        f += B * (n * C * C * sr * sr + 5 * n * C)
    return f + B * (2 * N * n * C + 4 * HEADS * N * n)  # QK^T, AV; temperature + softmax


def hand_sima(H, W, order):
    N = H * W
    f = B * (4 * N * C * C + 2 * (2 * N * C + C))  # qkv + proj, L1 norms of q and k
    return f + B * (2 * N * C * D if order == 'kv_first' else 2 * N * N * C)


def hand_fla_qkv(H, W, window=None, k=5):
    if window is None:
        Bq, n, Np = B, H * W, H * W
    else:
        Hp, Wp = pad(H, window), pad(W, window)
        Bq, n, Np = B * (Hp // window) * (Wp // window), window**2, Hp * Wp
    return (B * 4 * Np * C * C + Bq * n * C + fla_kernel_and_attention(Bq, n, n)
            + Bq * (n * C * k * k + n * C))


def hand_swin(H, W, w):
    Hp, Wp = pad(H, w), pad(W, w)
    nW, n = (Hp // w) * (Wp // w), w * w
    return B * 4 * Hp * Wp * C * C + B * nW * (2 * n * n * C + 5 * HEADS * n * n)


def hand_cswin(H, W, s):
    f = B * 4 * H * W * C * C
    Cb, hb = C // 2, HEADS // 2
    for rh, rw in ((H, s), (s, W)):  # vertical and horizontal stripes
        Bq = B * (pad(H, rh) // rh) * (pad(W, rw) // rw)
        n = rh * rw
        f += Bq * (2 * n * n * Cb + 4 * hb * n * n + 9 * n * Cb + n * Cb)  # attn + LePE
    return f


def hand_cswin_fla(H, W, k=5):
    N = H * W
    return (B * 4 * N * C * C + B * N * C + fla_kernel_and_attention(B, N, N)
            + B * (N * C * k * k + N * C) + B * (9 * N * C + N * C))  # + DWC + LePE


def hand_quadtree(H, W, variant, S=3, K=4):
    N0 = H * W
    Ns = [N0 // 4**t for t in range(S)]  # finest ... coarsest
    L = Ns[-1]
    f = B * (3 * N0 * C * C + N0 * C * C)  # q/k/v 1x1 convs, proj
    f += B * 2 * C * (Ns[0] + Ns[1])  # avg-pool pyramid of q and k
    if variant == 'B':
        f += B * (5 * C * (Ns[0] + Ns[1]) + 5 * C * (Ns[1] + Ns[2]))  # GroupNorms
        f += B * (Ns[1] + Ns[2]) * C * C * 5  # 2x2/2 conv + 1x1 conv per value branch
        f += B * 9 * C * sum(Ns)  # LePE per level
        f += B * 2 * C * sum(Ns)  # + LePE, * level weight
    else:
        f += B * C * (Ns[0] + Ns[1])  # avg-pool pyramid of v
    f += B * (2 * L * L * C + 4 * HEADS * L * L + HEADS * L * L)  # coarsest + top-K
    for M, final in ((Ns[1], False), (Ns[0], True)):
        scores = HEADS * M * 4 * K
        f += B * (2 * M * 4 * K * C + 4 * scores)  # gathered QK, AV; temperature, softmax
        f += B * scores * ((variant == 'A') + (not final))  # redistribution, top-K
    return f + B * C * (Ns[0] + Ns[1])  # coarse-to-fine merge adds


def build(name):
    return {
        'fla': (FocusedLinearAttention(C, HEADS, pretrain_hw_shape=(8, 8)), hand_fla),
        'fla-sr2': (FocusedLinearAttention(C, HEADS, sr_ratio=2, pretrain_hw_shape=(8, 8)),
                    lambda H, W: hand_fla(H, W, sr=2)),
        'sra-sr2': (SpatialReductionAttention(C, HEADS, sr_ratio=2),
                    lambda H, W: hand_sra(H, W, 2)),
        'sra-global': (SpatialReductionAttention(C, HEADS), lambda H, W: hand_sra(H, W, 1)),
        'sima-kv': (SimAAttention(C, HEADS, order='kv_first'),
                    lambda H, W: hand_sima(H, W, 'kv_first')),
        'sima-qk': (SimAAttention(C, HEADS, order='qk_first'),
                    lambda H, W: hand_sima(H, W, 'qk_first')),
        'fla-qkv-global': (FocusedLinearAttentionQKV(C, HEADS, pretrain_hw_shape=(8, 8)),
                           hand_fla_qkv),
        'fla-qkv-window': (FocusedLinearAttentionQKV(C, HEADS, window_size=5, shift=True),
                           lambda H, W: hand_fla_qkv(H, W, window=5)),
        'swin': (ShiftedWindowAttention(C, HEADS, window_size=5, shift=True),
                 lambda H, W: hand_swin(H, W, 5)),
        'cswin-stripes': (CrossShapedAttention(C, HEADS, split_size=3),
                          lambda H, W: hand_cswin(H, W, 3)),
        'cswin-fla': (CrossShapedAttention(C, HEADS, branch_cfg=dict(type='FocusedLinearQKV',
                                                                     lepe=True),
                                           pretrain_hw_shape=(8, 8)), hand_cswin_fla),
        'quadtree-b': (QuadTreeAttention(C, HEADS, num_levels=3, topk=4),
                       lambda H, W: hand_quadtree(H, W, 'B')),
        'quadtree-a': (QuadTreeAttention(C, HEADS, attn_type='A', num_levels=3, topk=4),
                       lambda H, W: hand_quadtree(H, W, 'A')),
    }[name]


OPS = ['fla', 'fla-sr2', 'sra-sr2', 'sra-global', 'sima-kv', 'sima-qk', 'fla-qkv-global',
       'fla-qkv-window', 'swin', 'cswin-stripes', 'cswin-fla', 'quadtree-b', 'quadtree-a']


def test_every_operator_has_a_formula():
    missing = [n for n, cls in ATTENTIONS.items()
               if not any(issubclass(cls, k) for k in ATTENTION_FLOPS)]
    assert not missing


@pytest.mark.parametrize('hw', SIZES)
@pytest.mark.parametrize('op', OPS)
def test_formula_equals_hand_derivation(op, hw):
    module, hand = build(op)
    assert sum(attention_flops(module, (B, hw[0] * hw[1], C), hw).values()) == hand(*hw)


@pytest.mark.parametrize('hw', SIZES + [(13, 10)])
@pytest.mark.parametrize('op', OPS)
def test_products_equal_torch_dispatch_count(op, hw):
    """Every matmul / conv / linear the implementation executes, counted by torch."""
    module, _ = build(op)
    x = torch.randn(B, hw[0] * hw[1], C)
    terms = by_category(attention_flops(module.eval(), x.shape, hw))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, \
            cpu_kernels.use_cpu_kernels(False):
        module(x, hw)  # autograd on, CPU kernels off: see the module docstring
    assert sum(terms[c] for c in PRODUCT_CATEGORIES) == fc.get_total_flops() // 2


def _attention_products(op, hw):
    module, _ = build(op)
    f = attention_flops(module, (B, hw[0] * hw[1], C), hw)
    return sum(v for k, v in f.items() if k.startswith('matmul:'))


@pytest.mark.parametrize('op,exponent', [
    ('fla', 1.0), ('fla-qkv-global', 1.0), ('cswin-fla', 1.0),  # linear attention
    ('sima-kv', 1.0), ('fla-qkv-window', 1.0), ('swin', 1.0),  # linear / windows
    ('sra-global', 2.0), ('sra-sr2', 2.0), ('sima-qk', 2.0),  # softmax: quadratic
])
def test_attention_scaling(op, exponent):
    """Attention products vs token count N (4x the tokens between the sizes; window and
    stripe sizes divide both grids, so padding does not blur the exponents)."""
    (h1, w1), (h2, w2) = (20, 30), (40, 60)
    ratio = _attention_products(op, (h2, w2)) / _attention_products(op, (h1, w1))
    assert math.log(ratio, 4) == pytest.approx(exponent, abs=1e-9)


def test_stripes_scale_with_n_times_side():
    """CSWin stripes: each token attends to a stripe of length H (or W): N^1.5."""
    ratio = _attention_products('cswin-stripes', (24, 24)) / _attention_products(
        'cswin-stripes', (12, 12))
    assert math.log(ratio, 4) == pytest.approx(1.5, abs=1e-9)


def test_quadtree_fine_levels_linear_coarsest_quadratic():
    module, _ = build('quadtree-b')
    f1 = attention_flops(module, (B, 16 * 24, C), (16, 24))
    f2 = attention_flops(module, (B, 32 * 48, C), (32, 48))
    for term in ('matmul:gathered_qk', 'matmul:gathered_av'):
        assert f2[term] == 4 * f1[term]
    assert f2['matmul:qk'] == 16 * f1['matmul:qk']
    # and K-proportional: doubling top-K doubles the gathered products
    m8 = QuadTreeAttention(C, HEADS, num_levels=3, topk=8)
    f8 = attention_flops(m8, (B, 16 * 24, C), (16, 24))
    assert f8['matmul:gathered_qk'] == 2 * f1['matmul:gathered_qk']


# ---------------------------------------------------------------- whole models
TINY = dict(embed_dims=(16, 16, 32, 32), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2),
            mlp_ratios=(2, 2, 2, 2))
HYBRID = [dict(type='QuadTreeAttention', num_levels=2, topk=2), dict(type='FocusedLinearAttention'),
          dict(type='SimAAttention'), dict(type='CrossShapedAttention', split_size=2)]


def _tiny_backbones():
    from flatten_mm.models.backbones import FLattenSwin, SimAXCiT
    return {
        'pvt-hybrid': PVTv2(arch=TINY, attn_cfg=HYBRID, pretrain_img_size=64),
        'pvt-window': PVTv2(arch=TINY, pretrain_img_size=64, attn_cfg=[
            dict(type='ShiftedWindowAttention', window_size=4, shift=True),
            dict(type='FocusedLinearAttentionQKV', window_size=4), dict(sr_ratio=1),
            dict(type='CrossShapedAttention',
                 branch_cfg=dict(type='FocusedLinearQKV', lepe=True))]),
        'swin': FLattenSwin(arch=dict(embed_dims=16, depths=(1, 2, 2, 1), num_heads=(1, 2, 2, 4),
                                      window_size=4, pretrain_img_size=64)),
        'sima': SimAXCiT(arch=dict(embed_dims=32, depth=4, num_heads=2), patch_size=16,
                         out_indices=(0, 1, 2, 3)),
    }


@pytest.mark.parametrize('name', ['pvt-hybrid', 'pvt-window', 'swin', 'sima'])
def test_whole_backbone_counts_each_product_once(name):
    model = _tiny_backbones()[name].eval()
    x = torch.randn(1, 3, 65, 97)
    report = count_flops(model, x)
    cats = report.categories()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, \
            cpu_kernels.use_cpu_kernels(False):
        model(x)
    assert sum(cats[c] for c in PRODUCT_CATEGORIES) == fc.get_total_flops() // 2
    # total = hooks of the ordinary layers + the analytic operator counts
    ops = [m for m in model.modules() if type(m) in ATTENTION_FLOPS]
    analytic = report.attention_total
    layers = sum(sum(c.values()) for n, c in report.by_module.items()
                 if n not in report.attention)
    assert report.total == layers + analytic
    assert report.total >= analytic > 0 and len(report.attention) >= 4 and ops
    # the operators' own child layers were measured but not added; hooks can see at most
    # the projections and depth-wise convs of the formulas (less where the implementation
    # calls them functionally)
    dw = sum(v for n in report.attention for k, v in report.by_module[n].items()
             if k in ('conv:dwc', 'conv:lepe'))
    assert 0 <= (report.hidden_measured or 0) <= report.hooks_only + dw
    # stubbing the operators (shape-only counting) changes no count
    stubbed = count_flops(model, x, stub_attention=True)
    assert stubbed.by_module == report.by_module and stubbed.hidden_measured is None


def test_operator_formula_matches_its_hook_record():
    """Each operator call is recorded with exactly its formula (no hook inside adds)."""
    model = PVTv2(arch=TINY, attn_cfg=HYBRID, pretrain_img_size=64).eval()
    seen = {}
    with torch.no_grad(), FlopCounter(model) as counter:
        hooks = []
        for name, m in model.named_modules():
            if name in counter.report.attention:
                hooks.append(m.register_forward_hook(
                    lambda mod, a, o, name=name: seen.__setitem__(
                        name, attention_flops(mod, a[0].shape, a[1]))))
        model(torch.randn(1, 3, 64, 96))
        for h in hooks:
            h.remove()
    assert seen and all(counter.report.by_module[n] == f for n, f in seen.items())


def test_layer_hooks_match_mmengine_flop_analyzer():
    from mmengine.analysis import FlopAnalyzer

    class Plain(nn.Module):

        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, 1, 1, groups=4), nn.GroupNorm(4, 16),
                                      nn.ConvTranspose2d(16, 8, 2, 2),
                                      nn.Upsample(scale_factor=2, mode='bilinear'),
                                      nn.Conv2d(8, 8, 1), nn.Upsample(scale_factor=0.5),
                                      nn.AdaptiveAvgPool2d(4))
            self.norm = nn.LayerNorm(8)
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            x = self.stem(x).flatten(2).transpose(1, 2)
            return self.fc(self.norm(x))

    model = Plain().eval()
    x = torch.randn(2, 3, 20, 28)
    ours = count_flops(model, x).total
    ref = FlopAnalyzer(model, (x, ))
    ref.unsupported_ops_warnings(False)
    ref.uncalled_modules_warnings(False)
    assert ours == ref.total()


def test_retinanet_from_config_counts_each_product_once(tmp_path):
    pytest.importorskip('mmdet')
    from flatten_mm.apis.forward import build_model, dense_forward
    from flatten_mm.swap.plan import swap_backbone
    from mmengine.config import Config
    out = tmp_path / 'retina.py'
    swap_backbone('mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', 'flatten-pvt-v2-b0', str(out))
    model = build_model(Config.fromfile(str(out)))
    x = torch.randn(1, 3, 128, 160)
    report = count_flops(model, x, dense_forward, stub_attention=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        dense_forward(model, x)
    cats = report.categories()
    assert sum(cats[c] for c in PRODUCT_CATEGORIES) == fc.get_total_flops() // 2
    prefixes = report.by_prefix(1)
    assert set(prefixes) == {'backbone', 'neck', 'bbox_head'}
    assert len(report.attention) == 8  # 2 blocks x 4 stages


def test_foreign_attention_is_reported_as_uncounted():
    """mmdet's own Swin attention has no formula: the report says so."""
    pytest.importorskip('mmdet')
    from mmdet.models.backbones import SwinTransformer
    from flatten_mm.analysis.flops import format_report, count_params
    model = SwinTransformer(embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))
    model.eval()
    report = count_flops(model, torch.randn(1, 3, 64, 64))
    assert report.uncounted == ['ShiftWindowMSA', 'WindowMSA'] and not report.attention
    assert 'no formula for ShiftWindowMSA' in format_report(report, count_params(model))
    ours = count_flops(PVTv2(arch=TINY, attn_cfg=HYBRID, pretrain_img_size=64).eval(),
                       torch.randn(1, 3, 64, 64))
    assert ours.uncounted == []
