"""Sweep tools/swap_backbone.py over one config per family of the installed mmdet / mmseg.

    python dev/swap_sweep.py [--backbone flatten-pvt-v2-b0] [--size 128]
        [--scopes mmdet mmseg] [--families atss fcos ...] [--no-train]
        [--csv docs/reports/swap_support.csv] [--md docs/reports/swap_support.md] [--fresh]
        [--redo failed ...]
    python dev/swap_sweep.py --all-configs [--run] [--families ...]
        [--time-limit 120] [--csv docs/reports/swap_support_all.csv] [--md docs/reports/swap_support_all.md]
        [--fresh] [--redo failed ...]

Writes one CSV row per family (--all-configs: per config) as it goes (a rerun skips
what is already in the CSV unless --fresh; --redo STATUS runs those rows again) and
renders the Markdown table at the end (--render-only: just that). How the
representative config is chosen and what is checked: ``dev/sweeps/swap_sweep.py``;
--all-configs (every config: swap and build; with --run also the forward and one
training step of every built config not run yet, identical configs once):
``dev/sweeps/swap_sweep_all.py``.
"""
import argparse
import os
import os.path as osp
import sys
import tempfile

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from dev.sweeps.swap_sweep import (append_row, families, read_rows,  # noqa: E402
                                            render_markdown, sweep_one)
from dev.sweeps.swap_sweep_all import (append_all_row,  # noqa: E402
                                                cached_metafiles, family_configs,
                                                read_all_rows, render_markdown_all,
                                                run_config, runs_by_key, sweep_config)


def run_all_configs(args) -> None:
    """--all-configs: every config of the selected families, one CSV row each."""
    done = {(r.scope, r.config) for r in read_all_rows(args.csv)
            if r.status not in args.redo}
    with tempfile.TemporaryDirectory() as work, cached_metafiles():
        for scope in args.scopes:
            for fam in families(scope):
                if args.families and fam not in args.families:
                    continue
                for rel in family_configs(scope, fam):
                    if (scope, rel) in done:
                        continue
                    row = sweep_config(scope, rel, args.backbone, work, args.time_limit)
                    append_all_row(args.csv, row)
                    print(f'{scope:5s} {rel[:70]:70s} {row.status:13s} {row.seconds:>5s}s '
                          f'{(row.reason + " " + row.build_error)[:120]}', flush=True)


def run_built_configs(args) -> None:
    """--all-configs --run: forward + training step of every built config whose row has
    no run yet (or whose status is in --redo), in CSV order; the CSV is rewritten after
    each config, so a stopped run resumes."""
    rows = read_all_rows(args.csv)
    ran = runs_by_key(r for r in rows if r.status not in args.redo)
    with tempfile.TemporaryDirectory() as work, cached_metafiles():
        for row in rows:
            if row.build != 'ok' or (args.families and row.family not in args.families) \
                    or row.scope not in args.scopes:
                continue
            if row.forward and row.status not in args.redo:
                continue
            if row.status != 'adapted' and row.status not in args.redo:
                continue
            row.status, row.reason = 'adapted', ''
            run_config(row, args.backbone, work, args.size, args.run_time_limit, ran)
            append_all_row(args.csv, row)
            print(f'{row.scope:5s} {row.config[:70]:70s} {row.status:13s} '
                  f'{row.run_seconds:>5s}s {row.forward or "-":6s} {row.train_smoke or "-":6s} '
                  f'{("= " + row.same_as) if row.same_as else row.reason[:100]}', flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--backbone', default='flatten-pvt-v2-b0')
    p.add_argument('--size', type=int, default=128, help='forward / train-smoke size')
    p.add_argument('--scopes', nargs='+', default=['mmdet', 'mmseg'])
    p.add_argument('--families', nargs='+', help='only these family directories')
    p.add_argument('--no-train', action='store_true', help='forward only')
    p.add_argument('--all-configs', action='store_true',
                   help='every config of every family: swap and build only (no forward '
                   'or training); default CSV / Markdown docs/reports/swap_support_all.*')
    p.add_argument('--run', action='store_true',
                   help='with --all-configs: also run (forward + one training step) every '
                   'built config not run yet; identical configs are run once')
    p.add_argument('--time-limit', type=int, default=None,
                   help='seconds per check (default 600; --all-configs: 120 per config '
                   'step)')
    p.add_argument('--csv', help='default docs/reports/swap_support.csv '
                   '(--all-configs: docs/reports/swap_support_all.csv)')
    p.add_argument('--md', help='default docs/reports/swap_support.md '
                   '(--all-configs: docs/reports/swap_support_all.md)')
    p.add_argument('--fresh', action='store_true', help='start a new CSV')
    p.add_argument('--redo', nargs='+', default=[], metavar='STATUS',
                   help='run again the families whose row has one of these statuses '
                   '(e.g. failed)')
    p.add_argument('--render-only', action='store_true')
    args = p.parse_args(argv)
    stem = 'docs/reports/swap_support_all' if args.all_configs else 'docs/reports/swap_support'
    args.csv = args.csv or f'{stem}.csv'
    args.md = args.md if args.md is not None else f'{stem}.md'
    args.run_time_limit = args.time_limit or 600
    args.time_limit = args.time_limit or (120 if args.all_configs else 600)
    if args.run and not args.all_configs:
        p.error('--run goes with --all-configs (the family sweep always runs)')
    if args.fresh and osp.exists(args.csv):
        os.remove(args.csv)
    if args.all_configs:
        if not args.render_only:
            run_all_configs(args)
            if args.run:
                run_built_configs(args)
        if args.md:
            with open(args.md, 'w', encoding='utf-8') as f:
                f.write(render_markdown_all(read_all_rows(args.csv), args.backbone))
            print(f'wrote {args.md}')
        return 0
    if not args.render_only:
        done = {(r.scope, r.family) for r in read_rows(args.csv)
                if r.status not in args.redo}
        with tempfile.TemporaryDirectory() as work:
            for scope in args.scopes:
                for fam in families(scope):
                    if (args.families and fam not in args.families) or (scope, fam) in done:
                        continue
                    row = sweep_one(scope, fam, args.backbone, work, args.size,
                                    train=not args.no_train, time_limit=args.time_limit)
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
