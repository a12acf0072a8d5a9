"""Mixed precision: bf16 autocast training on CPU for every backbone, and fp16 / bf16
autocast outputs of every attention operator and backbone against fp32.

mmengine's ``AmpOptimWrapper`` (``tools/train.py --amp``) is CUDA-only; on CPU we wrap
forward and loss in ``torch.autocast('cpu', dtype=torch.bfloat16)`` ourselves, as a
custom loop would. The ``--amp`` run itself is in ``test_distributed_resume.py`` and
needs a CUDA device.

Accuracy checks run at realistic widths, never on the tiny test archs. A tiny arch
(``embed_dims`` 8-32, LayerNorms over 8 channels, head dim 8) is badly conditioned: it
amplifies the rounding of the low-precision kernels by an amount that depends on the
CPU's kernels, not on our code -- the same tiny PVTv2 gives a bf16 relative L2 error of
0.008 on an AMD EPYC (AVX2) and 0.055-0.143 on an Intel Xeon with AMX, while the real b0
arch gives 0.005-0.010 on that Xeon and every operator ~0.004. So:

* operators at a detection-size map (50x84 tokens, the stride-16 map of an 800x1344
  image) with C=64 and head dim 32: bf16 <= 1e-2, fp16 <= 2e-3; QuadTree, whose top-k
  selection may flip between near-equal scores in low precision, bf16 <= 4e-2, fp16 <=
  2e-2;
* whole backbones at the widths of their smallest official variant (``REALISTIC_ARCHS``)
  at 224x320: bf16 <= 3e-2, fp16 <= 1.5e-2 (measured: see ``REALISTIC_ARCHS``);
* tiny archs only where no accuracy is asserted (finite training steps).

Errors are relative L2, ``||out - ref|| / ||ref||``, against the fp32 output of the same
module; unit-scale inputs as after a LayerNorm.
"""
import pytest
import torch
import torch.nn as nn

from backbone_specs import build, registered_backbones
from reliability_report import record

from flatten_mm.models.layers import ATTENTIONS, build_attention
from flatten_mm.registry import MODELS

NAMES = registered_backbones()
DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}

#: operator -> (config at detection size, {dtype: tolerance}); new operators must be added
OP_CFGS = {
    'FocusedLinearAttention': (dict(sr_ratio=1, focusing_factor=3, kernel_size=5), {}),
    'FocusedLinearAttentionQKV': (dict(window_size=None, focusing_factor=3, kernel_size=5), {}),
    'SpatialReductionAttention': (dict(sr_ratio=2), {}),
    'SimAAttention': (dict(), {}),
    'QuadTreeAttention': (dict(attn_type='B', num_levels=3, topk=8),
                          {'bf16': 4e-2, 'fp16': 2e-2}),
    'ShiftedWindowAttention': (dict(window_size=7, shift=True), {}),
    'CrossShapedAttention': (dict(split_size=7, branch_cfg=dict(type='LePEAttention')), {}),
}
OP_TOL = {'bf16': 1e-2, 'fp16': 2e-3}
BACKBONE_TOL = {'bf16': 3e-2, 'fp16': 1.5e-2}
DET_HW = (50, 84)
#: class -> constructor kwargs of its smallest official variant, for the accuracy checks.
#: Measured bf16 / fp16 relative L2 errors at 224x320, seed 0 (AMD EPYC, AVX2,
#: 2026-11-30): FLattenCSWin 0.0122 / 0.0015, FLattenSwin 0.0105 / 0.0013, QuadTreePVTv2
#: 0.0103 / 0.0021, FLattenPVTv2 0.0097 / 0.0012, PVTv2 0.0094 / 0.0012, FLattenPVT
#: 0.0073 / 0.0009, SimAXCiT 0.0057 / 0.0008 (bf16 0.006-0.013 over seeds 0-2); the
#: issue reports 0.005-0.010 for PVTv2-b0 on the AMX Xeon. bf16 <= 3e-2 leaves >= 2.4x.
REALISTIC_ARCHS = {
    'FLattenPVTv2': dict(arch='b0'),
    'FLattenPVT': dict(arch='tiny'),
    'PVTv2': dict(arch='b0'),
    'QuadTreePVTv2': dict(arch='b0'),
    'FLattenSwin': dict(arch='t'),
    'FLattenCSWin': dict(arch='t'),
    'SimAXCiT': dict(arch='n12'),
}


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def op_config(name: str):
    if name not in OP_CFGS:
        pytest.fail(f'attention operator {name} has no entry in OP_CFGS of '
                    'tests/test_reliability/test_mixed_precision.py (config + tolerances)')
    return OP_CFGS[name]


@pytest.mark.parametrize('name', NAMES)
def test_bf16_autocast_training_is_finite(name):
    torch.manual_seed(0)
    model = build(name).train()
    heads = nn.ModuleList(nn.Conv2d(c, 4, 1) for c in model.out_channels)
    params = [p for p in model.parameters() if p.requires_grad] + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    S = max(model.min_input_size()[0], 33)
    x = torch.randn(2, 3, S, S + 16)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            outs = model(x)
            loss = sum(((h(o).float() - 0.5)**2).mean() for h, o in zip(heads, outs))
        loss.backward()
        assert torch.isfinite(loss), f'non-finite bf16 loss {loss}'
        no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not no_grad, f'parameters without gradient under bf16: {no_grad[:5]}'
        bad = [n for n, p in model.named_parameters()
               if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert not bad, f'NaN/inf gradients under bf16: {bad[:5]}'
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    record('bf16', name, '3 AdamW steps, bf16 autocast around forward + loss',
           'finite losses ' + ', '.join(f'{v:.4f}' for v in losses) + '; all gradients finite',
           title='bf16 autocast training on CPU')


@pytest.mark.parametrize('op', sorted(ATTENTIONS))
@pytest.mark.parametrize('dtype', sorted(DTYPES))
def test_operator_autocast_matches_fp32_at_detection_size(op, dtype):
    cfg, tols = op_config(op)
    torch.manual_seed(0)
    module = build_attention(dict(type=op, **cfg), embed_dims=64, num_heads=2,
                             pretrain_hw_shape=(56, 56)).eval()
    x = torch.randn(2, DET_HW[0] * DET_HW[1], 64)
    with torch.no_grad():
        ref = module(x, DET_HW)
        with torch.autocast('cpu', dtype=DTYPES[dtype]):
            out = module(x, DET_HW)
        # large activations (x100) must not overflow fp16 / bf16 into inf / NaN
        with torch.autocast('cpu', dtype=DTYPES[dtype]):
            big = module(100 * x, DET_HW)
    err = rel_l2(out, ref)
    assert torch.isfinite(out).all() and torch.isfinite(big).all()
    assert err <= tols.get(dtype, OP_TOL[dtype]), f'{op} {dtype}: relative L2 error {err:.2e}'


def realistic(name: str) -> nn.Module:
    """The backbone ``name`` at the widths of its smallest official variant, eval mode."""
    if name not in REALISTIC_ARCHS:
        pytest.fail(f'{name} has no entry in REALISTIC_ARCHS of '
                    'tests/test_reliability/test_mixed_precision.py (its smallest official '
                    'variant: accuracy under autocast is checked at realistic widths)')
    return MODELS.build(dict(type=f'flatten_mm.{name}', **REALISTIC_ARCHS[name])).eval()


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('dtype', sorted(DTYPES))
def test_backbone_autocast_matches_fp32(name, dtype):
    torch.manual_seed(0)
    model = realistic(name)
    x = torch.randn(1, 3, 224, 320)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast('cpu', dtype=DTYPES[dtype]):
            outs = model(x)
    errs = [rel_l2(o, r) for o, r in zip(outs, ref)]
    assert all(torch.isfinite(o).all() for o in outs)
    assert max(errs) <= BACKBONE_TOL[dtype], f'{name} {dtype}: relative L2 errors {errs}'
