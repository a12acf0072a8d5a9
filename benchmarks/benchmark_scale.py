"""The largest square image whose training step fits a memory budget, ours against the
softmax counterparts (``benchmarks/core/scale.py``).

    python benchmarks/benchmark_scale.py --budget-gb 21 --families flatten-pvt-v2-b0 \
        --threads 2 --csv docs/benchmarks/cpu_scale.csv --png docs/benchmarks/cpu_scale.png

Each probe is one training step (batch 1, forward + backward + AdamW) in a child process:
on CPU it fits when the child's peak resident memory stays within the budget (GiB); on
CUDA when it raises no out-of-memory error and ``torch.cuda.max_memory_allocated`` stays
within it. Sides double from ``--start`` while steps fit, then bisect down to ``--step``.
Rows are appended to the CSV after every search (a stopped run keeps what it measured).
"""
import argparse
import datetime
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks import core as bm  # noqa: E402
from benchmarks.core.scale import (SCALE_COLUMNS, run_scale_benchmark,  # noqa: E402
                                   scale_summary)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--budget-gb', type=float, required=True,
                   help='memory budget of one step in GiB (CPU: peak resident memory of the '
                   'child process; CUDA: max_memory_allocated)')
    p.add_argument('--families', default=None,
                   help='comma-separated backbones of ours (default: all four pairs); each '
                   'runs with its softmax counterparts')
    p.add_argument('--with-cp', default='both', choices=('off', 'on', 'both'),
                   help='gradient checkpointing on both sides of each pair')
    p.add_argument('--start', type=int, default=1024, help='first side tried')
    p.add_argument('--step', type=int, default=256, help='resolution of the search')
    p.add_argument('--max-side', type=int, default=8192, help='largest side tried')
    p.add_argument('--probe-timeout', type=float, default=None,
                   help='seconds a probe may run before it counts as not fitting')
    p.add_argument('--device', default='cpu')
    p.add_argument('--threads', type=int, default=None, help='torch threads of each probe')
    p.add_argument('--quick', action='store_true',
                   help='the tiny backbones of the quick suite (smoke test)')
    p.add_argument('--csv', default=None, help='write every probe to this CSV')
    p.add_argument('--markdown', default=None, help='write the summary table here')
    p.add_argument('--png', default=None, help='memory and time against the side')
    return p.parse_args(argv)




def summary_markdown(summary, env) -> str:
    head = (f'<!-- written by benchmarks/benchmark_scale.py on {env["date"]} '
            f'({env.get("gpu", env["cpu"])}, torch {env["torch"]}) -->\n\n'
            '| backbone | with_cp | budget GiB | largest side | step s there | peak MiB there '
            '| first side over the budget |\n| --- | --- | --- | --- | --- | --- | --- |\n')
    return head + ''.join(
        f'| {s["name"]} | {s["with_cp"]} | {s["budget_gb"]} | {s["largest_side"] or "-"} | '
        f'{s["step_s"] or "-"} | {s["peak_mem_mb"] or "-"} | {s["first_failing_side"] or "-"} |\n'
        for s in summary)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = bm.environment()
    env['date'] = datetime.date.today().isoformat()
    cps = {'off': (False, ), 'on': (True, ), 'both': (False, True)}[args.with_cp]
    rows = []

    def save(row):
        rows.append(row)
        print(f'{row["name"]:28s} cp={row["with_cp"]!s:5s} side {row["side"]:5d} '
              f'fits={row["fits"]!s:5s} {row["step_s"]!s:>8s} s {row["peak_mem_mb"]!s:>9s} MiB '
              f'{row["error"]}', flush=True)
        if args.csv:
            bm.write_csv(rows, args.csv, columns=SCALE_COLUMNS)

    run_scale_benchmark(bm.select_pairs(args.families, args.quick), args.budget_gb,
                        with_cp=cps, device=args.device, start=args.start, step=args.step,
                        max_side=args.max_side, quick=args.quick, threads=args.threads,
                        timeout_s=args.probe_timeout, on_row=save)
    text = summary_markdown(scale_summary(rows), env)
    print('\n' + text)
    if args.markdown:
        with open(args.markdown, 'w') as f:
            f.write(text)
    if args.png:
        bm.plot_scale(rows, args.png, args.budget_gb,
                      title=f'training step, batch 1, {args.device}, {env["date"]}')
    return 0 if rows else 1


if __name__ == '__main__':
    sys.exit(main())
