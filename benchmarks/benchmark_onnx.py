"""ONNX Runtime (CPU) vs PyTorch eager latency of exported backbones (paired protocol).

    python benchmarks/benchmark_onnx.py --csv docs/benchmarks/cpu_onnx_b1_512.csv
    python benchmarks/benchmark_onnx.py --backbones flatten-pvt-v2-b0 --shape 256 --threads 2

See benchmarks/core/onnx.py. Prints one row per backbone: eager and ONNX Runtime
medians and their ratio (onnx / eager), and the worst relative output difference.
"""
import argparse
import csv
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))


def main(argv=None) -> int:
    from benchmarks.core.onnx import DEFAULT_BACKBONES, onnx_vs_eager_rows
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--backbones', default=','.join(DEFAULT_BACKBONES),
                   help='comma-separated catalogue names')
    p.add_argument('--shape', type=int, nargs='+', default=[512], help='H [W]')
    p.add_argument('--threads', type=int, default=1, help='intra-op threads of both sides')
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--csv', help='write the rows to this CSV file')
    args = p.parse_args(argv)
    hw = tuple(args.shape) * (2 if len(args.shape) == 1 else 1)
    rows = onnx_vs_eager_rows([n for n in args.backbones.split(',') if n], hw,
                              threads=args.threads, warmup=args.warmup, repeats=args.repeats,
                              on_row=lambda r: print(r, flush=True))
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print('  '.join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print('  '.join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))
    if args.csv:
        with open(args.csv, 'w', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        print(f'wrote {args.csv}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
