"""Result rows as CSV and markdown tables (and the column sets of every suite)."""
import csv
import math
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple


CSV_COLUMNS = ('suite', 'name', 'group', 'source', 'device', 'dtype', 'threads', 'batch',
               'tokens', 'height', 'width', 'heads', 'head_dims', 'median_ms', 'min_ms',
               'cpu_ms', 'images_per_s', 'peak_mem_mb', 'repeats', 'note')


def write_csv(rows: Iterable[Dict[str, Any]], path: str,
              columns: Optional[Sequence[str]] = None) -> None:
    """Write result dicts as CSV (``columns`` default: ``CSV_COLUMNS`` plus any other
    public keys found in the rows)."""
    rows = list(rows)
    if columns is None:
        columns = list(CSV_COLUMNS)
        for r in rows:
            for key in r:
                if key not in columns and not key.startswith('_'):
                    columns.append(key)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction='ignore')
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _fmt_csv(r.get(k)) for k in columns})


def read_csv(path: str) -> List[Dict[str, Any]]:
    """Rows written by ``write_csv``, numbers parsed (e.g. to re-plot a stored run)."""
    def parse(v: str):
        if v == '':
            return None
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v

    with open(path, newline='') as f:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _fmt_csv(v):
    if isinstance(v, float):
        return f'{v:.6g}'
    return '' if v is None else v


def _fmt(v, spec: str = '.3g') -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return '-'
    if isinstance(v, str):
        return ' '.join(v.split()).replace('|', '/')[:160]
    if isinstance(v, float):
        return f'{v:.0f}' if abs(v) >= 1000 else format(v, spec)
    return str(v)


def format_table(rows: Sequence[Dict[str, Any]], columns: Sequence[Tuple[str, str]]) -> str:
    """Markdown table of ``rows`` with ``columns = [(key, header), ...]``."""
    lines = ['| ' + ' | '.join(h for _, h in columns) + ' |',
             '|' + '|'.join('---' for _ in columns) + '|']
    for r in rows:
        lines.append('| ' + ' | '.join(_fmt(r.get(k)) for k, _ in columns) + ' |')
    return '\n'.join(lines)


OP_COLUMNS = (('name', 'op'), ('tokens', 'N'), ('head_dims', 'd'), ('median_ms', 'median ms'),
              ('min_ms', 'min ms'), ('cpu_ms', 'CPU ms'), ('peak_mem_mb', 'peak MiB'),
              ('note', 'note'))
BACKBONE_COLUMNS = (('name', 'backbone'), ('height', 'H'), ('width', 'W'),
                    ('median_ms', 'median ms'), ('min_ms', 'min ms'), ('cpu_ms', 'CPU ms'),
                    ('images_per_s', 'img/s'), ('peak_mem_mb', 'peak MiB'), ('note', 'note'))
RATIO_COLUMNS = (('ours', 'ours'), ('baseline', 'softmax counterpart'), ('height', 'H'),
                 ('width', 'W'), ('ours_ms', 'ours ms'), ('baseline_ms', 'baseline ms'),
                 ('ratio_median', 'ratio (medians)'), ('ratio_rounds', 'ratio (per round)'),
                 ('ratio_min', 'ratio (min)'), ('ratio_cpu', 'ratio (CPU time)'),
                 ('mem_ratio', 'memory ratio'))
SIMA_COLUMNS = (('tokens', 'N'), ('head_dims', 'd'), ('chosen', 'auto picks'),
                ('qk_first_min_ms', 'qk_first ms'), ('kv_first_min_ms', 'kv_first ms'),
                ('auto_min_ms', 'auto ms'), ('auto_vs_best', 'auto / best (min)'),
                ('auto_vs_best_median', 'auto / best (median)'),
                ('chosen_vs_best', 'picked order / best'))


STEP_COLUMNS = (('name', 'model'), ('step', 'step'), ('exec', 'exec'), ('amp', 'amp'),
                ('height', 'H'), ('width', 'W'), ('median_ms', 'median ms'),
                ('min_ms', 'min ms'), ('images_per_s', 'img/s'), ('peak_mem_mb', 'peak MiB'),
                ('note', 'note'))
#: the classifier suite: one group per batch at one size
CLASSIFIER_COLUMNS = (('name', 'model'), ('batch', 'batch'), ('amp', 'amp'),
                      ('height', 'H'), ('width', 'W'), ('median_ms', 'median ms'),
                      ('min_ms', 'min ms'), ('images_per_s', 'img/s'),
                      ('peak_mem_mb', 'peak MiB'), ('note', 'note'))
CLASSIFIER_RATIO_COLUMNS = (('ours', 'ours'), ('baseline', 'baseline'), ('batch', 'batch'),
                            ('amp', 'amp'), ('ours_ms', 'ours ms'),
                            ('baseline_ms', 'baseline ms'), ('ratio_median', 'ratio (medians)'),
                            ('ratio_rounds', 'ratio (per round)'), ('ours_mem_mb', 'ours MiB'),
                            ('baseline_mem_mb', 'baseline MiB'), ('mem_ratio', 'memory ratio'))
STEP_RATIO_COLUMNS = (('ours', 'ours'), ('baseline', 'baseline'), ('step', 'step'),
                      ('exec', 'exec'), ('amp', 'amp'), ('height', 'H'), ('width', 'W'),
                      ('ours_ms', 'ours ms'), ('baseline_ms', 'baseline ms'),
                      ('ratio_median', 'ratio (medians)'),
                      ('ratio_rounds', 'ratio (per round)'),
                      ('ours_mem_mb', 'ours MiB'), ('baseline_mem_mb', 'baseline MiB'),
                      ('mem_ratio', 'memory ratio'))


def markdown_ratio_table(ratios: Sequence[Dict[str, Any]]) -> str:
    """README-style pivot tables of ratio rows: one table per (step, exec, amp, kernels,
    batch, device), one line per ``ours vs baseline`` pair, one column per input size;
    a cell is ``ratio (ours ms / baseline ms)``, plus ``mem x`` (peak-memory ratio)
    when both peaks are known.

    ``ratios`` are the dicts of ``ratio_rows`` / ``step_ratio_rows`` or the ``ratio``
    rows of a CSV written by the benchmark tool (``read_csv``).
    """
    sections: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in ratios:
        if r.get('ratio_median') is None:
            continue
        key = tuple(str(r.get(k) or '') for k in ('step', 'exec', 'amp', 'kernels', 'batch',
                                                  'device'))
        sections.setdefault(key, []).append(r)
    out = []
    for (step, ex, amp, kernels, batch, device), rows in sections.items():
        title = ', '.join(t for t in (
            f'{step or "forward"} step' if step else 'forward (inference)', ex, amp,
            f'FLATTEN_MM_TRITON={kernels}' if kernels else '',
            f'batch {batch}' if batch else '', device) if t)
        sizes = []
        for r in rows:
            size = (int(r['height']), int(r['width']))
            if size not in sizes:
                sizes.append(size)
        pairs: Dict[Tuple[str, str], Dict[Tuple[int, int], Dict[str, Any]]] = {}
        for r in rows:
            pairs.setdefault((r['ours'], r['baseline']), {})[(int(r['height']),
                                                             int(r['width']))] = r
        lines = [f'**{title}** (ours / baseline: ratio of medians, ms in brackets)', '',
                 '| ours vs | ' + ' | '.join(f'{h}²' if h == w else f'{h}×{w}'
                                             for h, w in sizes) + ' |',
                 '| --- |' + ' --- |' * len(sizes)]
        for (ours, base), cells in pairs.items():
            text = []
            for s in sizes:
                c = cells.get(s)
                if c is None:
                    text.append('-')
                    continue
                cell = (f'{_fmt(c["ratio_median"], ".2f")} ({_fmt(c.get("ours_ms"))} / '
                        f'{_fmt(c.get("baseline_ms"))})')
                if c.get('mem_ratio') is not None:
                    cell += f', mem {_fmt(c["mem_ratio"], ".2f")}'
                text.append(cell)
            lines.append(f'| {ours} vs {base} | ' + ' | '.join(text) + ' |')
        out.append('\n'.join(lines))
    return '\n\n'.join(out)
