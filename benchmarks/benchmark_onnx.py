"""ONNX Runtime (CPU) latency of exported backbones: ours against ours in eager PyTorch
and against the softmax counterpart exported the same way (paired protocol).

    python benchmarks/benchmark_onnx.py --resolutions 512,1024 --threads 1,2 \
        --csv docs/benchmarks/cpu_onnx_pairs.csv
    python benchmarks/benchmark_onnx.py --backbones quadtree-b-pvt-v2-b0 --resolutions 256

See benchmarks/core/onnx.py. Prints one row per backbone, graph, size and thread count: medians
of ours eager, ours in ONNX Runtime and the counterpart in ONNX Runtime, the ratios
``onnx_vs_eager`` and ``onnx_vs_counterpart``, and the worst relative output difference.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))


def main(argv=None) -> int:
    from benchmarks import core as bm
    from benchmarks.core.onnx import DEFAULT_BACKBONES, onnx_rows
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--backbones', default=','.join(DEFAULT_BACKBONES),
                   help='comma-separated catalogue names')
    p.add_argument('--resolutions', default='512',
                   help='inputs, HxW (or S for SxS), comma-separated')
    p.add_argument('--threads', default='2',
                   help='intra-op thread counts of both sides, comma-separated')
    p.add_argument('--no-counterpart', action='store_true',
                   help='time ours only (eager and ONNX Runtime)')
    p.add_argument('--no-custom-ops', action='store_true',
                   help="time the standard-operator graph only (not also the graph with "
                        "flatten_mm's ONNX Runtime operators, where it differs)")
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--csv', help='write the rows to this CSV file')
    args = p.parse_args(argv)
    rows = onnx_rows([n for n in args.backbones.split(',') if n],
                     bm.parse_resolutions(args.resolutions), threads=bm.parse_ints(args.threads),
                     warmup=args.warmup, repeats=args.repeats,
                     counterparts=not args.no_counterpart,
                     custom_ops=not args.no_custom_ops,
                     on_row=lambda r: print(r, flush=True))
    print(bm.format_table(rows, [(k, k) for k in rows[0]]))
    if args.csv:
        bm.write_csv(rows, args.csv, columns=list(rows[0]))
        print(f'wrote {args.csv}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
