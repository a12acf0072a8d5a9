"""Compile every Triton kernel configuration the dispatch can launch, for several NVIDIA GPU
generations, without a GPU, and check each against the target's limits.

    python dev/kernel_limits.py                 # the whole table (cached)
    python dev/kernel_limits.py --archs 75,90 --families fla --check

For each kernel specialisation (``fla_triton.aot_specs`` / ``quadtree_triton.aot_specs``:
FLA at head dims 16, 32, 64 and 128 with ieee and TF32 matmuls, ``FLA_SHAPES``; QuadTree's
gathered and fused final-level kernels, both variants, at the released models' candidate
counts and head dims and the largest tile of head dim 128, ``QT_SHAPES``; each in fp32,
bf16 and fp16) and each target (``--archs``, compute capabilities),
Triton's bundled compiler builds the cubin as a launch would and records the shared memory
per block it allocates, the registers per thread and the spill bytes (``ptxas -v``), and
the threads per block; ``fits`` says whether the shared memory, the threads and the
registers stay within the target's limits (``LIMITS``). Compiled artefacts are cached by
Triton (``~/.triton/cache``, per Triton version), so a rerun only compiles what changed.

Writes ``flatten_mm/models/ops/kernel_limits.json`` (shared memory per row and target: what
the dispatch reads before a kernel's first use on a GPU, so that it never launches a
configuration that does not fit the device) and ``docs/benchmarks/kernel_limits.md``
(``--json`` / ``--md`` elsewhere). ``--check`` instead compares the compiled values with
the committed JSON and exits 1 on a difference (no files written). Exits 1 if a kernel
fails to compile. Run it without ``TRITON_INTERPRET``.
"""
import argparse
import contextlib
import datetime
import io
import json
import os
import os.path as osp
import re
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

#: compute capability -> (GPUs, shared memory per block with opt-in, bytes); 1024 threads
#: and 64 Ki 32-bit registers per block on all of them (CUDA programming guide, table of
#: technical specifications per compute capability)
LIMITS = {
    75: ('T4, RTX 20xx', 65536),
    80: ('A100, A30', 166912),
    86: ('RTX 30xx, A10, A40', 101376),
    89: ('RTX 40xx, L4, L40', 101376),
    90: ('H100, H200, GH200', 232448),
}
MAX_THREADS = 1024
REGISTERS_PER_BLOCK = 65536
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}
JSON_PATH = osp.join(ROOT, 'flatten_mm', 'models', 'ops', 'kernel_limits.json')
MD_PATH = osp.join(ROOT, 'docs', 'benchmarks', 'kernel_limits.md')

#: FLA (channels, heads): head dims 16, 32, 64 and 128 (the largest ``check_inputs`` admits)
FLA_SHAPES = ((32, 2), (32, 1), (64, 1), (128, 1))
#: QuadTree (candidates 4K, head dim): the released models (d = 32 / 64, 4K = 32 / 128) and
#: the largest tile at head dim 128 the register budget admits
QT_SHAPES = ((32, 32), (128, 32), (32, 64), (128, 64), (64, 128))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--archs', default=','.join(map(str, LIMITS)),
                        help='compute capabilities, comma-separated (default: all of LIMITS)')
    parser.add_argument('--families', default='fla,quadtree')
    parser.add_argument('--dtypes', default='fp32,bf16,fp16')
    parser.add_argument('--json', default=JSON_PATH, help='table the dispatch reads')
    parser.add_argument('--md', default=MD_PATH, help='readable table')
    parser.add_argument('--jobs', type=int, default=1,
                        help='compile in this many processes')
    parser.add_argument('--match', default=None, metavar='REGEX',
                        help='only the rows (limit keys) this regular expression finds')
    parser.add_argument('--check', action='store_true',
                        help='compare with the committed --json instead of writing')
    return parser.parse_args(argv)


def _kernel_modules():
    if os.environ.get('TRITON_INTERPRET', '0') not in ('', '0'):
        raise SystemExit('kernel_limits: unset TRITON_INTERPRET (the kernels would be '
                         'interpreted, not compiled)')
    from flatten_mm.models.ops import fla_triton, quadtree_triton
    return fla_triton, quadtree_triton


def configurations(families: Sequence[str], dtypes: Sequence[str]) -> Iterator[tuple]:
    """``(family, row, kernel, signature, constexprs, options)`` of every distinct kernel
    specialisation (``row``: the kernel module's ``limit_key``)."""
    fla, qt = _kernel_modules()
    seen = set()
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        specs: List[Tuple[str, tuple]] = []
        if 'fla' in families:
            for precision in ('ieee', 'tf32'):
                for C, h in FLA_SHAPES:
                    specs += [('fla', s) for s in fla.aot_specs(C, h, 3, dtype,
                                                               precision=precision)]
        if 'quadtree' in families:
            for K, d in QT_SHAPES:
                specs += [('quadtree', s) for s in qt.aot_specs(K, d, dtype)]
        for family, (name, fn, sig, const, options) in specs:
            module = fla if family == 'fla' else qt
            row = module.limit_key(name, const, options, dtype)
            if (family, row) not in seen:
                seen.add((family, row))
                yield family, row, fn, sig, const, options


def compile_stats(fn, sig: dict, const: dict, options: dict, sm: int) -> Dict:
    """Compile one kernel for ``sm_<sm>`` (no GPU) and return its shared memory, registers,
    spill bytes and threads per block (``ptxas -v`` as Triton runs it)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    log = io.StringIO()
    with knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, sig, const), target=GPUTarget('cuda', sm, 32),
                                      options=options)
    text = log.getvalue()
    if 'Used' not in text:  # (a cache hit runs no ptxas: run it on the cached PTX)
        text = _ptxas_log(compiled.asm['ptx'], sm)
    regs = re.findall(r'Used (\d+) registers', text)
    spills = re.findall(r'(\d+) bytes spill stores, (\d+) bytes spill loads', text)
    return dict(shared_bytes=int(compiled.metadata.shared),
                registers=int(regs[-1]) if regs else None,
                spill_store_bytes=int(spills[-1][0]) if spills else None,
                spill_load_bytes=int(spills[-1][1]) if spills else None,
                threads=32 * int(options['num_warps']))


def _ptxas_log(ptx: str, sm: int) -> str:
    """``ptxas -v`` of ``ptx`` for ``sm_<sm>`` by Triton's bundled ptxas."""
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
    return res.stdout + res.stderr


#: (configuration, target) pairs of a run, read by the worker processes (forked)
_TASKS: List[tuple] = []


def _compile_task(i: int) -> Dict:
    """Compile ``_TASKS[i]``: its record (printed as it is made)."""
    (family, row, fn, sig, const, options), sm = _TASKS[i]
    rec = dict(family=family, row=row, sm=sm)
    try:
        stats = compile_stats(fn, sig, const, options, sm)
        rec.update(stats, compiled=True, fits=fits(stats, sm))
    except Exception as e:  # report every failing kernel, not just the first
        rec.update(compiled=False, fits=False, error=f'{type(e).__name__}: {e}'[:500])
    print(f"sm_{sm} {family:8s} {row:50s} " + (
        f"smem={rec['shared_bytes']:6d} regs={rec['registers']} "
        f"spills={rec['spill_store_bytes']} {'ok' if rec['fits'] else 'DOES NOT FIT'}"
        if rec['compiled'] else 'COMPILE ERROR ' + rec['error'].splitlines()[0]), flush=True)
    return rec


def fits(stats: Dict, sm: int) -> bool:
    """Whether a compiled kernel stays within ``sm``'s limits (``LIMITS``)."""
    threads = stats['threads']
    regs = stats['registers'] or 0
    return (stats['shared_bytes'] <= LIMITS[sm][1] and threads <= MAX_THREADS
            and regs * threads <= REGISTERS_PER_BLOCK)


def _markdown(records: List[Dict], archs: List[int], date: str, versions: str) -> str:
    lines = [
        '# Triton kernels against GPU limits (compiled ahead of time, no GPU)', '',
        f'Generated {date} by `python dev/kernel_limits.py` ({versions}). One row',
        'per kernel specialisation the dispatch can launch (`limit_key`, fields shown',
        'space-separated: kernel, io dtype,',
        'FLA matmul precision and tiles `BD` / `BN` / `BC`, QuadTree tiles `P` / `K` / `D`,',
        'warps); per target: shared memory per block in KiB / registers per thread /',
        'spill-store bytes, and **no** where a limit is exceeded (the dispatch then keeps',
        'that configuration on the PyTorch path on such a GPU).', '',
        'Limits (shared memory per block with opt-in): ' + '; '.join(
            f'sm_{sm} ({LIMITS[sm][0]}) {LIMITS[sm][1] // 1024} KiB' for sm in archs) + '.',
        '',
        '| family | kernel specialisation | ' + ' | '.join(f'sm_{sm}' for sm in archs) + ' |',
        '| --- | --- | ' + ' | '.join('---' for _ in archs) + ' |']
    rows: Dict[Tuple[str, str], Dict[int, Dict]] = {}
    for r in records:
        rows.setdefault((r['family'], r['row']), {})[r['sm']] = r
    for (family, row), per in rows.items():
        cells = []
        for sm in archs:
            r = per.get(sm)
            if r is None:
                cells.append('')
            elif not r['compiled']:
                cells.append('**compile error**')
            else:
                cell = (f"{r['shared_bytes'] / 1024:.0f} / {r['registers']} / "
                        f"{r['spill_store_bytes']}")
                cells.append(cell if r['fits'] else f'**no** {cell}')
        lines.append(f"| {family} | `{row.replace('|', ' ')}` | " + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import triton
    archs = [int(a) for a in args.archs.split(',')]
    unknown = [a for a in archs if a not in LIMITS]
    if unknown:
        raise SystemExit(f'kernel_limits: no limits known for sm_{unknown[0]} (LIMITS)')
    global _TASKS
    configs = [c for c in configurations(args.families.split(','), args.dtypes.split(','))
               if not args.match or re.search(args.match, c[1])]
    _TASKS = [(config, sm) for config in configs for sm in archs]
    if args.jobs > 1:
        import multiprocessing
        with multiprocessing.get_context('fork').Pool(args.jobs) as pool:
            records = list(pool.imap(_compile_task, range(len(_TASKS))))
    else:
        records = [_compile_task(i) for i in range(len(_TASKS))]
    failed = sum(not r['compiled'] for r in records)
    if not records:
        raise SystemExit('kernel_limits: no kernel configuration selected')
    table: Dict[str, Dict[str, Dict[str, int]]] = {}
    for r in records:
        if r['compiled']:
            table.setdefault(r['family'], {}).setdefault(r['row'], {})[f"sm_{r['sm']}"] = \
                r['shared_bytes']
    if args.check:
        with open(args.json) as f:
            committed = json.load(f)['shared_bytes']
        diffs = [(fam, row, sm, v, committed.get(fam, {}).get(row, {}).get(sm))
                 for fam, rows in table.items() for row, per in rows.items()
                 for sm, v in per.items()
                 if committed.get(fam, {}).get(row, {}).get(sm) != v]
        for d in diffs:
            print('differs from the committed table: {} {} {}: {} (committed {})'.format(*d))
        return 1 if diffs or failed else 0
    date = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d')
    versions = f'Triton {triton.__version__}, torch {torch.__version__}'
    with open(args.json, 'w') as f:
        json.dump(dict(generated=date, versions=versions, archs=[f'sm_{a}' for a in archs],
                       shared_bytes=table), f, indent=1, sort_keys=True)
        f.write('\n')
    with open(args.md, 'w') as f:
        f.write(_markdown(records, archs, date, versions))
    print(f'wrote {args.json} and {args.md}; {failed} compile errors')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
