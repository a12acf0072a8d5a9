"""Break one thing at a time in a copy of the repository and see which test notices.

    .venv/bin/python tests/mutation_check.py [--only NAME ...] [--list] [--keep]

Each mutant replaces one snippet (a line, or a few lines where one is not unique) of one
file by a broken version -- what a plausible slip or regression would look like -- and
runs a small test selection named with it. The working tree (tracked and untracked,
not ignored files, as they are now) is copied to a temporary directory once; every
mutant is applied there, run, and reverted. First the selections run on the unbroken
copy: they must pass, or the report means nothing. A mutant is caught when its selection
fails; the report names the failing tests. Exit status 0 when every mutant is caught.

``../shared`` (golden fixtures, key listings) is the one next to this checkout
(``FLATTEN_MM_SHARED`` is set for the copy). Runs take about a minute per mutant on a
2-core machine (pytest start, mmdet / mmseg imports).
"""
import argparse
import os
import os.path as osp
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Tuple

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))


@dataclass
class Mutant:
    name: str
    why: str
    path: str
    old: str
    new: str
    tests: Tuple[str, ...]


MUTANTS: List[Mutant] = [
    # --- issue #36: Pretrained weights through a detector / segmentor config
    Mutant('pvt-is-init', 'PVT constructor marks itself initialised: mmengine skips its '
           'init_weights inside a detector, a Pretrained backbone trains from random weights',
           'flatten_mm/models/backbones/pvt.py',
           '            prev_dims = embed_dims[i]\n        self._freeze_stages()\n',
           '            prev_dims = embed_dims[i]\n        self._freeze_stages()\n'
           '        self._is_init = True\n',
           ('tests/test_e2e_pretrained.py', '-k', 'model_init_weights and retinanet')),
    Mutant('pvt-is-init-train-py', 'the same, seen through one tools/train.py iteration',
           'flatten_mm/models/backbones/pvt.py',
           '            prev_dims = embed_dims[i]\n        self._freeze_stages()\n',
           '            prev_dims = embed_dims[i]\n        self._freeze_stages()\n'
           '        self._is_init = True\n',
           ('tests/test_e2e_pretrained.py', '-k', 'train_script')),
    Mutant('converter-swaps-blocks', 'the PVT converter maps official block j to block j^1 '
           '(keys and shapes still match for depth-2 stages)',
           'flatten_mm/checkpoints/converters/flatten_pvt.py',
           "        (r'block(\\d)\\.(\\d+)\\.(.*)', lambda m: f'stages.{s(m)}.blocks.{m.group(2)}",
           "        (r'block(\\d)\\.(\\d+)\\.(.*)', lambda m: f'stages.{s(m)}.blocks."
           "{int(m.group(2)) ^ 1}",
           ('tests/test_e2e_pretrained.py', '-k', 'model_init_weights and semantic')),
    # --- issue #36: the smoke tool's verdict
    Mutant('smoke-cli-return-0', 'tools/swap_backbone.py --train-smoke exits 0 on a failed '
           'iteration', 'tools/swap_backbone.py',
           "            print('error: --train-smoke failed: ' + '; '.join(report.failures), "
           "file=sys.stderr)\n            return 1\n",
           "            print('error: --train-smoke failed: ' + '; '.join(report.failures), "
           "file=sys.stderr)\n            return 0\n",
           ('tests/test_analysis/test_swap_smoke_verdict.py', '-k', 'cli_fails_on_a_nan_loss')),
    Mutant('smoke-ok-ignores-losses', "the report's verdict drops the loss-finiteness clause",
           'flatten_mm/swap/smoke.py',
           "        if bad:\n            out.append('non-finite losses: '",
           "        if False:\n            out.append('non-finite losses: '",
           ('tests/test_analysis/test_swap_smoke_verdict.py', '-k', 'failure_alone')),
    Mutant('smoke-no-grad-blind', 'the smoke stops noticing parameters without a gradient',
           'flatten_mm/swap/smoke.py',
           "    no_grad = [f'backbone.{n}' for n, p in trainable if p.grad is None]",
           "    no_grad = [f'backbone.{n}' for n, p in trainable if p.grad is None and "
           "not p.requires_grad]",
           ('tests/test_analysis/test_swap_smoke_verdict.py', '-k', 'without_gradient')),
    # --- issue #36: tests weaker than their names
    Mutant('pvt1-pad-top-left', "PVT v1's patch embedding pads at the top / left",
           'flatten_mm/models/layers/patch_embed.py',
           '                    x = F.pad(x, (0, pad_w, 0, pad_h))',
           '                    x = F.pad(x, (pad_w, 0, pad_h, 0))',
           ('tests/test_backbones/test_pvt.py', '-k', 'padding')),
    Mutant('with-cp-detached', 'block checkpointing cuts the graph: outputs unchanged, no '
           'gradient reaches the earlier layers', 'flatten_mm/models/backbones/pvt.py',
           '            return cp.checkpoint(block, x, hw, use_reentrant=False)',
           '            return cp.checkpoint(block, x.detach(), hw, use_reentrant=False)',
           ('tests/test_backbones/test_quadtree_pvt.py', '-k', 'with_cp')),
    Mutant('sima-v-uncast', "sima_core leaves v in the autocast dtype (the dtype error a "
           "broad 'except RuntimeError: skip' once hid)",
           'flatten_mm/models/layers/sima_attention.py',
           '        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)',
           '        q, k, v = q.to(dtype), k.to(dtype), v',
           ('tests/test_layers/test_sima_attention.py', '-k', 'autocast_is_finite')),
    Mutant('swin-pos-drop-not-stem', "FLatten-Swin's dropout after the stem keeps training "
           'with frozen_stages >= 0 (no parameters: a requires_grad check cannot see it)',
           'flatten_mm/models/backbones/flatten_swin.py',
           "    stem_names = ('patch_embed', 'pos_drop')", "    stem_names = ('patch_embed', )",
           ('tests/test_backbones/test_freezing_and_loading.py', '-k',
            'frozen_stages_follow_mmdet and FLattenSwin')),
    # --- issue #36: a broken install must not turn into skips in CI
    Mutant('ci-rule-ignores-CI', 'CI=true no longer makes a missing mmdet / mmseg an error',
           'tests/required_packages.py',
           "            or os.environ.get('CI', '').lower() in ('true', '1'))",
           "            or os.environ.get('CI', '').lower() in ())",
           ('tests/test_required_packages.py::test_missing_required_package_fails_in_ci[CI=true]',)),
    Mutant('ci-rule-skips', 'the CI rule leaves the skip as it is',
           'tests/required_packages.py',
           "    report.outcome = 'failed'", "    report.outcome = 'skipped'",
           ('tests/test_required_packages.py', '-k', 'every_required_package')),
]


def copy_tree(dst: str) -> None:
    """Tracked and untracked (not ignored) files of the working tree, as they are now."""
    files = subprocess.run(['git', 'ls-files', '-co', '--exclude-standard', '-z'], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split('\0')
    for rel in filter(None, files):
        src = osp.join(REPO, rel)
        if not osp.isfile(src):  # deleted in the working tree
            continue
        os.makedirs(osp.dirname(osp.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, osp.join(dst, rel))


def run_selection(root: str, tests: Tuple[str, ...]) -> Tuple[int, List[str], float, str]:
    shared = os.environ.get('FLATTEN_MM_SHARED', osp.join(osp.dirname(REPO), 'shared'))
    env = dict(os.environ, FLATTEN_MM_SHARED=shared,
               PYTHONPATH=os.pathsep.join([root, os.environ.get('PYTHONPATH', '')]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-rfE', '-p', 'no:cacheprovider',
                           '-x', *tests], cwd=root, env=env, capture_output=True, text=True)
    failed = re.findall(r'^(?:FAILED|ERROR) (\S+)', proc.stdout, flags=re.M)
    return proc.returncode, failed, time.perf_counter() - t0, proc.stdout[-3000:]


def apply(root: str, m: Mutant) -> str:
    path = osp.join(root, m.path)
    with open(path) as f:
        text = f.read()
    with open(path, 'w') as f:
        f.write(text.replace(m.old, m.new))
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--only', nargs='+', help='mutant names (see --list)')
    p.add_argument('--list', action='store_true', help='print the mutants and exit')
    p.add_argument('--keep', action='store_true', help='keep the temporary copy')
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list or not mutants:
        for m in MUTANTS:
            print(f'{m.name:26s} {m.path}: {m.why}')
        return 0 if args.list else 2
    root = tempfile.mkdtemp(prefix='flatten_mm_mutants_')
    try:
        copy_tree(root)
        where = subprocess.run([sys.executable, '-c', 'import flatten_mm; print(flatten_mm.__file__)'],
                               cwd=root, env=dict(os.environ, PYTHONPATH=root), check=True,
                               capture_output=True, text=True).stdout.strip()
        if not where.startswith(root):  # an installed copy would hide every mutant
            raise SystemExit(f'the copy imports flatten_mm from {where}, not from {root}')
        for m in mutants:  # every snippet must still be there, once
            with open(osp.join(root, m.path)) as f:
                count = f.read().count(m.old)
            if count != 1:
                raise SystemExit(f'{m.name}: the snippet occurs {count} times in {m.path} '
                                 '(must be once); update the mutant')
        selections = list(dict.fromkeys(m.tests for m in mutants))
        for tests in selections:
            code, failed, secs, tail = run_selection(root, tests)
            print(f'baseline {" ".join(tests)}: exit {code} ({secs:.0f}s)', flush=True)
            if code != 0:
                print(tail)
                print('the unbroken copy fails this selection: fix that first')
                return 2
        missed = []
        print(f'\n{"mutant":26s} {"caught":6s} {"time":>5s}  by')
        for m in mutants:
            original = apply(root, m)
            try:
                code, failed, secs, tail = run_selection(root, m.tests)
            finally:
                with open(osp.join(root, m.path), 'w') as f:
                    f.write(original)
            caught = code != 0
            if not caught:
                missed.append(m.name)
            by = ', '.join(failed) if failed else ('(no test failed)' if not caught else
                                                    f'exit {code}')
            print(f'{m.name:26s} {"yes" if caught else "NO":6s} {secs:4.0f}s  {by}', flush=True)
        print(f'\n{len(mutants) - len(missed)} of {len(mutants)} mutants caught'
              + (f'; missed: {", ".join(missed)}' if missed else ''))
        return 1 if missed else 0
    finally:
        if args.keep:
            print(f'copy kept at {root}')
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
