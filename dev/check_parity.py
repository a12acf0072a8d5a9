"""Check checkpoint parity of flatten_mm against golden fixtures of the official code.

    python dev/check_parity.py FIXTURE.pt [FIXTURE.pt ...] [--tol 1e-5] [--autograd]

For each fixture: build the flatten_mm backbone from the official constructor
arguments, convert the official state dict, run the fixture input (eval, float32) and
compare the documented output points. Prints the max abs / relative difference per
output and the worst one per fixture; exits 1 if any output is above
``tol * max(1, max|ref|)`` (default ``dev.parity.core.REL_TOL`` = 1e-5), with the
worst output of the failing fixtures in the message.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch  # noqa: E402

from dev.parity import run_parity  # noqa: E402
from dev.parity.core import REL_TOL  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('fixtures', nargs='+', help='fixture .pt files')
    parser.add_argument('--tol', type=float, default=REL_TOL,
                        help='relative tolerance: max|diff| <= TOL * max(1, max|ref|) per '
                        f'output (default {REL_TOL:g})')
    parser.add_argument('--autograd', action='store_true',
                        help='run with autograd (the training code path) instead of no_grad')
    parser.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    args = parser.parse_args(argv)
    if not args.tol > 0:
        parser.error(f'--tol must be positive, got {args.tol}')
    if args.threads:
        torch.set_num_threads(args.threads)
    failures, worst = [], None
    for path in args.fixtures:
        fx = torch.load(path, map_location='cpu', weights_only=True)
        report = run_parity(fx, name=path, rel_tol=args.tol, autograd=args.autograd)
        print(report.format(), flush=True)
        w = report.worst
        if w is not None and (worst is None or w.rel_diff > worst[1].rel_diff):
            worst = (path, w)
        if not report.passed:
            failures.append(f'{path} (worst {w.summary() if w else "no outputs"})')
    n = len(args.fixtures)
    print(f'{n - len(failures)} passed, {len(failures)} failed'
          + (f'; worst overall {worst[0]} {worst[1].summary()}' if worst else ''))
    if failures:
        print('parity check FAILED: ' + '; '.join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
