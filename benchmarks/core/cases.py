"""Backbone suite: flatten_mm backbones and their softmax counterparts (timm, mmdet),
built per resolution, timed alternating, and the ours / baseline ratio rows."""
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .timing import _row, measure_alternating, peak_memory_bytes


#: backbone families: ours -> softmax counterparts (timm / mmdet names below)
BACKBONE_PAIRS: Dict[str, Tuple[str, ...]] = {
    'flatten-pvt-v2-b0': ('pvt-v2-b0 (timm)', 'pvt-v2-b0 (mmdet)'),
    'quadtree-b-pvt-v2-b0': ('pvt-v2-b0 (timm)', 'pvt-v2-b0 (mmdet)'),
    'flatten-swin-t': ('swin-t (timm)', 'swin-t (mmdet)'),
    'sima-xcit-s12-p16': ('xcit-s12-p16 (timm)', ),
}
#: default input resolutions ``(H, W)`` of the backbone suite
RESOLUTIONS = ((224, 224), (512, 512), (1024, 1024), (800, 1280))


def parse_ints(text: str) -> Tuple[int, ...]:
    """``'1,2'`` -> ``(1, 2)`` (command-line lists)."""
    return tuple(int(t) for t in text.split(',') if t)


def parse_resolutions(text: str) -> Tuple[Tuple[int, int], ...]:
    """``'512,800x1280'`` -> ``((512, 512), (800, 1280))``: ``S`` is ``S x S``."""
    out = []
    for item in text.split(','):
        h, _, w = item.partition('x')
        out.append((int(h), int(w or h)))
    return tuple(out)


@dataclass
class BackboneCase:
    """How to build and run one backbone at one resolution."""

    name: str
    build: Callable[[Tuple[int, int]], nn.Module]
    run: Callable[[nn.Module, torch.Tensor], Any]
    source: str = 'flatten_mm'


def _call(m: nn.Module, x: torch.Tensor):
    return m(x)


def _timm_intermediates(indices=None):
    def run(m: nn.Module, x: torch.Tensor):
        return m.forward_intermediates(x, indices=indices, intermediates_only=True)
    return run


def backbone_cases(quick: bool = False) -> Dict[str, BackboneCase]:
    """Every backbone of the suite (ours and the baselines available here).

    With ``quick``: tiny custom architectures of the same classes (CI smoke test).
    """
    import timm
    from flatten_mm.models.backbones import FLattenPVTv2, FLattenSwin, QuadTreePVTv2, SimAXCiT

    cases: Dict[str, BackboneCase] = {}
    if quick:
        tiny = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 2),
                    mlp_ratios=(2, 2, 2, 2))
        cases['flatten-pvt-v2-tiny'] = BackboneCase(
            'flatten-pvt-v2-tiny', lambda hw: FLattenPVTv2(arch=tiny, drop_path_rate=0.), _call)
        cases['quadtree-b-pvt-v2-tiny'] = BackboneCase(
            'quadtree-b-pvt-v2-tiny',
            lambda hw: QuadTreePVTv2(arch=tiny, attn_cfg=dict(topk=2), drop_path_rate=0.), _call)

        def timm_tiny(hw):
            from timm.models.pvt_v2 import PyramidVisionTransformerV2
            return PyramidVisionTransformerV2(depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32),
                                              num_heads=(1, 1, 1, 2), mlp_ratios=(2, 2, 2, 2))

        cases['pvt-v2-tiny (timm)'] = BackboneCase('pvt-v2-tiny (timm)', timm_tiny,
                                                   _timm_intermediates(), 'timm')
        return cases

    cases['flatten-pvt-v2-b0'] = BackboneCase(
        'flatten-pvt-v2-b0', lambda hw: FLattenPVTv2('b0', drop_path_rate=0.), _call)
    cases['quadtree-b-pvt-v2-b0'] = BackboneCase(
        'quadtree-b-pvt-v2-b0', lambda hw: QuadTreePVTv2('b0', drop_path_rate=0.), _call)
    cases['flatten-swin-t'] = BackboneCase(
        'flatten-swin-t', lambda hw: FLattenSwin('t', drop_path_rate=0.), _call)
    sima_idx = (3, 5, 7, 11)
    cases['sima-xcit-s12-p16'] = BackboneCase(
        'sima-xcit-s12-p16', lambda hw: SimAXCiT('s12', block_indices=sima_idx),
        lambda m, x: m.forward_blocks(x, m.block_indices))
    cases['pvt-v2-b0 (timm)'] = BackboneCase(
        'pvt-v2-b0 (timm)', lambda hw: timm.create_model('pvt_v2_b0', pretrained=False),
        _timm_intermediates(), 'timm')
    cases['swin-t (timm)'] = BackboneCase(
        'swin-t (timm)', lambda hw: timm.create_model(
            'swin_tiny_patch4_window7_224', pretrained=False, img_size=tuple(hw)),
        _timm_intermediates(), 'timm')
    cases['xcit-s12-p16 (timm)'] = BackboneCase(
        'xcit-s12-p16 (timm)', lambda hw: timm.create_model('xcit_small_12_p16_224',
                                                            pretrained=False),
        _timm_intermediates(list(sima_idx)), 'timm')
    try:
        from mmdet.models.backbones import PyramidVisionTransformerV2, SwinTransformer
    except Exception:  # noqa: BLE001 - mmdet (and its mmcv) are optional here
        return cases
    cases['pvt-v2-b0 (mmdet)'] = BackboneCase(
        'pvt-v2-b0 (mmdet)',
        lambda hw: PyramidVisionTransformerV2(embed_dims=32, num_layers=[2, 2, 2, 2]), _call,
        'mmdet')
    cases['swin-t (mmdet)'] = BackboneCase('swin-t (mmdet)', lambda hw: SwinTransformer(),
                                           _call, 'mmdet')
    return cases


def quick_pairs() -> Dict[str, Tuple[str, ...]]:
    """Backbone families of the ``quick`` suite."""
    return {'flatten-pvt-v2-tiny': ('pvt-v2-tiny (timm)', ),
            'quadtree-b-pvt-v2-tiny': ('pvt-v2-tiny (timm)', )}


def select_pairs(families: Optional[str] = None,
                 quick: bool = False) -> Dict[str, Tuple[str, ...]]:
    """The backbone pairs of ``--families`` (comma-separated names of ours; all when
    empty) from the full or the ``quick`` suite; an unknown name exits with the list."""
    pairs = quick_pairs() if quick else dict(BACKBONE_PAIRS)
    if families:
        wanted = families.split(',')
        unknown = [w for w in wanted if w not in pairs]
        if unknown:
            raise SystemExit(f'unknown --families {unknown}; available: {list(pairs)}')
        pairs = {k: v for k, v in pairs.items() if k in wanted}
    return pairs


def run_backbone_benchmark(pairs: Optional[Dict[str, Sequence[str]]] = None,
                           resolutions: Sequence[Tuple[int, int]] = RESOLUTIONS,
                           batch: int = 1,
                           device: str = 'cpu',
                           dtype: torch.dtype = torch.float32,
                           warmup: int = 1,
                           repeats: int = 5,
                           memory: bool = True,
                           quick: bool = False,
                           log: Optional[Callable[[str], None]] = None
                           ) -> List[Dict[str, Any]]:
    """Backbone suite: per family and resolution, ours and its baselines alternate.

    Args:
        pairs: ours -> baselines (default ``BACKBONE_PAIRS``; only available baselines
            run, e.g. no mmdet rows without mmdet).
        resolutions: input sizes ``(H, W)``.
        batch: images per forward.
        device: ``'cpu'`` or ``'cuda'``.
        dtype: ``torch.float32`` or a half type (run under autocast on CUDA, as in
            mixed-precision inference; weights stay float32).
        warmup: untimed rounds.
        repeats: timed rounds.
        memory: also measure the peak memory of one forward.
        quick: tiny architectures (see ``backbone_cases``).
        log: optional progress callback.

    Returns:
        One dict per (model, resolution) with ``median_ms``, ``min_ms``, ``cpu_ms``,
        ``images_per_s``, ``peak_mem_mb``, and ``baseline_of`` / ``ratio_*`` columns
        on the rows of our backbones (see ``ratio_rows``).
    """
    device_ = torch.device(device)
    available = backbone_cases(quick)
    if pairs is None:
        pairs = quick_pairs() if quick else BACKBONE_PAIRS
    rows = []
    for ours, baselines in pairs.items():
        names = [ours] + [b for b in baselines if b in available]
        for hw in resolutions:
            torch.manual_seed(0)
            x = torch.randn(batch, 3, *hw, device=device_)
            models, cases, errors = {}, {}, {}
            for name in names:
                try:
                    model = available[name].build(tuple(hw)).to(device_)
                    model.eval()  # (mmdet's Swin.train() does not return self)
                    models[name] = model
                except Exception as err:  # noqa: BLE001 - reported in the table
                    errors[name] = f'error: {type(err).__name__}: {err}'
                    continue
                cases[name] = _backbone_call(available[name], models[name], x, device_, dtype)
            # a failing forward is reported, not fatal
            for name in list(cases):
                try:
                    with torch.no_grad():
                        cases[name]()
                except Exception as err:  # noqa: BLE001
                    errors[name] = f'error: {type(err).__name__}: {str(err)[:120]}'
                    del cases[name]
            if log is not None:
                log(f'backbones {hw[0]}x{hw[1]}: {", ".join(cases)}')
            timings = measure_alternating(cases, device_, warmup, repeats)
            group = f'{ours}@{hw[0]}x{hw[1]}'
            for name in names:
                extra = dict(height=hw[0], width=hw[1], tokens=hw[0] * hw[1], group=group,
                             source=available[name].source if name in available else '')
                if name in errors or name not in cases:
                    rows.append(_row('backbone', name, None, device_, dtype, batch,
                                     note=errors.get(name, 'not run'), **extra))
                    continue
                row = _row('backbone', name, timings[name], device_, dtype, batch, **extra)
                if memory:
                    peak = peak_memory_bytes(cases[name], device_)
                    row['peak_mem_mb'] = None if peak is None else peak / 2**20
                row['_wall'] = list(timings[name].wall)
                rows.append(row)
            del models, cases
    return rows


def _backbone_call(case: BackboneCase, model: nn.Module, x: torch.Tensor,
                   device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    if dtype == torch.float32:
        return lambda: case.run(model, x)

    def run():
        with torch.autocast(device_type=device.type, dtype=dtype):
            return case.run(model, x)
    return run


def ratio_rows(rows: Sequence[Dict[str, Any]],
               pairs: Optional[Dict[str, Sequence[str]]] = None,
               suite: str = 'backbone') -> List[Dict[str, Any]]:
    """Ours / baseline latency ratios of every family and resolution.

    ``ratio_median`` = median(ours) / median(baseline); ``ratio_min`` = min / min;
    ``ratio_rounds`` = median over the alternating rounds of the per-round ratio;
    ``ratio_cpu`` = ratio of the median process CPU times (CPU only; with one thread the
    measure least disturbed by other processes on a shared machine). Rows of ``suite``
    are paired within their ``group`` (``'<ours>@<H>x<W>...'``); the ours row's ``batch``,
    ``step``, ``exec``, ``amp`` and ``kernels`` are carried over when present.
    """
    by_group: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        if r.get('suite') == suite and r.get('median_ms') is not None:
            by_group.setdefault(r['group'], {})[r['name']] = r
    out = []
    for group, members in by_group.items():
        ours = group.split('@')[0]
        if ours not in members:
            continue
        o = members[ours]
        baselines = pairs[ours] if pairs and ours in pairs else [m for m in members if m != ours]
        for b in baselines:
            if b not in members:
                continue
            base = members[b]
            rounds = [a / c for a, c in zip(o.get('_wall', []), base.get('_wall', [])) if c > 0]
            out.append(dict(ours=ours, baseline=b, height=o['height'], width=o['width'],
                            device=o['device'], dtype=o['dtype'],
                            ours_ms=o['median_ms'], baseline_ms=base['median_ms'],
                            ratio_median=o['median_ms'] / base['median_ms'],
                            ratio_min=o['min_ms'] / base['min_ms'],
                            ratio_rounds=statistics.median(rounds) if rounds else None,
                            ratio_cpu=(o['cpu_ms'] / base['cpu_ms']
                                       if o.get('cpu_ms') and base.get('cpu_ms') else None),
                            mem_ratio=(o['peak_mem_mb'] / base['peak_mem_mb']
                                       if o.get('peak_mem_mb') and base.get('peak_mem_mb')
                                       else None)))
            for key in ('batch', 'step', 'exec', 'amp', 'kernels'):
                if key in o:
                    out[-1][key] = o[key]
            if 'step' in o:  # the step suites also keep both memories
                out[-1].update(ours_mem_mb=o.get('peak_mem_mb'),
                               baseline_mem_mb=base.get('peak_mem_mb'))
    return out


def tiny_backbones() -> Dict[str, Tuple[nn.Module, Tuple[int, int]]]:
    """One small model of every backbone family and an input size exercising its
    special paths (shifted windows with a mask, QuadTree top-k, padding), for
    ``torch.compile`` checks."""
    from flatten_mm.models.backbones import (FLattenCSWin, FLattenPVTv2, FLattenSwin,
                                             QuadTreePVTv2, SimAXCiT)
    tiny_pvt = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 2),
                    mlp_ratios=(2, 2, 2, 2))
    torch.manual_seed(0)
    return {
        'flatten-pvt-v2': (FLattenPVTv2(arch=tiny_pvt), (64, 80)),
        'quadtree-b-pvt-v2': (QuadTreePVTv2(arch=tiny_pvt, attn_cfg=dict(topk=2)), (64, 80)),
        'quadtree-a-pvt-v2': (QuadTreePVTv2(arch=tiny_pvt, attn_cfg=dict(topk=2, attn_type='A')),
                              (64, 64)),
        'flatten-swin': (FLattenSwin(arch=dict(embed_dims=8, depths=(1, 1, 2, 2),
                                               num_heads=(1, 1, 2, 2))), (128, 112)),
        'flatten-cswin': (FLattenCSWin(arch=dict(embed_dims=8, depths=(1, 1, 1, 1),
                                                 num_heads=(2, 2, 2, 2))), (64, 64)),
        'sima-xcit': (SimAXCiT(arch=dict(embed_dims=32, depth=2, num_heads=2)), (64, 48)),
    }
