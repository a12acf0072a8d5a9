"""Export a backbone, mmseg segmentor or mmdet detector to ONNX (and check it in ONNX Runtime).

    python tools/deployment/export_onnx.py CONFIG [CHECKPOINT] -o model.onnx \
        [--shape H W] [--dynamic] [--opset N] [--custom-ops [auto]] [--check]
    python tools/deployment/export_onnx.py --backbone flatten-pvt-v2-b0 -o bb.onnx --dynamic --check

Segmentors: the decode-head logits of ``mode='tensor'``; detectors: the raw head outputs
of ``mode='tensor'`` (two-stage: backbone + neck + RPN head, see the printed note); bare
backbones (``--backbone``, catalogue names as in tools/swap_backbone.py --list): the
tuple of NCHW maps. The size range the file is valid for is printed and stored in the
file's metadata; ``flatten_mm.deploy.OnnxModel`` refuses other sizes. ``--check`` runs
the file in ONNX Runtime (CPU) on the bundled demo image and prints the max relative
difference per output to PyTorch running the same graph form (at the export size, and
with ``--dynamic`` at a second, non-square size too); it exits 1 when one exceeds
``--tol``. It also prints how far eager PyTorch is, and how many top-k selections eager
made otherwise (near-ties summed in another order): information, not a failure.
``--custom-ops`` writes flatten_mm's ONNX Runtime operators where the model has them
(QuadTree: 1.7-1.9x faster in ONNX Runtime), whether or not their library builds here;
the file then needs the library where it runs (printed; see docs/user_guides/deploy.md).
It is run once in ONNX Runtime when the library is available here, and the output says
NOT VERIFIED when it is not. ``--custom-ops auto`` writes standard operators instead
where the library is not available.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))


def parse_args(argv=None):
    from mmengine.config import DictAction
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config', nargs='?', help='mmdet / mmseg config file')
    p.add_argument('checkpoint', nargs='?', help='checkpoint (default: random weights)')
    p.add_argument('--backbone', help='export a bare catalogue backbone instead of a config')
    p.add_argument('-o', '--output', required=True, help='the .onnx file to write')
    p.add_argument('--shape', type=int, nargs='+',
                   help='export input H [W] (default 512 512; one value: square)')
    p.add_argument('--dynamic', action='store_true', help='one file for any H x W in range')
    p.add_argument('--opset', type=int, default=18, help='ONNX opset (default 18)')
    p.add_argument('--custom-ops', nargs='?', const=True, default=False, choices=['auto'],
                   help="use flatten_mm's ONNX Runtime operators where the model has them "
                        '(QuadTree levels); the file then needs their library to run. '
                        "'auto': only where the library is available here, else standard "
                        'operators')
    p.add_argument('--check', action='store_true',
                   help='compare ONNX Runtime with PyTorch on the bundled demo image')
    p.add_argument('--check-shape', type=int, nargs=2, metavar=('H', 'W'),
                   help='second size checked with --dynamic (default: 3/4 H x W + 32)')
    p.add_argument('--tol', type=float, default=1e-4,
                   help='largest max relative difference --check, the dynamic-size probe '
                        'and the custom-operator run accept (default 1e-4)')
    p.add_argument('--cfg-options', nargs='+', action=DictAction,
                   help='override config settings, key=value (as in mmdet / mmseg tools)')
    args = p.parse_args(argv)
    if bool(args.config) == bool(args.backbone):
        p.error('give either CONFIG or --backbone NAME')
    if args.backbone and args.checkpoint:
        p.error('--backbone exports random weights; a checkpoint goes with a CONFIG')
    if args.shape and len(args.shape) > 2:
        p.error('--shape takes H [W]')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from flatten_mm.deploy import backbone_target, config_target, export_onnx
    from flatten_mm.deploy.export import compare_with_pytorch, operator_library
    hw = tuple(args.shape or (512, 512))
    hw = hw * 2 if len(hw) == 1 else hw
    target = (backbone_target(args.backbone) if args.backbone else
              config_target(args.config, args.checkpoint, args.cfg_options))
    result = export_onnx(target, args.output, hw, dynamic=args.dynamic, opset=args.opset,
                         verify_tol=args.tol, custom_ops=args.custom_ops)
    meta = result.meta
    print(f'wrote {args.output}: {target.kind} {target.name}, opset {args.opset}')
    print(f'  input: {meta["input"]}')
    print(f'  outputs: {", ".join(target.output_names)}')
    for note in target.notes:
        print(f'  note: {note}')
    for msg in result.messages:
        print(f'  {msg}')
    if meta['custom_ops']:
        library, why = operator_library()
        print(f'  operator library: {library} (register it with '
              'SessionOptions.register_custom_ops_library)' if library else
              f'  operator library: not available here ({why})')
    lo, hi = result.min_hw, result.max_hw
    if result.dynamic:
        print(f'  valid input sizes: H in [{lo[0]}, {hi[0]}], W in [{lo[1]}, {hi[1]}] (dynamic)')
    else:
        print(f'  valid input size: {lo[0]}x{lo[1]} only (fixed)')
    if not args.check:
        return 0
    if meta['custom_ops'] and operator_library()[0] is None:
        print('FAILED: --check cannot run a file of custom operators without their library')
        return 1
    sizes = [hw]
    if result.dynamic:
        sizes.append(tuple(args.check_shape or (max(lo[0], hw[0] * 3 // 4), hw[1] + 32)))
    return _report(target, compare_with_pytorch(target, args.output, sizes, args.tol), args.tol)


def _report(target, checks, tol: float) -> int:
    """Print the checks; 1 when ONNX Runtime and PyTorch's graph form differ."""
    from flatten_mm.deploy.export import MAX_UNMATCHED
    worst, unmatched = 0.0, 0.0
    for check in checks:
        print(f'check {check.hw[0]}x{check.hw[1]} (ONNX Runtime CPU vs PyTorch running the '
              'exported graph form, max relative difference):')
        if target.instance_key:
            print(f'  instances ({", ".join(target.instance_key)}): {check.instances[0]} '
                  'in PyTorch, '
                  f'{check.instances[1]} in ONNX Runtime; without a counterpart: '
                  f'{check.unmatched[0]} / {check.unmatched[1]} (near-ties in top-k / NMS); '
                  'differences over matched rows')
        for name, d in zip(target.output_names, check.diffs):
            print(f'  {name}: {d:.3e}')
        worst = max([worst] + check.diffs)
        unmatched = max(unmatched, check.unmatched_fraction)
        if check.eager is not None:
            print(f'  eager PyTorch (not a verdict): up to {max(check.eager.diffs, default=0):.3e}'
                  f'{_flips(check.flips)}')
    if unmatched > MAX_UNMATCHED:
        print(f'FAILED: {unmatched:.1%} of the instances differ (> {MAX_UNMATCHED:.0%})')
        return 1
    ok = worst <= tol
    print(f'{"OK" if ok else "FAILED"}: worst {worst:.3e} {"<=" if ok else ">"} {tol:g}')
    return 0 if ok else 1


def _flips(flips) -> str:
    if flips is None:
        return ''
    flipped, total = flips
    if not flipped:
        return f'; top-k selections: all {total} as in the graph form' if total else ''
    return (f'; top-k selections flipped: {flipped} of {total} (near-ties that eager sums in '
            'another order break the other way)')


if __name__ == '__main__':
    sys.exit(main())
