"""Check checkpoint parity of flatten_mm against golden fixtures of the official code.

    python tools/check_parity.py FIXTURE.pt [FIXTURE.pt ...]

For each fixture: build the flatten_mm backbone from the official constructor
arguments, convert the official state dict, run the fixture input (eval, float32) and
compare the documented output points. Prints the max abs / relative difference per
stage; exits 1 if any fixture is above tolerance (see ``flatten_mm.parity``).
"""
import argparse
import sys

import torch

from flatten_mm.parity import run_parity


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('fixtures', nargs='+', help='fixture .pt files')
    parser.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    failed = 0
    for path in args.fixtures:
        fx = torch.load(path, map_location='cpu', weights_only=True)
        report = run_parity(fx, name=path)
        print(report.format(), flush=True)
        failed += not report.passed
    print(f'{len(args.fixtures) - failed} passed, {failed} failed')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
