"""Export one config per (family, model kind) of ``configs/`` through ``export_onnx`` and
record what came out: dynamic or fixed size (and why), outputs, the worst ONNX Runtime vs
PyTorch difference at each checked size, export time.

    python dev/export_sweep.py [--out docs/reports/deploy_support.csv] [--only REGEX]
        [--update]

The backbone of each config is shrunk to the reliability suite's tiny arch of its class
(``tests/test_reliability/backbone_specs.py``: random weights, seconds per forward) and
the neck / head ``in_channels`` follow it; heads, necks, RPN, RoI heads and
pre-processing are the config's own. Representative: per directory the smallest-arch
config of each kind (``mask-rcnn``, ``cascade-mask-rcnn``, ``retinanet``, ``fpn``,
``upernet``).
"""
import argparse
import glob
import os.path as osp
import re
import sys
import tempfile
import time
import traceback

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, osp.join(ROOT, 'tests', 'test_reliability'))

from dev.sweeps.table import upsert_rows, write_table  # noqa: E402

KINDS = ('cascade-mask-rcnn', 'mask-rcnn', 'retinanet', 'fpn', 'upernet')
FIELDS = ['config', 'kind', 'backbone', 'export_hw', 'dynamic', 'static_reason', 'outputs',
          'checks', 'worst_rel_diff', 'export_s', 'status', 'error']


def representatives(only=None):
    picked = {}
    for path in sorted(glob.glob(osp.join(ROOT, 'configs', 'mm*', '*', '*.py'))):
        rel = osp.relpath(path, ROOT)
        if only and not re.search(only, rel):
            continue
        base = osp.basename(path)
        kind = next((k for k in KINDS if base.startswith(k + '_')), None)
        if kind is None:
            continue
        key = (osp.dirname(rel), kind)
        # smallest arch first: b0 < b1, t < s < b, s12 < s24 ... (shortest, then sorted)
        rank = (0 if re.search(r'-(b0|t|t12|tiny)[-_]', base) else 1, len(base), base)
        if key not in picked or rank < picked[key][0]:
            picked[key] = (rank, rel, kind)
    return [(rel, kind) for _, rel, kind in sorted(picked.values(), key=lambda v: v[1])]


def _tiny_overrides(cfg):
    from backbone_specs import TINY_ARCHS
    from flatten_mm.registry import MODELS
    bb = cfg.model.backbone
    name = str(bb.type).split('.')[-1]
    if name not in TINY_ARCHS:
        raise KeyError(f'no tiny arch for {name}')
    kwargs = dict(TINY_ARCHS[name]['kwargs'])
    keep = {k: v for k, v in bb.items() if k in ('out_indices', 'attn_cfg', 'stage_cfgs')}
    if 'attn_cfg' in keep and 'attn_cfg' in kwargs:
        keep['attn_cfg'] = dict(keep['attn_cfg'], **kwargs.pop('attn_cfg'))
    new_bb = dict(type=bb.type, **kwargs, **{k: v for k, v in keep.items() if k not in kwargs})
    model = MODELS.build(new_bb)
    chans = list(model.out_channels)
    over = {'model.backbone': dict(_delete_=True, **new_bb)}
    neck = cfg.model.get('neck')
    if neck is not None and isinstance(neck.get('in_channels'), (list, tuple)):
        over['model.neck.in_channels'] = chans
    if neck is None:  # heads read the backbone (UperNet); behind a neck they read the neck
        for head in ('decode_head', 'auxiliary_head'):
            h = cfg.model.get(head)
            if h is None:
                continue
            if isinstance(h.get('in_channels'), (list, tuple)):
                over[f'model.{head}.in_channels'] = [chans[i] for i in
                                                     h.get('in_index', range(4))]
            elif isinstance(h.get('in_channels'), int):
                over[f'model.{head}.in_channels'] = chans[h.get('in_index', -1)]
    return name, over


def run_one(rel, kind, hw, tmpdir):
    from mmengine.config import Config
    from flatten_mm.deploy import config_target, export_onnx
    from flatten_mm.deploy.export import MAX_UNMATCHED, compare_with_pytorch
    row = dict(config=rel, kind=kind)
    cfg = Config.fromfile(osp.join(ROOT, rel))
    name, over = _tiny_overrides(cfg)
    row['backbone'] = name
    cfg.merge_from_dict(over)
    target = config_target(cfg)
    hw = (max(hw[0], target.min_hw[0]), max(hw[1], target.min_hw[1]))
    row['export_hw'] = f'{hw[0]}x{hw[1]}'
    path = osp.join(tmpdir, 'model.onnx')
    t = time.perf_counter()
    result = export_onnx(target, path, hw, dynamic=True)
    row['export_s'] = f'{time.perf_counter() - t:.1f}'
    row['dynamic'] = str(result.dynamic).lower()
    row['static_reason'] = result.meta['static_reason']
    row['outputs'] = ' '.join(target.output_names)
    sizes = [hw]
    if result.dynamic:
        sizes.append((max(result.min_hw[0], hw[0] * 3 // 4), hw[1] + 32))
    checks = compare_with_pytorch(target, path, sizes)
    worst = max(max(c.diffs) for c in checks)
    row['checks'] = ' '.join(
        f'{c.hw[0]}x{c.hw[1]}:{max(c.diffs):.1e}' +
        (f'(unmatched {c.unmatched[0]}/{c.unmatched[1]} of {c.instances[0]}/{c.instances[1]})'
         if target.instance_key else '') for c in checks)
    row['worst_rel_diff'] = f'{worst:.2e}'
    ok = worst <= 1e-4 and all(c.unmatched_fraction <= MAX_UNMATCHED for c in checks)
    row['status'] = 'ok' if ok else 'mismatch'
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', default=osp.join(ROOT, 'docs', 'reports', 'deploy_support.csv'))
    p.add_argument('--only', help='regex on the config path')
    p.add_argument('--shape', type=int, nargs=2, default=(128, 160))
    p.add_argument('--update', action='store_true',
                   help='keep the rows of --out for the configs not run now')
    args = p.parse_args(argv)
    import torch
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        for rel, kind in representatives(args.only):
            torch.manual_seed(0)
            try:
                row = run_one(rel, kind, tuple(args.shape), tmpdir)
            except Exception as e:  # record and go on: the sweep reports every config
                row = dict(config=rel, kind=kind, status='error',
                           error=f'{type(e).__name__}: {str(e).splitlines()[0][:300]}')
                traceback.print_exc()
            rows.append(row)
            print(f"{row['status']:8s} {rel} {row.get('dynamic', '')} "
                  f"{row.get('worst_rel_diff', '')} {row.get('export_s', '')}s "
                  f"{row.get('error', '')}", flush=True)
    if args.update:
        rows = upsert_rows(args.out, FIELDS, rows, key=('config', ))
        rows = sorted(rows, key=lambda r: r['config'])
    write_table(args.out, FIELDS, rows)
    print(f'wrote {args.out}: {sum(r["status"] == "ok" for r in rows)}/{len(rows)} ok')
    return 0 if all(r['status'] == 'ok' for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
