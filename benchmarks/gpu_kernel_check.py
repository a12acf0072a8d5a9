"""Check every fused Triton kernel against its PyTorch path on a CUDA GPU (a tool, not a test).

    python benchmarks/gpu_kernel_check.py --out work_dirs/gpu_check
    python benchmarks/gpu_kernel_check.py --out DIR --batch 8 --dtypes fp32,bf16 --compile

For each kernel (``fla``, the FLA core of ``ops.fla_triton``, and
``quadtree``, the finer-level kernels of ``ops.quadtree_triton``; ``--kernels``) and
each of its cases (``FLA_CASES``: the token maps / widths / heads / ``sr_ratio`` of the
FLatten backbones' global FLA stages at a 512² input, up to 128² tokens; ``QT_CASES``: the
QuadTree-PVTv2 stages with finer levels, see ``check_quadtree``; ``DEFAULT_CASES`` +
``QT_DEFAULT_CASES`` unless ``--cases``) and dtype. FLA: forward and the gradients of
``q, k, v, scale, k_pos`` by the kernels and by the PyTorch path, both against the float64
formula on the same (rounded) inputs, with TF32 off; the output with a residual (the DWC
branch, added in the output kernel); and, for the cases without key reduction (first
dtype), the whole operator (``_fla_operator_check``: packed projection, DWC and core, the
projection recomputed in the backward). fp32 passes when the kernels' largest
error (relative to the largest reference value) is within ``--tol`` or twice the PyTorch
path's; bf16 / fp16 when every element is within one rounding of the dtype plus ``--tol``
of the largest value (the kernels accumulate in float32). With ``--compile`` the kernels
also run under ``torch.compile`` (inductor, ``fullgraph=True``; the ``--compile-cases`` in
the first of ``--dtypes``) and must match eager. Unless
``--no-timing``, the median times of forward and forward + backward of kernels, PyTorch path
and plain ReLU linear attention of the same shape are recorded (CUDA events). QuadTree: the
same for the four ops (``qt_gathered_scores``, ``qt_gathered_messages``,
``qt_final_level_b``, ``qt_final_level_a``) on the finest level of the case, plus ``quadtree_attention_core`` A and
B with ``use_triton`` True vs False (first of ``--dtypes``; float32 maths, within
``--tol``): near ties, top-k selections whose margin is below ``--margin-threshold`` and may
flip between two paths, are left out of the comparison where they reach (the tokens below
them; all key / value gradients) and recorded, see ``_qt_core_check``; and the
``QuadTreeAttention`` module A and B with the kernels (its final level on the projected
maps, recomputed in the backward) against ``use_triton=False`` (``_qt_module_check``, the
same near-tie rule). ``--compile``: the
``QuadTreeAttention`` module (float32, same near-tie rule) against eager. Timings: the ops
and the core (B).

Writes ``<out>/gpu_kernel_check.json`` (device, versions, date, one record per case;
rewritten after every case, so a run cut short keeps what it checked; a case that raises is
recorded with its error) and exits 1 if a check failed, 2 without a CUDA device (nothing
is written then).

Ahead-of-time compilation for several GPU generations without a GPU (shared memory,
registers, spills against each target's limits) is ``dev/kernel_limits.py``.
"""
import argparse
import contextlib
import datetime
import json
import os
import os.path as osp
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch  # noqa: E402

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}
UNIT_ROUNDOFF = {'bf16': 2.0**-8, 'fp16': 2.0**-11}

#: name -> (map side in tokens, channels C, heads, sr_ratio): FLA stages at a 512² input
#: (the released FLatten models have no key reduction: ``la_sr_ratios`` 1111, see
#: ``shared/spec/backbones.md``); ``reduced-keys-sr4`` covers ``sr_ratio > 1``
FLA_CASES = {
    'pvt-v2-b0-stage1': (128, 32, 1, 1),
    'pvt-v2-b0-stage2': (64, 64, 2, 1),
    'pvt-v2-b0-stage4': (16, 256, 8, 1),
    'pvt-t-stage1': (128, 64, 1, 1),  # FLatten-PVT: head dim 64
    'swin-t-stage1': (128, 96, 3, 1),
    'swin-t-stage2': (64, 192, 6, 1),
    'cswin-t-branch1': (128, 32, 1, 1),
    'reduced-keys-sr4': (64, 64, 2, 4),
    'head-dim-128': (64, 128, 1, 1),  # the largest head dim check_inputs admits
}
#: checked by default (distinct kernel specialisations: heads 1 / 2 / 3 / 8, head dim 32 /
#: 64, keys reduced or not, the operators' projected path; about 60 Triton compilations, so
#: that a run stays within ~3 min on a fresh machine)
DEFAULT_CASES = ('pvt-v2-b0-stage1', 'swin-t-stage1', 'pvt-v2-b0-stage4', 'pvt-t-stage1',
                 'reduced-keys-sr4')


def _qt_cases() -> Dict[str, tuple]:
    """``name -> (map side, C, heads, levels, topk)`` of every QuadTree-PVTv2 stage with
    finer levels at a 512² input, from the backbone's ``arch_zoo`` and default attention
    (stage ``i`` has stride ``4 * 2**i``): b0 (head dim 32) and b1 (64, as b2-b4)."""
    from flatten_mm.models.backbones.quadtree_pvt import QuadTreePVTv2
    cases = {}
    for arch in ('b0', 'b1'):
        spec = QuadTreePVTv2.arch_zoo[arch]
        for i, (C, h, cfg) in enumerate(zip(spec['embed_dims'], spec['num_heads'],
                                            QuadTreePVTv2.default_attn_cfg)):
            if cfg['num_levels'] > 1:
                cases[f'qt-{arch}-stage{i + 1}'] = (512 // (4 * 2**i), C, h,
                                                    cfg['num_levels'], cfg['topk'])
    return cases


#: name -> (map side, C, heads, levels, topk): QuadTree-PVTv2 stages at a 512² input
QT_CASES = _qt_cases()
#: checked by default: b0 stage 2 (3 levels: all four ops, d = 32, 2 heads) and b1 stage 1
#: (4 levels, d = 64); 2 x 6 kernel specialisations per dtype
QT_DEFAULT_CASES = ('qt-b0-stage2', 'qt-b1-stage1')
KERNELS = ('fla', 'quadtree')
TABLES = {'fla': FLA_CASES, 'quadtree': QT_CASES}
#: kernel -> the selected cases (``args.cases``) of its table, in order
CASES_OF = {k: (lambda args, t=t: [c for c in args.cases if c in t])
            for k, t in TABLES.items()}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', required=True, help='output directory for the JSON')
    parser.add_argument('--kernels', default=','.join(KERNELS),
                        help=f'comma-separated subset of {",".join(KERNELS)}')
    parser.add_argument('--cases', default=','.join(DEFAULT_CASES + QT_DEFAULT_CASES),
                        help=f'comma-separated subset of {",".join(_all_cases())} (each kernel '
                        'checks the cases of its table)')
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--dtypes', default='fp32,bf16', help='comma-separated: fp32,bf16,fp16')
    parser.add_argument('--tol', type=float, default=1e-5,
                        help='error bound relative to the largest reference value')
    parser.add_argument('--compile', action='store_true',
                        help='also run the kernels under torch.compile (inductor)')
    parser.add_argument('--compile-cases', default='swin-t-stage1,qt-b0-stage2',
                        help='the cases that --compile compiles, in the first of --dtypes '
                        '(each compilation takes ~10-30 s)')
    parser.add_argument('--no-timing', action='store_true')
    parser.add_argument('--reps', type=int, default=20, help='timed repetitions')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--margin-threshold', type=float, default=1e-5,
                        help='QuadTree core / compile: below this relative top-k margin '
                        '(k-th vs (k+1)-th weight) a selection may flip between the paths; '
                        'what it reaches is left out of the comparison and recorded')
    parser.add_argument('--safety', action='store_true',
                        help='also the GPU-safety checks (safety_checks): first-use verdicts '
                        'in auto mode, TF32, bitwise repeatability, NaN / Inf, a second '
                        'device, dynamic shapes under torch.compile')
    args = parser.parse_args(argv)
    args.kernels = _choices(args.kernels, KERNELS, 'kernel', parser)
    args.cases = _choices(args.cases, _all_cases(), 'case', parser)
    args.dtypes = _choices(args.dtypes, DTYPES, 'dtype', parser)
    args.compile_cases = _choices(args.compile_cases, _all_cases(), 'case', parser)
    # a kernel none of whose cases is selected is not checked; none at all is an error
    if not any(CASES_OF[kernel](args) for kernel in args.kernels):
        parser.error(f'none of --cases {",".join(args.cases)} belongs to --kernels '
                     f'{",".join(args.kernels)}')
    args.device = 'cuda'
    if args.batch < 1 or args.reps < 1 or not args.tol > 0 or args.margin_threshold < 0:
        parser.error('--batch and --reps must be >= 1, --tol > 0, --margin-threshold >= 0')
    return args


def _all_cases() -> Dict[str, tuple]:
    return {name: spec for table in TABLES.values() for name, spec in table.items()}


def _choices(text: str, allowed, what: str, parser) -> List[str]:
    items = [t.strip() for t in text.split(',') if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        parser.error(f'unknown {what}(s) {bad or text!r}; choose from {", ".join(allowed)}')
    return items


def _max_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def _within_rounding(a: torch.Tensor, ref: torch.Tensor, u: float, tol: float) -> float:
    """Largest excess of ``|a - ref|`` over ``u |ref| + tol max|ref|`` (<= 0: passes)."""
    bound = u * ref.abs() + tol * ref.abs().max()
    return ((a.double() - ref).abs() - bound).max().item()


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _fla_operator_check(case: str, args: argparse.Namespace) -> Dict:
    """The case's FLA operator (``swin*``: FLatten-Swin's ``FocusedLinearAttentionQKV``,
    else FLatten-PVT's ``FocusedLinearAttention``; no key reduction) with the kernels, i.e.
    ``fla_projected_triton`` (packed projection, DWC and core; the projection recomputed
    in the backward): output, input gradient and every parameter gradient against the
    float64 PyTorch path, by the fp32 rule (within ``--tol`` or twice the float32 PyTorch
    path's error), float32 only; with ``--compile`` (its cases) also compiled (inductor,
    ``fullgraph``) against eager."""
    import copy

    from flatten_mm.models.layers import FocusedLinearAttention, FocusedLinearAttentionQKV
    from flatten_mm.models.ops import fla_triton
    side, C, h, _ = FLA_CASES[case]
    dev = getattr(args, 'device', 'cuda')
    torch.manual_seed(args.seed)
    cls = FocusedLinearAttentionQKV if case.startswith('swin') else FocusedLinearAttention
    m = cls(C, h, pretrain_hw_shape=(side, side)).to(dev)
    with torch.no_grad():
        for name, prm in m.named_parameters():
            if name in ('scale', 'positional_encoding') or name.endswith('bias'):
                prm.normal_(0, 0.5)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
    x = torch.randn(args.batch, side * side, C, device=dev, generator=gen)
    g = torch.randn(args.batch, side * side, C, device=dev, generator=gen)
    calls = []
    real = fla_triton.fla_projected_triton

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    def run(module, use_triton, inp, grad):
        if use_triton is not None:
            module.use_triton = use_triton
        module.zero_grad()
        xi = inp.detach().clone().requires_grad_(True)
        out = module(xi, (side, side))
        (out * grad).sum().backward()
        return ([('out', out.detach()), ('dx', xi.grad)]
                + [(f'd{n}', p.grad) for n, p in module.named_parameters()])

    fla_triton.fla_projected_triton = spy
    try:
        kern = run(m, True, x, g)
    finally:
        fla_triton.fla_projected_triton = real
    torch_path = run(m, False, x, g)
    ref = run(copy.deepcopy(m).double(), False, x.double(), g.double())
    rec = dict(module=cls.__name__, projected_path=len(calls) == 1, errors={})
    rec['passed'] = rec['projected_path']
    if args.compile and case in args.compile_cases:
        # the operator compiled as the backbones are (inductor, no graph break), forward and
        # backward (the autograd.Function's), against eager
        torch._dynamo.reset()
        m.use_triton = None
        compiled = torch.compile(m, backend='inductor', fullgraph=True)
        comp = run(compiled, None, x, g)
        diff = max(_max_rel(a, e.double()) for (_, a), (_, e) in zip(comp, kern))
        rec['compile'] = dict(max_rel_vs_eager=diff, passed=diff <= args.tol)
        rec['passed'] &= rec['compile']['passed']
    for (name, a), (_, t), (_, r) in zip(kern, torch_path, ref):
        e = dict(kernels=_max_rel(a, r), pytorch=_max_rel(t, r))
        e['passed'] = bool(e['kernels'] <= max(args.tol, 2 * e['pytorch'])
                           and torch.isfinite(a).all())
        rec['errors'][name] = e
        rec['passed'] &= e['passed']
    return rec


def check_fla(case: str, dtype_name: str, args: argparse.Namespace) -> Dict:
    """One FLA case: errors of kernels and PyTorch path vs float64, optional compile and
    timings."""
    from flatten_mm.models.layers import focused_linear_attention as fla
    side, C, h, sr = FLA_CASES[case]
    B, N = args.batch, side * side
    n = (side // sr)**2
    dtype = DTYPES[dtype_name]
    dev = getattr(args, 'device', 'cuda')  # (the tests run this on CPU, interpreted)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    # q from one projection, k, v as chunks of another (the operators' real strides)
    q = torch.randn(B, N, C, device=dev, generator=gen).to(dtype)
    kv = torch.randn(B, n, 2 * C, device=dev, generator=gen).to(dtype)
    k, v = kv.chunk(2, dim=-1)
    scale = 0.5 * torch.randn(1, 1, C, device=dev, generator=gen)
    pos = 0.3 * torch.randn(1, n, C, device=dev, generator=gen)
    g = torch.randn(B, N, C, device=dev, generator=gen).to(dtype)

    def run(fn, inputs, grad):
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
        return [out.detach()] + [x.detach() for x in grads]

    def core(use_triton):
        return lambda q, k, v, s, p: fla.focused_linear_core(q, k, v, s, h, 3, k_pos=p,
                                                             use_triton=use_triton)

    inputs = [q, k, v, scale, pos]
    ref = run(lambda q, k, v, s, p: fla.focused_linear_core_reference(q, k + p, v, s, h, 3),
              [t.double() for t in inputs], g.double())
    kern = run(core(True), inputs, g)
    torch_path = run(core(False), inputs, g)
    # the DWC branch's residual, added inside the output kernel
    res = torch.randn(B, N, C, device=dev, generator=gen).to(dtype)
    with torch.no_grad():
        kern.append(fla.focused_linear_core(q, k, v, scale, h, 3, k_pos=pos, use_triton=True,
                                            residual=res))
        torch_path.append(fla.focused_linear_core(q, k, v, scale, h, 3, k_pos=pos,
                                                  use_triton=False, residual=res))
    ref.append(ref[0] + res.double())
    names = ['out', 'dq', 'dk', 'dv', 'dscale', 'dpos', 'out+residual']
    rec = dict(kernel='fla', case=case, dtype=dtype_name, batch=B, tokens=N, keys=n,
               channels=C, heads=h, sr_ratio=sr, errors={}, passed=True)
    for name, a, t, r in zip(names, kern, torch_path, ref):
        e = dict(kernels=_max_rel(a, r), pytorch=_max_rel(t, r),
                 finite=bool(torch.isfinite(a).all()))
        if dtype_name == 'fp32' or name == 'dscale' or name == 'dpos':  # fp32 results
            ok = e['kernels'] <= max(args.tol, 2 * e['pytorch'])
        else:
            e['rounding_excess'] = _within_rounding(a, r, UNIT_ROUNDOFF[dtype_name], args.tol)
            ok = e['rounding_excess'] <= 0
        e['passed'] = bool(ok and e['finite'])
        rec['errors'][name] = e
        rec['passed'] &= e['passed']
    if sr == 1 and not case.startswith('cswin') and dtype_name == args.dtypes[0]:
        rec['operator'] = _fla_operator_check(case, args)
        rec['passed'] &= rec['operator']['passed']
    if args.compile and case in args.compile_cases and dtype_name == args.dtypes[0]:
        torch._dynamo.reset()
        # auto mode (use_triton=None), as the backbones run: its dispatch must not break
        # the graph either (fullgraph=True)
        compiled = torch.compile(core(None), backend='inductor', fullgraph=True)
        comp = run(compiled, inputs, g)
        diff = max(_max_rel(a, b.double()) for a, b in zip(comp, kern))
        rec['compile'] = dict(max_rel_vs_eager=diff, passed=diff <= args.tol)
        rec['passed'] &= rec['compile']['passed']
    if not args.no_timing:
        leaves = [t.detach().requires_grad_(True) for t in inputs]

        def fwd(fn):
            return lambda: fn(*leaves)

        def step(fn):
            return lambda: fn(*leaves).backward(g)

        def relu_linear(q, k, v, s, p):  # plain ReLU linear attention, same shapes
            qh = torch.relu(q).view(B, N, h, C // h).transpose(1, 2)
            kh = torch.relu(k + p).view(B, n, h, C // h).transpose(1, 2)
            vh = v.reshape(B, n, h, C // h).transpose(1, 2)
            z = 1 / (qh @ kh.mean(-2, keepdim=True).transpose(-2, -1) + 1e-6)
            return ((qh @ (kh.transpose(-2, -1) @ vh / n)) * z).transpose(1, 2).reshape(B, N, C)

        rec['ms'] = {}
        for label, fn in (('kernels', core(True)), ('pytorch', core(False)),
                          ('relu_linear', relu_linear)):
            rec['ms'][label] = dict(forward=_median_ms(fwd(fn), args.reps),
                                    forward_backward=_median_ms(step(fn), args.reps))
        rec['ratio_kernels_vs_relu_linear'] = {
            k: rec['ms']['kernels'][k] / rec['ms']['relu_linear'][k]
            for k in ('forward', 'forward_backward')}
    return rec


def _grad_run(fn, inputs, grads) -> List[torch.Tensor]:
    """Outputs of ``fn(*inputs)`` (a tensor or a tuple) and the gradients of ``inputs``
    for output gradients ``grads``, all detached."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    gs = torch.autograd.grad(outs, leaves, [g.to(o.dtype) for o, g in zip(outs, grads)])
    return [o.detach() for o in outs] + [x.detach() for x in gs]


def _judge(kern: torch.Tensor, torch_path: torch.Tensor, ref: torch.Tensor, dtype_name: str,
           tol: float) -> Dict:
    """The FLA pass rule for one result: float32 results within ``tol`` or twice the
    PyTorch path's error; bf16 / fp16 results within one rounding plus ``tol``."""
    e = dict(kernels=_max_rel(kern, ref), pytorch=_max_rel(torch_path, ref),
             finite=bool(torch.isfinite(kern).all()))
    if kern.dtype == torch.float32:
        ok = e['kernels'] <= max(tol, 2 * e['pytorch'])
    else:
        e['rounding_excess'] = _within_rounding(kern, ref, UNIT_ROUNDOFF[dtype_name], tol)
        ok = e['rounding_excess'] <= 0
    e['passed'] = bool(ok and e['finite'])
    return e


def _qt_level_inputs(case: str, dtype: torch.dtype, args: argparse.Namespace) -> Dict:
    """The finest level of a QuadTree case as the core hands it to the ops: child queries
    ``(B, h, L, 4, d)`` grouped by parent (the core's strides, pre-scaled by ``d**-0.5``),
    keys / values ``(B, h, M, d)``, softmax weights ``(B, h, L, 4, 4K)``, output
    gradients, B's level weight ``scale`` (0-d; all rounded to ``dtype``; ``K = topk``), the
    ``topk`` distinct random parent-level cells of each parent (``cells``, int32, of a
    grid ``cell_width`` wide: what the core hands the kernels) and their 4 children each,
    the candidates ``(B, h, L, 4K)`` (``_child_candidates``: what the PyTorch path
    takes)."""
    from flatten_mm.models.layers import quadtree_attention as qa
    side, C, h, _, topk = QT_CASES[case]
    B, d, ps = args.batch, C // h, side // 2
    L, M = ps * ps, side * side
    dev = getattr(args, 'device', 'cuda')
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    prev_idx = torch.rand(B, h, L, L, device=dev, generator=gen).topk(topk, dim=-1).indices
    cand = qa.child_candidates(prev_idx, ps)
    cell_width = ps
    q = (qa.group_children(rand(B, C, side, side), h) * d**-0.5).to(dtype)
    k = qa.to_heads(rand(B, C, side, side), h).to(dtype)
    v = qa.to_heads(rand(B, C, side, side), h).to(dtype)
    w = torch.softmax(rand(B, h, L, 4, 4 * topk), dim=-1).to(dtype)
    ps = torch.softmax(rand(B, h, L, topk), dim=-1).to(dtype)  # the coarser level's weights
    scale = (torch.rand((), device=dev, generator=gen) * 0.9 + 0.05).to(dtype)
    return dict(q=q, k=k, v=v, w=w, ps=ps, cand=cand, cells=prev_idx.int(),
                cell_width=cell_width, scale=scale,
                g_scores=rand(B, h, L, 4, 4 * topk).to(dtype),
                g_msg=rand(B, h, L, 4, d).to(dtype), batch=B, heads=h, head_dim=d, parents=L,
                keys=M, candidates=4 * topk)


def _qt_ops(cand: torch.Tensor, cells: torch.Tensor, cell_width: int) -> Dict:
    """op -> (input names, output-gradient name, kernels fn, PyTorch path fn). The kernels
    take the parent cells (``cells`` of a grid ``cell_width`` wide) and derive their
    children as in the core; the PyTorch path takes the candidate rows ``cand``. The level
    weight enters the kernel in float32 (as the core passes it)."""
    from flatten_mm.models.layers import quadtree_attention as qa
    from flatten_mm.models.ops import quadtree_triton as qt

    def final_torch(q, k, v):
        s = qa.gathered_scores(q, k, cand, use_triton=False)
        return qa.gathered_messages(torch.softmax(s, dim=-1), v, cand, use_triton=False)

    def final_a_torch(q, k, v, ps):  # softmax within each candidate parent's 4 children
        s = qa.gathered_scores(q, k, cand, use_triton=False)
        w = torch.softmax(s.unflatten(-1, (ps.shape[-1], 4)), dim=-1)
        w = (w * ps[:, :, :, None, :, None]).flatten(-2)
        return qa.gathered_messages(w, v, cand, use_triton=False)

    pw = cell_width
    return {
        'scores': (('q', 'k'), 'g_scores',
                   lambda q, k: qa.gathered_scores(q, k, cells, use_triton=True,
                                                   parent_width=pw),
                   lambda q, k: qa.gathered_scores(q, k, cand, use_triton=False)),
        'messages': (('w', 'v'), 'g_msg',
                     lambda w, v: qa.gathered_messages(w, v, cells, use_triton=True,
                                                       parent_width=pw),
                     lambda w, v: qa.gathered_messages(w, v, cand, use_triton=False)),
        'final_level_b': (('q', 'k', 'v'), 'g_msg',
                          lambda q, k, v: qt.final_level_b_triton(q, k, v, cells, None, pw),
                          final_torch),
        'final_level_b_scaled': (
            ('q', 'k', 'v', 'scale'), 'g_msg',
            lambda q, k, v, s: qt.final_level_b_triton(q, k, v, cells, s.float(), pw),
            lambda q, k, v, s: final_torch(q, k, v) * s),
        'final_level_a': (('q', 'k', 'v', 'ps'), 'g_msg',
                          lambda q, k, v, ps: qt.final_level_a_triton(q, k, v, cells, ps, pw),
                          final_a_torch),
    }


def _qt_pyramids(case: str, args: argparse.Namespace, seed: int) -> Tuple[list, list, list]:
    side, C, _, S, _ = QT_CASES[case]
    dev = getattr(args, 'device', 'cuda')
    gen = torch.Generator(device=dev).manual_seed(seed)
    return tuple([torch.randn(args.batch, C, side >> (S - 1 - i), side >> (S - 1 - i),
                              device=dev, generator=gen) for i in range(S)] for _ in range(3))


@contextlib.contextmanager
def _near_ties(ties: list, threshold: float, S: int, side: int) -> Iterator[None]:
    """Inside the block every top-k of ``quadtree_attention_core`` (``_record_margin``,
    wrapped; a margin recorder must be set) appends ``(level, (B, h, side_i, side_i)
    booleans)`` to ``ties``: the queries whose relative margin is below ``threshold``."""
    from flatten_mm.models.layers import quadtree_attention as qa
    real_record = qa._record_margin

    def record(recorder, level, probs, k):
        real_record(recorder, level, probs, k)
        top = probs.detach().topk(k + 1, dim=-1).values
        tie = (top[..., k - 1] - top[..., k]) < threshold * top[..., k - 1]
        sl = side >> (S - 1 - level)
        if level > 0:  # (B, h, L, 4) grouped by parent -> raster
            tie = qa.children_to_raster(tie[..., None], (sl, sl))[..., 0]
        ties.append((level, tie.reshape(tie.shape[0], tie.shape[1], sl, sl)))

    qa._record_margin = record
    try:
        yield
    finally:
        qa._record_margin = real_record


def _tie_masks(recorded: list, S: int, side: int,
               whole_trees: bool = False) -> List[torch.Tensor]:
    """Per level ``j``, ``(B, h, side_j**2)`` booleans: the query tokens of level ``j`` whose
    own or whose ancestors' top-k had a margin below the threshold (``recorded``: ``(level,
    (B, h, side_i, side_i) near-tie map)`` pairs from ``_near_ties``). ``whole_trees``:
    every token of the quad-tree (level-0 query and all its descendants) holding a near tie
    (variant A's gradients: a child's selection reaches its ancestors through the weights
    ``prev_score``)."""
    if whole_trees:  # each tie -> its level-0 ancestor
        roots = [(0, torch.nn.functional.max_pool2d(tie.float(), 2**i).bool())
                 for i, tie in recorded]
        recorded = roots
    masks = []
    for j in range(S):
        m = None
        for i, tie in recorded:
            if i > j:
                continue
            r = 2**(j - i)
            up = tie.repeat_interleave(r, -2).repeat_interleave(r, -1).flatten(-2)
            m = up if m is None else m | up
        masks.append(m)
    return masks


def _qt_core_check(case: str, attn_type: str, args: argparse.Namespace) -> Dict:
    """``quadtree_attention_core`` with ``use_triton=True`` vs ``False`` on the case's
    pyramids (float32): output and the gradients of every pyramid map.

    Near ties: a top-k whose k-th and (k+1)-th weights are within ``--margin-threshold``
    (relative) may select differently in the two paths. Every top-k's per-query margins are
    read (``quadtree_attention._record_margin``, wrapped); the output and the query
    gradients are compared except at the tokens whose own or ancestors' top-k was such a
    near tie (their number is recorded; the output of a token depends only on its
    ancestors' selections; A's query gradients: except in the whole quad-trees holding a
    near tie, since a selection also reaches the ancestors through ``prev_score``), the key
    / value gradients only when there is no near tie at all (else recorded as
    ``skipped``). At a 512² input with batch 8, random inputs have
    near ties (smallest margins ~1e-6 among ~10^4-10^5 top-k rows)."""
    from flatten_mm.models.layers import quadtree_attention as qa
    side, C, h, S, topk = QT_CASES[case]
    dev = getattr(args, 'device', 'cuda')
    qs, ks, vs = _qt_pyramids(case, args, args.seed + 1)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 2)
    weights = lepes = None
    if attn_type == 'B':
        weights = torch.softmax(torch.randn(S, device=dev, generator=gen), 0)
        lepes = [torch.randn(v.shape, device=dev, generator=gen) for v in vs]
    g = torch.randn(args.batch, h, side * side, C // h, device=dev, generator=gen)
    margins, ties = [], []

    def core(flag):
        def fn(*maps):
            return qa.quadtree_attention_core(
                maps[:S], maps[S:2 * S], maps[2 * S:], h, (topk, ) * S, attn_type, weights,
                lepes, margin_recorder=lambda lvl, m: margins.append(m), use_triton=flag)
        return fn

    leaves = qs + ks + vs
    with _near_ties(ties, args.margin_threshold, S, side):
        kern = _grad_run(core(True), leaves, [g])
        torch_path = _grad_run(core(False), leaves, [g])
    masks = _tie_masks(ties, S, side)  # (both runs' ties: union)
    dq_masks = masks if attn_type == 'B' else _tie_masks(ties, S, side, whole_trees=True)
    rec = dict(attn_type=attn_type, min_margin=min(margins),
               finite=all(bool(torch.isfinite(t).all()) for t in kern),
               near_tie_tokens=int(masks[-1].sum()), tokens=int(masks[-1].numel()),
               max_rel={}, skipped=[])
    # results as (B, h, tokens, X) rows of one level, with the level's near-tie mask
    rows = [('out', S - 1, kern[0], torch_path[0])]
    rows += [(f'dq{i}', i, qa.to_heads(kern[1 + i], h), qa.to_heads(torch_path[1 + i], h))
             for i in range(S)]
    for name, level, a, b in rows:
        keep = ~(masks if name == 'out' else dq_masks)[level][..., None]
        rec['max_rel'][name] = _max_rel(a * keep, (b * keep).double())
    for i, name in enumerate([f'd{kind}{j}' for kind in 'kv' for j in range(S)]):
        if rec['near_tie_tokens']:
            rec['skipped'].append(name)
        else:
            rec['max_rel'][name] = _max_rel(kern[1 + S + i], torch_path[1 + S + i].double())
    if rec['skipped']:
        rec['skip_reason'] = (f'{rec["near_tie_tokens"]} of {rec["tokens"]} tokens below a '
                              f'near-tie top-k (margin < {args.margin_threshold:.0e}): '
                              'key / value gradients not compared')
    rec['passed'] = rec['finite'] and max(rec['max_rel'].values()) <= args.tol
    return rec


def _qt_module_runner(case: str, attn_type: str, args: argparse.Namespace, seed: int):
    """The case's ``QuadTreeAttention`` module (``attn_type``, its levels / top-k) and
    ``run(fn)``: ``[output, input gradient, parameter gradients...]`` of ``fn(x, hw)`` on a
    fixed input and output gradient (``seed`` offsets the generator)."""
    from flatten_mm.models.layers import QuadTreeAttention
    side, C, h, S, topk = QT_CASES[case]
    dev = getattr(args, 'device', 'cuda')
    torch.manual_seed(args.seed)
    m = QuadTreeAttention(C, h, attn_type=attn_type, num_levels=S, topk=topk).to(dev)
    gen = torch.Generator(device=dev).manual_seed(args.seed + seed)
    x = torch.randn(args.batch, side * side, C, device=dev, generator=gen)
    g = torch.randn(args.batch, side * side, C, device=dev, generator=gen)
    params = list(m.parameters())

    def run(fn):
        xl = x.detach().requires_grad_(True)
        out = fn(xl, (side, side))
        grads = torch.autograd.grad(out, [xl] + params, g)
        return [out.detach()] + [t.detach() for t in grads]
    return m, run


def _module_comparison(a: list, ref: list, ties: list, margins: list, case: str, key: str,
                       args: argparse.Namespace) -> Dict:
    """Record of module results ``a`` against ``ref`` (``_qt_module_runner``'s lists) under
    the near-tie rule: the output outside the tokens below a near tie (any head: ``proj``
    mixes them), the gradients only without any (they mix every token); ``key`` names the
    ``{'out', 'gradients'}`` maximum relative errors."""
    side, _, _, S, _ = QT_CASES[case]
    tie = _tie_masks(ties, S, side)[-1].any(1)  # (B, N)
    rec = dict(dtype='fp32', min_margin=min(margins), near_tie_tokens=int(tie.sum()),
               tokens=int(tie.numel()), finite=all(bool(torch.isfinite(t).all()) for t in a))
    keep = ~tie[..., None]
    rec[key] = {'out': _max_rel(a[0] * keep, (ref[0] * keep).double())}
    if rec['near_tie_tokens']:
        rec['skipped'] = ['gradients']
        rec['skip_reason'] = (f'{rec["near_tie_tokens"]} of {rec["tokens"]} tokens below a '
                              f'near-tie top-k (margin < {args.margin_threshold:.0e})')
    else:
        rec[key]['gradients'] = max(_max_rel(t, r.double()) for t, r in zip(a[1:], ref[1:]))
    rec['passed'] = rec['finite'] and max(rec[key].values()) <= args.tol
    return rec


def _qt_compile_check(case: str, args: argparse.Namespace) -> Dict:
    """The ``QuadTreeAttention`` module (B, the case's levels / top-k, ``use_triton=None``
    as the backbones run it) under ``torch.compile(fullgraph=True)`` against eager: output
    and the gradients of input and parameters, float32. Near ties as in ``_qt_core_check``
    (from the eager run): the output is compared outside the tokens below one, the
    gradients only without any (``_module_comparison``)."""
    side, _, _, S, _ = QT_CASES[case]
    m, run = _qt_module_runner(case, 'B', args, 3)
    margins, ties = [], []
    m.margin_recorder = lambda lvl, mg: margins.append(mg)
    with _near_ties(ties, args.margin_threshold, S, side):
        eager = run(m)
    m.margin_recorder = None  # (a Python callback would break the graph)
    torch._dynamo.reset()
    comp = run(torch.compile(m, backend='inductor', fullgraph=True))
    return _module_comparison(comp, eager, ties, margins, case, 'max_rel_vs_eager', args)


def _qt_module_check(case: str, attn_type: str, args: argparse.Namespace) -> Dict:
    """The ``QuadTreeAttention`` module (the case's levels / top-k) with the kernels, whose
    training forward runs the final level on the projected maps
    (``final_level_projected_triton``: the finest query and key, and A's value, recomputed
    from the block input in the backward), against ``use_triton=False``: output and the
    gradients of input and parameters, float32. Near ties as in ``_qt_compile_check``."""
    from flatten_mm.models.ops import quadtree_triton as qt_triton
    side, _, _, S, _ = QT_CASES[case]
    m, run = _qt_module_runner(case, attn_type, args, 4)
    calls = []
    real = qt_triton.final_level_projected_triton

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    def flagged(flag):
        m.use_triton = flag
        return run(m)

    margins, ties = [], []
    m.margin_recorder = lambda lvl, mg: margins.append(mg)
    qt_triton.final_level_projected_triton = spy
    try:
        with _near_ties(ties, args.margin_threshold, S, side):
            kern = flagged(True)
            torch_path = flagged(False)
    finally:
        qt_triton.final_level_projected_triton = real
    rec = dict(attn_type=attn_type, projected_path=len(calls) == 1,
               **_module_comparison(kern, torch_path, ties, margins, case, 'max_rel', args))
    rec['passed'] &= rec['projected_path']
    return rec


def check_quadtree(case: str, dtype_name: str, args: argparse.Namespace) -> Dict:
    """One QuadTree case (``QT_CASES``) and dtype: the four ops on the case's finest level
    (kernels and PyTorch path against float64 on the same rounded inputs, forward and
    gradients, the FLA pass rule); for the first of ``--dtypes`` also the core A and B
    kernels vs PyTorch path and (``--compile-cases``) the compiled module; timings."""
    side, C, h, S, topk = QT_CASES[case]
    dtype = DTYPES[dtype_name]
    x = _qt_level_inputs(case, dtype, args)
    ops = _qt_ops(x['cand'], x['cells'], x['cell_width'])
    rec = dict(kernel='quadtree', case=case, dtype=dtype_name, batch=x['batch'], side=side,
               channels=C, heads=h, head_dim=x['head_dim'], levels=S, topk=topk,
               parents=x['parents'], keys=x['keys'], candidates=x['candidates'], errors={},
               passed=True)
    for op, (names, gname, kern_fn, torch_fn) in ops.items():
        inputs = [x[n] for n in names]
        ref = _grad_run(torch_fn, [t.double() for t in inputs], [x[gname].double()])
        kern = _grad_run(kern_fn, inputs, [x[gname]])
        tp = _grad_run(torch_fn, inputs, [x[gname]])
        for res, a, t, r in zip(['out'] + [f'd{n}' for n in names], kern, tp, ref):
            e = _judge(a, t, r, dtype_name, args.tol)
            rec['errors'][f'{op}.{res}'] = e
            rec['passed'] &= e['passed']
        del ref, kern, tp
    if dtype_name == args.dtypes[0]:
        rec['core'] = {}
        for attn_type in ('A', 'B'):
            c = _qt_core_check(case, attn_type, args)
            rec['core'][attn_type] = c
            rec['passed'] &= c['passed']
        rec['module'] = {}
        for attn_type in ('A', 'B'):
            c = _qt_module_check(case, attn_type, args)
            rec['module'][attn_type] = c
            rec['passed'] &= c['passed']
        if args.compile and case in args.compile_cases:
            rec['compile'] = _qt_compile_check(case, args)
            rec['passed'] &= rec['compile']['passed']
    if not args.no_timing:
        rec['ms'] = {}
        for op, (names, gname, kern_fn, torch_fn) in ops.items():
            leaves = [x[n].detach().requires_grad_(True) for n in names]
            rec['ms'][op] = {}
            for label, fn in (('kernels', kern_fn), ('pytorch', torch_fn)):
                rec['ms'][op][label] = dict(
                    forward=_median_ms(lambda: fn(*leaves), args.reps),
                    forward_backward=_median_ms(
                        lambda: fn(*leaves).backward(x[gname]), args.reps))
        if dtype_name == args.dtypes[0]:
            from flatten_mm.models.layers import quadtree_attention as qa
            qs, ks, vs = _qt_pyramids(case, args, args.seed + 1)
            leaves = [t.requires_grad_(True) for t in qs + ks + vs]
            g = torch.randn(args.batch, h, side * side, C // h, device=qs[0].device)
            rec['ms']['core_b'] = {}
            for label, flag in (('kernels', True), ('pytorch', False)):
                def core(flag=flag):
                    return qa.quadtree_attention_core(leaves[:S], leaves[S:2 * S],
                                                      leaves[2 * S:], h, (topk, ) * S, 'B',
                                                      use_triton=flag)
                rec['ms']['core_b'][label] = dict(
                    forward=_median_ms(core, args.reps),
                    forward_backward=_median_ms(lambda core=core: core().backward(g),
                                                args.reps))
    return rec


def _safety_operators(dev: str, small: bool = False):
    """FLA (FLatten-PVT without and with key reduction, FLatten-Swin) and QuadTree (A and
    B) operators on ``dev`` and their map sizes, for ``safety_checks`` (``small``: a
    fraction of the sizes, for the interpreted CPU test of this tool)."""
    from flatten_mm.models.layers import (FocusedLinearAttention, FocusedLinearAttentionQKV,
                                          QuadTreeAttention)
    torch.manual_seed(0)
    c, side, qside, levels = (16, 6, 8, 2) if small else (64, 24, 32, 3)
    ops = {
        'fla-pvt': (FocusedLinearAttention(c, 1, pretrain_hw_shape=(side, side)), side),
        'fla-pvt-sr2': (FocusedLinearAttention(c, 2, sr_ratio=2,
                                               pretrain_hw_shape=(side, side)), side),
        'fla-swin': (FocusedLinearAttentionQKV(c + c // 2, 3, pretrain_hw_shape=(side, side)),
                     side),
        'quadtree-b': (QuadTreeAttention(c, 2, attn_type='B', num_levels=levels, topk=8),
                       qside),
        'quadtree-a': (QuadTreeAttention(c, 2, attn_type='A', num_levels=levels, topk=8),
                       qside),
    }
    for m, _ in ops.values():
        with torch.no_grad():
            for name, prm in m.named_parameters():
                if name in ('scale', 'positional_encoding'):
                    prm.normal_(0, 0.3)
        m.to(dev)
    return {name: (m, (n, n)) for name, (m, n) in ops.items()}


def _operator_step(m, hw, x, use_triton, dtype=None):
    """Output, input gradient and parameter gradients of one forward + backward."""
    m.use_triton = use_triton
    m.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        out = m(xi, hw)
    out.float().backward(torch.ones_like(out, dtype=torch.float32))
    return [out.detach().float(), xi.grad] + [
        p.grad for p in m.parameters() if p.grad is not None]


def safety_checks(args: argparse.Namespace) -> Dict:
    """The GPU-safety checks (issue: the GPU path must be safe on every GPU), one record:

    * ``verdicts``: each operator once in auto mode (``use_triton=None``), fp32, bf16 and
      fp16 autocast; the first-use verdicts of ``ops.dispatch`` and every warning raised;
    * ``tf32``: the same with TF32 matmuls allowed (kernels with ``tf32`` precision), each
      operator's output against ``use_triton=False`` under TF32, within the dispatch's
      TF32 tolerance;
    * ``repeat``: two identical steps per operator with the kernels forced, bitwise equal
      or not (FLA must be; QuadTree's backward uses float atomics: its result is recorded);
      and with ``torch.use_deterministic_algorithms(True)``, QuadTree (auto mode) bitwise
      repeatable;
    * ``nan``: a NaN (the GPU's own) and an Inf in the input: the kernels' non-finite
      pattern equals the PyTorch path's (fp32, bf16 autocast);
    * ``second_device``: with two GPUs, each operator on ``cuda:1`` while ``cuda:0`` is
      current, against the PyTorch path on ``cuda:1``;
    * ``dynamic``: each FLA operator compiled with ``dynamic=True`` (inductor) run at two
      map sizes, against eager.
    """
    import copy
    import warnings

    from flatten_mm.models.ops import dispatch
    dev = getattr(args, 'device', 'cuda')
    tol = args.tol * 10
    rec: Dict = dict(passed=True)

    def close(a, b, t):
        return max(_max_rel(x, y.double()) for x, y in zip(a, b)) <= t

    ops = _safety_operators(dev, getattr(args, 'safety_small', False))

    def x_for(m, hw, seed=1):
        gen = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(2, hw[0] * hw[1], m.embed_dims, device=dev, generator=gen)

    # first-use verdicts in auto mode
    dispatch.reset()
    caught_all = []
    for amp in (None, torch.bfloat16, torch.float16):
        for name, (m, hw) in ops.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                _operator_step(m, hw, x_for(m, hw), None, amp)
            caught_all += [str(w.message) for w in caught if 'flatten_mm' in str(w.message)]
    rec['verdicts'] = [dict(family=f, device=d, key=list(k), passed=ok)
                       for (f, d, k), ok in dispatch.verdicts().items()]
    rec['warnings'] = caught_all
    # TF32
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        rec['tf32'] = {}
        for name, (m, hw) in ops.items():
            x = x_for(m, hw)
            kern = _operator_step(m, hw, x, None)
            ref = _operator_step(m, hw, x, False)
            err = max(_max_rel(a, b.double()) for a, b in zip(kern, ref))
            rec['tf32'][name] = dict(max_rel=err, passed=err <= dispatch.TOLERANCES['tf32'])
            rec['passed'] &= rec['tf32'][name]['passed']
        rec['tf32_verdicts'] = [dict(family=f, key=list(k), passed=ok) for (f, _, k), ok
                                in dispatch.verdicts().items() if 'tf32' in k]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    # bitwise repeatability
    rec['repeat'] = {}
    for name, (m, hw) in ops.items():
        x = x_for(m, hw)
        a, b = _operator_step(m, hw, x, True), _operator_step(m, hw, x, True)
        same = all(torch.equal(p, q) for p, q in zip(a, b))
        rec['repeat'][name] = dict(bitwise_equal=same)
        if name.startswith('fla'):
            rec['passed'] &= same
    torch.use_deterministic_algorithms(True)
    try:
        for name in ('quadtree-b', 'quadtree-a'):
            m, hw = ops[name]
            x = x_for(m, hw)
            a, b = _operator_step(m, hw, x, None), _operator_step(m, hw, x, None)
            same = all(torch.equal(p, q) for p, q in zip(a, b))
            rec['repeat'][name]['deterministic_mode_bitwise_equal'] = same
            rec['passed'] &= same
    finally:
        torch.use_deterministic_algorithms(False)
    # NaN / Inf
    rec['nan'] = {}
    nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)[0]
    for name, (m, hw) in ops.items():
        for amp in (None, torch.bfloat16):
            x = x_for(m, hw)
            x[0, 3, 1] = nan.to(dev)
            x[1, 7, 2] = float('inf')
            kern = _operator_step(m, hw, x, True, amp)
            ref = _operator_step(m, hw, x, False, amp)
            same = all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
                       for a, b in zip(kern, ref))
            rec['nan'][f"{name}-{'fp32' if amp is None else 'bf16'}"] = dict(same_pattern=same)
            rec['passed'] &= same
    # a second device
    if dev == 'cuda' and torch.cuda.device_count() > 1:
        rec['second_device'] = {}
        torch.cuda.set_device(0)
        for name, (m, hw) in ops.items():
            m1 = copy.deepcopy(m).to('cuda:1')
            x = x_for(m, hw).to('cuda:1')
            kern = _operator_step(m1, hw, x, True)
            ref = _operator_step(m1, hw, x, False)
            ok = close(kern, ref, tol)
            rec['second_device'][name] = dict(passed=ok)
            rec['passed'] &= ok
    else:
        rec['second_device'] = 'one device only'
    # dynamic shapes under torch.compile
    if args.compile:
        rec['dynamic'] = {}
        for name in ('fla-pvt', 'fla-swin'):
            m, _ = ops[name]
            torch._dynamo.reset()
            compiled = torch.compile(m, backend='inductor', dynamic=True, fullgraph=True)
            errs = []
            for side in (16, 24):
                x = x_for(m, (side, side))
                m.use_triton = None
                with torch.no_grad():
                    errs.append(_max_rel(compiled(x, (side, side)), m(x, (side, side)).double()))
            rec['dynamic'][name] = dict(max_rel=max(errs), passed=max(errs) <= tol)
            rec['passed'] &= rec['dynamic'][name]['passed']
    return rec


CHECKS = {'fla': (check_fla, CASES_OF['fla']),
          'quadtree': (check_quadtree, CASES_OF['quadtree'])}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print('gpu_kernel_check: needs a CUDA device (torch.cuda.is_available() is False); '
              'the CPU tests run the kernels under TRITON_INTERPRET=1 instead '
              '(tests/test_layers/test_fla_triton.py)', file=sys.stderr)
        return 2
    if os.environ.get('FLATTEN_MM_TRITON', '1').strip().lower() in ('0', 'false', 'no', 'off'):
        print('gpu_kernel_check: FLATTEN_MM_TRITON=0 turns the kernels off; unset it',
              file=sys.stderr)
        return 2
    import triton
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    records = []
    os.makedirs(args.out, exist_ok=True)
    path = osp.join(args.out, 'gpu_kernel_check.json')
    for kernel in args.kernels:
        fn, cases = CHECKS[kernel]
        for case in cases(args):
            for dtype_name in args.dtypes:
                try:
                    rec = fn(case, dtype_name, args)
                    line = ' '.join(f"{k}={e['kernels']:.1e}/{e['pytorch']:.1e}"
                                    for k, e in rec['errors'].items())
                    if 'ms' in rec and kernel == 'fla':
                        line += ' ms fwd+bwd kernels/pytorch/relu-linear ' + '/'.join(
                            f"{rec['ms'][k]['forward_backward']:.3f}"
                            for k in ('kernels', 'pytorch', 'relu_linear'))
                    elif 'ms' in rec:
                        line += ' ms fwd+bwd kernels/pytorch ' + ' '.join(
                            f"{op}={t['kernels']['forward_backward']:.3f}/"
                            f"{t['pytorch']['forward_backward']:.3f}"
                            for op, t in rec['ms'].items())
                    if 'operator' in rec:
                        line += ' operator={:.1e}'.format(max(
                            e['kernels'] for e in rec['operator']['errors'].values()))
                    for a, c in rec.get('core', {}).items():
                        line += f" core-{a}={max(c['max_rel'].values()):.1e}" + (
                            f"({c['near_tie_tokens']}-tie)" if c['near_tie_tokens'] else '')
                except Exception as e:  # recorded; the other cases still run
                    rec = dict(kernel=kernel, case=case, dtype=dtype_name, passed=False,
                               error=f'{type(e).__name__}: {e}'[:2000])
                    line = rec['error'].splitlines()[0]
                print(f"{kernel:8s} {case:20s} {dtype_name:5s} "
                      f"{'ok  ' if rec['passed'] else 'FAIL'} {line}", flush=True)
                records.append(rec)
                report = dict(
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec='seconds'),
                    device=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=triton.__version__, tf32=False, argv=sys.argv[1:],
                    passed=all(r['passed'] for r in records), records=records)
                with open(path, 'w') as f:
                    json.dump(report, f, indent=1)
    if args.safety:
        try:
            safety = safety_checks(args)
        except Exception as e:  # recorded like a failed case
            safety = dict(passed=False, error=f'{type(e).__name__}: {e}'[:2000])
        for v in safety.get('verdicts', []):
            print(f"first-use {v['family']:8s} {v['device']} {'ok  ' if v['passed'] else 'FAIL'}"
                  f" {tuple(v['key'])}", flush=True)
        for w in safety.get('warnings', []):
            print('warning:', w)
        print(f"safety   {'ok  ' if safety['passed'] else 'FAIL'} " + json.dumps(
            {k: v for k, v in safety.items() if k not in ('verdicts', 'warnings')})[:2000])
        report['safety'] = safety
        report['passed'] = report['passed'] and safety['passed']
        with open(path, 'w') as f:
            json.dump(report, f, indent=1)
    print(f"{'all passed' if report['passed'] else 'FAILED'}; wrote {path}")
    return 0 if report['passed'] else 1


if __name__ == '__main__':
    sys.exit(main())
