"""Sweep tools/swap_backbone.py over one config per family of the installed mmdet / mmseg.

    python tools/analysis/swap_sweep.py [--backbone flatten-pvt-v2-b0] [--size 128]
        [--scopes mmdet mmseg] [--families atss fcos ...] [--no-train]
        [--csv docs/swap_support.csv] [--md docs/swap_support.md] [--fresh]
        [--redo failed ...]

Writes one CSV row per family as it goes (a rerun skips the families already in the
CSV unless --fresh) and renders the Markdown table at the end (--render-only: just
that). How the representative config is chosen and what is checked:
``flatten_mm/analysis/swap_sweep.py``.
"""
import argparse
import os
import os.path as osp
import sys
import tempfile

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

from flatten_mm.analysis.swap_sweep import (append_row, families, read_rows,  # noqa: E402
                                            render_markdown, sweep_one)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--backbone', default='flatten-pvt-v2-b0')
    p.add_argument('--size', type=int, default=128, help='forward / train-smoke size')
    p.add_argument('--scopes', nargs='+', default=['mmdet', 'mmseg'])
    p.add_argument('--families', nargs='+', help='only these family directories')
    p.add_argument('--no-train', action='store_true', help='forward only')
    p.add_argument('--csv', default='docs/swap_support.csv')
    p.add_argument('--md', default='docs/swap_support.md')
    p.add_argument('--fresh', action='store_true', help='start a new CSV')
    p.add_argument('--redo', nargs='+', default=[], metavar='STATUS',
                   help='run again the families whose row has one of these statuses '
                   '(e.g. failed)')
    p.add_argument('--render-only', action='store_true')
    args = p.parse_args(argv)
    if args.fresh and osp.exists(args.csv):
        os.remove(args.csv)
    if not args.render_only:
        done = {(r.scope, r.family) for r in read_rows(args.csv)
                if r.status not in args.redo}
        with tempfile.TemporaryDirectory() as work:
            for scope in args.scopes:
                for fam in families(scope):
                    if (args.families and fam not in args.families) or (scope, fam) in done:
                        continue
                    row = sweep_one(scope, fam, args.backbone, work, args.size,
                                    train=not args.no_train)
                    append_row(args.csv, row)
                    print(f'{scope:5s} {fam:24s} {row.status:8s} {row.seconds:>4s}s '
                          f'{row.reason[:150]}', flush=True)
    if args.md:
        with open(args.md, 'w', encoding='utf-8') as f:
            f.write(render_markdown(read_rows(args.csv), args.backbone, args.size))
        print(f'wrote {args.md}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
