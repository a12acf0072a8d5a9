"""Speed / memory benchmark of the attention operators and backbones (a tool, not a test).

    python benchmarks/benchmark.py --ops --backbones --csv out.csv --png out.png
    python benchmarks/benchmark.py --quick                    # seconds; used in CI
    python benchmarks/benchmark.py --ops --device cuda --dtype bf16
    python benchmarks/benchmark.py --train --device cuda --amp bf16 --execs eager,compile
    python benchmarks/benchmark.py --whole-models --device cuda --resolutions 800x1344
    python benchmarks/benchmark.py --classifiers --classifier-batches 8,32 --device cuda
    python benchmarks/benchmark.py --profile --families flatten-pvt-v2-b0 --batch 2
    python benchmarks/benchmark.py --markdown table.md --from-csv docs/benchmarks/x.csv

Op level: FLA (fused / unfused), plain ReLU linear attention, SimA (auto and both
orders), QuadTree A/B and softmax (``F.scaled_dot_product_attention``) on ``q, k, v``
after the projections, over ``--sides`` (``N = s * s`` tokens) and ``--head-dims``.
Backbone level: each flatten_mm backbone against its softmax counterpart (timm, and
mmdet when installed) at ``--resolutions``. All cases of a group alternate in one
process after warm-up; the tables give medians, minima, images/s and peak memory, the
ratio table ours / baseline. ``--check`` lists the ops of a training step and an inference
forward that make the host wait for ``--device`` (fast paths against reference paths are
tests: ``pytest -m cuda tests/test_layers/test_fast_paths.py``). ``--sima-grid`` checks SimA's automatic order against both
fixed orders; ``--compile`` reports ``torch.compile`` graph breaks of every backbone
(and compiles them with ``--compile-backend``).

Training: ``--train`` (or ``--steps forward,train``) times forward + backward + AdamW
step of the same backbone pairs (default batch 8 at 512², 1024², 800x1344), under
``--amp bf16`` autocast if asked, eager and / or ``torch.compile`` (``--execs
eager,compile``), with the peak memory of a step; ``--whole-models`` does the same for a
whole Mask R-CNN (FLatten-PVTv2-b0 vs mmdet PVTv2-b0) and UperNet (FLatten-Swin-T vs
mmseg Swin-T) built from our configs (default batch 2); ``--classifiers`` (also run by
``--train``) the ImageNet classifiers of ``configs/mmpretrain`` at 224x224 against the
softmax counterparts' (``--classifier-batches``, default 8 and 32): what pretraining
costs. ``--profile`` writes the
``torch.profiler`` table of one forward + backward (top kernels, launches per forward /
backward and per block, bytes moved vs ideal). ``--markdown`` writes README-style
tables of the run (or, with ``--from-csv``, of stored CSVs without running anything).
The ``FLATTEN_MM_TRITON`` setting of the process is recorded in every step row
(``kernels``). See ``benchmarks/core/``.
"""
import argparse
import datetime
import json
import os
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import core as bm  # noqa: E402

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--ops', action='store_true', help='run the op-level suite')
    p.add_argument('--backbones', action='store_true', help='run the backbone suite')
    p.add_argument('--sima-grid', action='store_true',
                   help='SimA automatic order vs both fixed orders on an (N, d) grid')
    p.add_argument('--check', action='store_true',
                   help='the ops of a training step / inference forward that make the host '
                   'wait for --device (none expected)')
    p.add_argument('--compile', action='store_true',
                   help='torch.compile graph-break report of every backbone (small input)')
    p.add_argument('--compile-backend', default=None,
                   help='also compile and run with this backend (e.g. inductor, aot_eager)')
    p.add_argument('--train', action='store_true',
                   help='training-step suite: forward + backward + AdamW step of the '
                   'backbone pairs (same as --steps train)')
    p.add_argument('--steps', default=None,
                   help='step suite with these step kinds: forward, train (comma-separated)')
    p.add_argument('--execs', default='eager',
                   help='step suites: eager and / or compile (torch.compile with '
                   '--compile-backend, default inductor), comma-separated')
    p.add_argument('--amp', default='fp32', choices=sorted(DTYPES),
                   help='autocast dtype of the step, whole-model and profile suites '
                   '(torch.autocast(device_type)); weights stay fp32')
    p.add_argument('--whole-models', action='store_true',
                   help='training steps of whole Mask R-CNN / UperNet configs, ours vs the '
                   'same config with the softmax backbone')
    p.add_argument('--model-names', default=None,
                   help='comma-separated subset of the whole models (default all)')
    p.add_argument('--classifiers', action='store_true',
                   help='training steps of the ImageNet classifiers (configs/mmpretrain) at '
                   '224x224, ours vs the softmax counterpart: what pretraining costs (also '
                   'run by --train)')
    p.add_argument('--classifier-batches', default=None,
                   help='batches of --classifiers, comma-separated (default 8,32)')
    p.add_argument('--classifier-names', default=None,
                   help='comma-separated subset of the classifiers (default all)')
    p.add_argument('--profile', action='store_true',
                   help='torch.profiler table of one forward + backward of each backbone of '
                   '--families and its baselines, at the first of --resolutions')
    p.add_argument('--profile-top', type=int, default=15, help='kernels listed per model')
    p.add_argument('--interpret-kernels', action='store_true',
                   help='with --profile on cpu: our operators run their Triton kernels under '
                   "Triton's interpreter (sets TRITON_INTERPRET=1): the launches and bytes of "
                   'the CUDA path, counted without a GPU (no times)')
    p.add_argument('--markdown', default=None,
                   help='write README-style markdown tables (ratios, profile) to this file')
    p.add_argument('--from-csv', default=None,
                   help='with --markdown: read these CSVs (comma-separated) instead of '
                   'running anything')
    p.add_argument('--quick', action='store_true',
                   help='tiny sizes and models, 2 rounds (smoke test; numbers meaningless)')
    p.add_argument('--device', default='cpu', help='cpu or cuda')
    p.add_argument('--dtype', default='fp32', choices=sorted(DTYPES))
    p.add_argument('--threads', type=int, default=None,
                   help='torch CPU threads (default: leave as is)')
    p.add_argument('--op-names', default=','.join(bm.OPS), help='comma-separated ops')
    p.add_argument('--sides', default='32,64,128,256', help='map sides s, N = s*s')
    p.add_argument('--head-dims', default='32,64')
    p.add_argument('--heads', type=int, default=1)
    p.add_argument('--max-quadratic-tokens', type=int, default=128 * 128,
                   help='skip softmax / SimA qk_first above this N')
    p.add_argument('--quadtree-topk', type=int, default=32)
    p.add_argument('--resolutions', default=None,
                   help='backbone inputs, HxW (or S for SxS), comma-separated (default: '
                   '224,512,1024,800x1280 for --backbones, 512,1024,800x1344 for the step '
                   'suites, 512 for --profile)')
    p.add_argument('--families', default=None,
                   help='comma-separated backbones of ours to run (default: all)')
    p.add_argument('--batch', type=int, default=None,
                   help='images per call (default: 1 for --ops/--backbones, 8 for the step '
                   'suite, 2 for --whole-models and --profile)')
    p.add_argument('--warmup', type=int, default=None)
    p.add_argument('--repeats', type=int, default=None)
    p.add_argument('--no-memory', action='store_true', help='skip the peak-memory pass')
    p.add_argument('--csv', default=None, help='write all rows to this CSV')
    p.add_argument('--png', default=None, help='write the op scaling plot to this PNG')
    p.add_argument('--json', default=None, help='write rows + environment as JSON')
    args = p.parse_args(argv)
    if args.train and not args.steps:
        args.steps = 'train'
    if args.train:
        args.classifiers = True
    if args.from_csv and not args.markdown:
        p.error('--from-csv needs --markdown')
    if args.interpret_kernels and not (args.profile and args.device == 'cpu'):
        p.error('--interpret-kernels needs --profile and --device cpu (the interpreter runs '
                'the kernels on CPU tensors; on a GPU they run for real)')
    if not (args.ops or args.backbones or args.sima_grid or args.compile or args.check
            or args.steps or args.whole_models or args.classifiers or args.profile
            or args.from_csv):
        args.ops = args.backbones = True
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret_kernels:  # before any kernel module is imported (see --help)
        os.environ['TRITON_INTERPRET'] = '1'
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    env = bm.environment()
    env['date'] = datetime.date.today().isoformat()
    print(f'# flatten_mm benchmark {env["date"]}: {env.get("gpu", env["cpu"])}, '
          f'torch {env["torch"]}, {torch.get_num_threads()} threads, device {args.device}, '
          f'{args.dtype}' + (f', autocast {args.amp}' if args.amp != 'fp32' else ''))
    rows, ratios = [], []
    quick = args.quick
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)

    checks = None
    if args.check:
        checks = dict(host_syncs=bm.backbone_host_syncs(torch.device(args.device)))
        print('\n## Host syncs of a training step and an inference forward (none expected; '
              'fast paths vs reference paths: pytest -m cuda tests/test_layers/'
              'test_fast_paths.py)\n')
        for name, value in checks.items():
            print(f'- {name}: {json.dumps(value)}')

    if args.ops:
        sides = (8, 16) if quick else bm.parse_ints(args.sides)
        dims = (16, ) if quick else bm.parse_ints(args.head_dims)
        op_rows = bm.run_op_benchmark(
            ops=tuple(args.op_names.split(',')), sides=sides, head_dims=dims,
            num_heads=args.heads, batch=args.batch or 1, device=args.device, dtype=dtype,
            warmup=warmup, repeats=args.repeats or (2 if quick else 10),
            max_quadratic_tokens=args.max_quadratic_tokens, memory=not args.no_memory,
            quadtree_topk=4 if quick else args.quadtree_topk, log=log)
        rows += op_rows
        print('\n## Op level (q, k, v after the projections)\n')
        print(bm.format_table(op_rows, bm.OP_COLUMNS))
        exps = bm.op_exponents(op_rows)
        print('\nFitted time exponents (median ~ N^a): ' + ', '.join(
            f'{n} d={d}: {a:.2f}' for (n, d), a in sorted(exps.items())))

    if args.sima_grid:
        grid = bm.run_sima_order_grid(
            tokens=(16, 32, 64) if quick else (16, 32, 48, 64, 96, 128, 192, 256, 512, 1024),
            head_dims=(16, 32) if quick else (32, 48, 64, 128), device=args.device,
            warmup=warmup, repeats=args.repeats or (2 if quick else 15), log=log)
        rows += grid
        print('\n## SimA order: automatic vs fixed\n')
        print(bm.format_table(grid, bm.SIMA_COLUMNS))
        print(f'\nworst auto / best: {max(r["auto_vs_best"] for r in grid):.3f} (min times), '
              f'{max(r["auto_vs_best_median"] for r in grid):.3f} (medians); worst picked '
              f'order / best: {max(r["chosen_vs_best"] for r in grid):.3f}')

    if args.backbones:
        pairs = _pairs(args, quick)
        bb_rows = bm.run_backbone_benchmark(
            pairs=pairs, resolutions=((64, 64), ) if quick else bm.parse_resolutions(
                args.resolutions or '224,512,1024,800x1280'),
            batch=args.batch or 1, device=args.device, dtype=dtype,
            warmup=args.warmup if args.warmup is not None else 1,
            repeats=args.repeats or (2 if quick else 5), memory=not args.no_memory,
            quick=quick, log=log)
        rows += bb_rows
        ratios = bm.ratio_rows(bb_rows, pairs)
        print('\n## Backbones (batch %d, inference)\n' % (args.batch or 1))
        print(bm.format_table(bb_rows, bm.BACKBONE_COLUMNS))
        print('\n## Ours / softmax counterpart\n')
        print(bm.format_table(ratios, bm.RATIO_COLUMNS))

    if args.compile:
        compile_rows = run_compile(args, quick)
        rows += compile_rows
        print('\n## torch.compile\n')
        print(bm.format_table(compile_rows, (('name', 'backbone'), ('graphs', 'graphs'),
                                             ('graph_breaks', 'graph breaks'),
                                             ('max_abs_diff', 'max |compiled - eager|'),
                                             ('note', 'note'))))

    amp = DTYPES[args.amp]

    def save_partial():  # the step suites save after every group (time-boxed runs)
        if args.csv:
            bm.write_csv(rows + [dict(r, suite='ratio', name=r['ours']) for r in ratios],
                         args.csv)
        if args.json:
            write_json(args.json, env, rows, ratios, checks)

    if args.steps:
        step_rows, pairs = [], _pairs(args, quick)
        sizes = ((64, 64), ) if quick else bm.parse_resolutions(args.resolutions
                                                        or '512,1024,800x1344')
        for hw, ours in [(hw, ours) for hw in sizes for ours in pairs]:
            new_rows = bm.run_step_benchmark(
                pairs={ours: pairs[ours]}, resolutions=(hw, ),
                batch=args.batch or (2 if quick else 8),
                device=args.device, amp=amp, steps=tuple(args.steps.split(',')),
                execs=tuple(args.execs.split(',')),
                compile_backend=args.compile_backend or 'inductor', warmup=warmup,
                repeats=args.repeats or (2 if quick else 5), memory=not args.no_memory,
                quick=quick, log=log)
            step_rows += new_rows
            rows += new_rows
            ratios += bm.step_ratio_rows(new_rows, pairs)
            save_partial()
        step_ratios = bm.step_ratio_rows(step_rows, pairs)
        print('\n## Steps (batch %d, %s)\n' % (args.batch or (2 if quick else 8), args.amp))
        print(bm.format_table(step_rows, bm.STEP_COLUMNS))
        print('\n## Steps: ours / softmax counterpart\n')
        print(bm.format_table(step_ratios, bm.STEP_RATIO_COLUMNS))

    if args.whole_models:
        model_rows = []
        for hw in ((64, 64), ) if quick else bm.parse_resolutions(args.resolutions
                                                          or '512,1024,800x1344'):
            new_rows = bm.run_whole_model_benchmark(
                input_hws=(hw, ), batch=args.batch or (1 if quick else 2), device=args.device,
                amp=amp, names=args.model_names.split(',') if args.model_names else None,
                warmup=warmup, repeats=args.repeats or (1 if quick else 5),
                memory=not args.no_memory, quick=quick, log=log)
            model_rows += new_rows
            rows += new_rows
            ratios += bm.step_ratio_rows(new_rows, bm.whole_model_pairs(quick),
                                         suite='model_step')
            save_partial()
        model_ratios = bm.step_ratio_rows(model_rows, bm.whole_model_pairs(quick),
                                          suite='model_step')
        print('\n## Whole models, training step (%s)\n' % args.amp)
        print(bm.format_table(model_rows, bm.STEP_COLUMNS))
        print('\n## Whole models: ours / softmax counterpart\n')
        print(bm.format_table(model_ratios, bm.STEP_RATIO_COLUMNS))

    if args.classifiers:
        names = args.classifier_names.split(',') if args.classifier_names else None
        cls_rows = bm.run_classifier_benchmark(
            batches=(2, ) if quick else bm.parse_ints(args.classifier_batches or '8,32'),
            input_hw=(64, 64) if quick else (224, 224), device=args.device, amp=amp,
            names=('flatten-pvt-v2-b0', ) if quick else names, warmup=warmup,
            repeats=args.repeats or (1 if quick else 5), memory=not args.no_memory, log=log)
        rows += cls_rows
        cls_ratios = bm.step_ratio_rows(cls_rows, bm.classifier_pairs(),
                                        suite='classifier_step')
        ratios += cls_ratios
        save_partial()
        print('\n## ImageNet classifiers, training step (%s)\n' % args.amp)
        print(bm.format_table(cls_rows, bm.CLASSIFIER_COLUMNS))
        print('\n## ImageNet classifiers: ours / softmax counterpart\n')
        print(bm.format_table(cls_ratios, bm.CLASSIFIER_RATIO_COLUMNS))

    profile = None
    if args.profile:
        hw = (64, 64) if quick else bm.parse_resolutions(args.resolutions or '512')[0]
        summaries, kernels = bm.run_profile(
            _pairs(args, quick), hw=hw, batch=args.batch or 2, device=args.device, amp=amp,
            top=args.profile_top, quick=quick, log=log,
            interpret_kernels=args.interpret_kernels)
        rows += summaries + kernels
        profile = (summaries, kernels)
        print('\n' + profile_markdown(summaries, kernels, hw, args, env))

    if args.from_csv:
        stored = [r for path in args.from_csv.split(',') for r in bm.read_csv(path)]
        ratios = [r for r in stored if r.get('suite') == 'ratio']
        profs = [r for r in stored if r.get('suite') == 'profile']
        profile = (profs, [r for r in stored if r.get('suite') == 'profile_kernel'])
        if not ratios and not profs:
            print(f'no ratio or profile rows in {args.from_csv}', file=sys.stderr)
            return 1
        if not profs:
            profile = None

    if args.markdown:
        parts = [f'<!-- written by benchmarks/benchmark.py on {env["date"]} '
                 f'({env.get("gpu", env["cpu"])}, torch {env["torch"]}) -->']
        if ratios:
            parts.append(bm.markdown_ratio_table(ratios))
        if profile is not None:
            prof_rows, kern_rows = profile
            hw = (prof_rows[0].get('height'), prof_rows[0].get('width')) if prof_rows else None
            parts.append(profile_markdown(prof_rows, kern_rows, hw, args, env))
        with open(args.markdown, 'w') as f:
            f.write('\n\n'.join(parts) + '\n')
        print(f'\nmarkdown: {args.markdown}')

    if args.csv:
        bm.write_csv(rows + [dict(r, suite='ratio', name=r['ours']) for r in ratios], args.csv)
        print(f'\nCSV: {args.csv}')
    if args.png:
        ok = bm.plot_scaling(rows, args.png, title=f'flatten_mm ops, {args.device} '
                             f'{args.dtype}, {torch.get_num_threads()} threads, {env["date"]}')
        print(f'PNG: {args.png}' if ok else 'PNG: skipped (no matplotlib or no op rows)')
    if args.json:
        write_json(args.json, env, rows, ratios, checks)
    return 0


def write_json(path, env, rows, ratios, checks) -> None:
    """Rows (private ``_`` keys dropped), ratios, checks and the environment as JSON."""
    with open(path, 'w') as f:
        json.dump(dict(environment=env, rows=[{k: v for k, v in r.items()
                                               if not k.startswith('_')} for r in rows],
                       ratios=ratios, checks=checks), f, indent=1, default=str)


def _pairs(args, quick: bool):
    return bm.select_pairs(args.families, quick)


def profile_markdown(summaries, kernels, hw, args, env) -> str:
    """The profile tables: one summary line per model, then its top kernels."""
    units = {}
    for r in summaries:
        if r.get('launch_unit'):
            units.setdefault(r.get('kernels') == 'interpreted', r['launch_unit'])
    unit = ' / '.join(units.values())
    if len(units) == 2:
        unit = (f"{units[True]} for the rows whose kernels are `interpreted` (our operators "
                "forced onto their Triton kernels, run by Triton's interpreter: what the CUDA "
                f"path dispatches; no times), {units[False]} for the others")
    size = f'{hw[0]}x{hw[1]}' if hw else ''
    batch = summaries[0].get('batch') if summaries else ''
    lines = [f'### Profile: one forward + backward, batch {batch}, {size}, '
             f'{summaries[0].get("device") if summaries else ""} '
             f'({env.get("gpu", env["cpu"])}), {env["date"]}', '',
             f'Launches = {unit}; per block = launches / blocks; aten ops = non-view aten '
             'ops below autograd (what runs as kernels without fusion). Bytes moved = sum over '
             'non-view aten ops of input + output tensor bytes; attention ideal = sum over '
             'attention layers of their input + output activations (forward; see '
             '`benchmarks/core/profiling.py`).', '',
             bm.format_table(summaries, bm.PROFILE_COLUMNS)]
    by_model = {}
    for k in kernels:
        by_model.setdefault((k['name'], k.get('amp'), k.get('kernels')), []).append(k)
    for (name, amp, kind), ks in by_model.items():
        title = 'Most frequent launches, views left out (interpreted kernels, no times)' \
            if kind == 'interpreted' else 'Top kernels by self time'
        lines += ['', f'{title}: {name} ({amp})', '', bm.format_table(ks, bm.KERNEL_COLUMNS[1:])]
    return '\n'.join(lines)


def run_compile(args, quick: bool):
    """Graph breaks (and, with ``--compile-backend``, compiled outputs) of every backbone
    family on a small model."""
    rows = []
    for name, (model, hw) in bm.tiny_backbones().items():
        x = torch.randn(1, 3, *hw)
        rep = bm.compile_report(model, x, backend=args.compile_backend)
        note = rep['error'] or '; '.join(rep['break_reasons'])
        rows.append(dict(suite='compile', name=name, height=hw[0], width=hw[1],
                         graphs=rep['graphs'], graph_breaks=rep['graph_breaks'],
                         max_abs_diff=rep['max_abs_diff'], note=note or None))
        log(f'compile {name}: {rows[-1]}')
    return rows


if __name__ == '__main__':
    sys.exit(main())
