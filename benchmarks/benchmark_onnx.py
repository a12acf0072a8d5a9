"""ONNX Runtime (CPU) latency of exported backbones: ours against ours in eager PyTorch
and against the softmax counterpart exported the same way (paired protocol).

    python benchmarks/benchmark_onnx.py --sizes 512 1024 --threads 1 2 \
        --csv docs/benchmarks/cpu_onnx_pairs.csv
    python benchmarks/benchmark_onnx.py --backbones quadtree-b-pvt-v2-b0 --sizes 256

See benchmarks/core/onnx.py. Prints one row per backbone, size and thread count: medians
of ours eager, ours in ONNX Runtime and the counterpart in ONNX Runtime, the ratios
``onnx_vs_eager`` and ``onnx_vs_counterpart``, and the worst relative output difference.
"""
import argparse
import csv
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))


def _size(text: str):
    h, _, w = text.partition('x')
    return int(h), int(w or h)


def main(argv=None) -> int:
    from benchmarks.core.onnx import DEFAULT_BACKBONES, onnx_rows
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--backbones', default=','.join(DEFAULT_BACKBONES),
                   help='comma-separated catalogue names')
    p.add_argument('--sizes', type=_size, nargs='+', default=[(512, 512)],
                   help='input sizes: S (square) or HxW')
    p.add_argument('--threads', type=int, nargs='+', default=[2],
                   help='intra-op thread counts of both sides')
    p.add_argument('--no-counterpart', action='store_true',
                   help='time ours only (eager and ONNX Runtime)')
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--csv', help='write the rows to this CSV file')
    args = p.parse_args(argv)
    rows = onnx_rows([n for n in args.backbones.split(',') if n], args.sizes,
                     threads=args.threads, warmup=args.warmup, repeats=args.repeats,
                     counterparts=not args.no_counterpart,
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
