"""Check every fused Triton kernel against its PyTorch path on a CUDA GPU (a tool, not a test).

    python tools/analysis/gpu_kernel_check.py --out work_dirs/gpu_check
    python tools/analysis/gpu_kernel_check.py --out DIR --batch 8 --dtypes fp32,bf16 --compile

For each kernel (today: ``fla``, the FLA core of ``focused_linear_attention_triton``) and
each case (``FLA_CASES``: the token maps / widths / heads / ``sr_ratio`` of the FLatten
backbones' global FLA stages at a 512² input, up to 128² tokens; ``DEFAULT_CASES`` unless
``--cases``) and dtype: forward and the gradients of
``q, k, v, scale, k_pos`` by the kernels and by the PyTorch path, both against the float64
formula on the same (rounded) inputs, with TF32 off. fp32 passes when the kernels' largest
error (relative to the largest reference value) is within ``--tol`` or twice the PyTorch
path's; bf16 / fp16 when every element is within one rounding of the dtype plus ``--tol``
of the largest value (the kernels accumulate in float32). With ``--compile`` the kernels
also run under ``torch.compile`` (inductor, ``fullgraph=True``; the ``--compile-cases`` in
the first of ``--dtypes``) and must match eager. Unless
``--no-timing``, the median times of forward and forward + backward of kernels, PyTorch path
and plain ReLU linear attention of the same shape are recorded (CUDA events).

Writes ``<out>/gpu_kernel_check.json`` (device, versions, date, one record per case;
rewritten after every case, so a run cut short keeps what it checked; a case that raises is
recorded with its error) and exits 1 if a check failed, 2 without a CUDA device (nothing
is written then).

``--aot 90`` (no GPU needed) instead compiles every kernel as the launches of each case and
dtype would, for that compute capability, down to the cubin with Triton's bundled ``ptxas``,
and records registers and spills per kernel (``<out>/gpu_kernel_aot.json``; exit 1 if a
kernel fails to compile). Run it without ``TRITON_INTERPRET``.
"""
import argparse
import datetime
import json
import os
import os.path as osp
import sys
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

import torch  # noqa: E402

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}
UNIT_ROUNDOFF = {'bf16': 2.0**-8, 'fp16': 2.0**-11}

#: name -> (map side in tokens, channels C, heads, sr_ratio): FLA stages at a 512² input
FLA_CASES = {
    'pvt-v2-b0-stage1': (128, 32, 1, 8),
    'pvt-v2-b0-stage2': (64, 64, 2, 4),
    'pvt-v2-b0-stage4': (16, 256, 8, 1),
    'pvt-t-stage1': (128, 64, 1, 8),  # FLatten-PVT: head dim 64
    'swin-t-stage1': (128, 96, 3, 1),
    'swin-t-stage2': (64, 192, 6, 1),
    'cswin-t-branch1': (128, 32, 1, 1),
}
#: checked by default (distinct kernel specialisations: heads 1 / 3 / 8, head dim 32 / 64;
#: about 40 Triton compilations, so that a run stays within ~2 min on a fresh machine)
DEFAULT_CASES = ('pvt-v2-b0-stage1', 'swin-t-stage1', 'pvt-v2-b0-stage4', 'pvt-t-stage1')
KERNELS = ('fla', )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', required=True, help='output directory for the JSON')
    parser.add_argument('--kernels', default=','.join(KERNELS),
                        help=f'comma-separated subset of {",".join(KERNELS)}')
    parser.add_argument('--cases', default=','.join(DEFAULT_CASES),
                        help=f'comma-separated subset of {",".join(FLA_CASES)}')
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--dtypes', default='fp32,bf16', help='comma-separated: fp32,bf16,fp16')
    parser.add_argument('--tol', type=float, default=1e-5,
                        help='error bound relative to the largest reference value')
    parser.add_argument('--compile', action='store_true',
                        help='also run the kernels under torch.compile (inductor)')
    parser.add_argument('--compile-cases', default='swin-t-stage1',
                        help='the cases that --compile compiles, in the first of --dtypes '
                        '(each compilation takes ~10-30 s)')
    parser.add_argument('--no-timing', action='store_true')
    parser.add_argument('--reps', type=int, default=20, help='timed repetitions')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--aot', type=int, metavar='SM', default=None,
                        help='compile only, for compute capability SM (e.g. 90); no GPU needed')
    args = parser.parse_args(argv)
    args.kernels = _choices(args.kernels, KERNELS, 'kernel', parser)
    args.cases = _choices(args.cases, FLA_CASES, 'case', parser)
    args.dtypes = _choices(args.dtypes, DTYPES, 'dtype', parser)
    args.compile_cases = _choices(args.compile_cases, FLA_CASES, 'case', parser)
    args.device = 'cuda'
    if args.batch < 1 or args.reps < 1 or not args.tol > 0:
        parser.error('--batch and --reps must be >= 1 and --tol > 0')
    return args


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
    names = ['out', 'dq', 'dk', 'dv', 'dscale', 'dpos']
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


CHECKS = {'fla': (check_fla, lambda args: args.cases)}


def _ptxas_stats(ptx: str, sm: int) -> Dict:
    """Registers and spill bytes of one kernel by Triton's bundled ``ptxas -v``."""
    import re
    import subprocess
    import tempfile

    import triton
    ptxas = osp.join(osp.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas')
    arch = f'sm_{sm}a' if sm >= 90 else f'sm_{sm}'
    with tempfile.TemporaryDirectory() as tmp:
        path = osp.join(tmp, 'k.ptx')
        with open(path, 'w') as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f'-arch={arch}', '-v', path, '-o', osp.join(tmp, 'k.o')],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r'Used (\d+) registers', text)
    spills = re.search(r'(\d+) bytes spill stores, (\d+) bytes spill loads', text)
    return dict(registers=int(regs.group(1)) if regs else None,
                spill_store_bytes=int(spills.group(1)) if spills else None,
                spill_load_bytes=int(spills.group(2)) if spills else None)


def aot_compile(args: argparse.Namespace) -> int:
    """``--aot``: compile every kernel of every case / dtype for ``args.aot``; JSON report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flatten_mm.models.layers import focused_linear_attention_triton as fla_triton
    if fla_triton.INTERPRETED:
        print('gpu_kernel_check --aot: unset TRITON_INTERPRET (the kernels are interpreted)',
              file=sys.stderr)
        return 2
    records = []
    for case in args.cases:
        _, C, h, _ = FLA_CASES[case]
        for dtype_name in args.dtypes:
            for name, fn, sig, const, options in fla_triton.aot_specs(C, h, 3, DTYPES[dtype_name]):
                rec = dict(kernel='fla', case=case, dtype=dtype_name, function=name,
                           constexprs={k: v for k, v in const.items()}, options=options)
                try:
                    compiled = triton.compile(ASTSource(fn, sig, const),
                                              target=GPUTarget('cuda', args.aot, 32),
                                              options=options)
                    rec.update(passed=True, cubin_bytes=len(compiled.asm['cubin']),
                               shared_bytes=compiled.metadata.shared,
                               **_ptxas_stats(compiled.asm['ptx'], args.aot))
                except Exception as e:  # report every failing kernel, not just the first
                    rec.update(passed=False, error=f'{type(e).__name__}: {e}'[:2000])
                print(f"{case:20s} {dtype_name:5s} {name:13s} "
                      + (f"ok   regs={rec['registers']} spills={rec['spill_store_bytes']}"
                         if rec['passed'] else 'FAIL ' + rec['error'].splitlines()[0]),
                      flush=True)
                records.append(rec)
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
                  target=f'cuda sm_{args.aot}', torch=torch.__version__,
                  triton=triton.__version__, argv=sys.argv[1:],
                  passed=all(r['passed'] for r in records), records=records)
    os.makedirs(args.out, exist_ok=True)
    path = osp.join(args.out, 'gpu_kernel_aot.json')
    with open(path, 'w') as f:
        json.dump(report, f, indent=1)
    print(f"{'all compiled' if report['passed'] else 'FAILED'}; wrote {path}")
    return 0 if report['passed'] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.aot is not None:
        return aot_compile(args)
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
                    if 'ms' in rec:
                        line += ' ms fwd+bwd kernels/pytorch/relu-linear ' + '/'.join(
                            f"{rec['ms'][k]['forward_backward']:.3f}"
                            for k in ('kernels', 'pytorch', 'relu_linear'))
                except Exception as e:  # recorded; the other cases still run
                    rec = dict(kernel=kernel, case=case, dtype=dtype_name, passed=False,
                               error=f'{type(e).__name__}: {e}'[:2000])
                    line = rec['error'].splitlines()[0]
                print(f"{kernel:5s} {case:20s} {dtype_name:5s} "
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
    print(f"{'all passed' if report['passed'] else 'FAILED'}; wrote {path}")
    return 0 if report['passed'] else 1


if __name__ == '__main__':
    sys.exit(main())
