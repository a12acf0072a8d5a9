"""Log-log scaling plot of the op-level suite."""
import os
from typing import Any, Dict, Optional, Sequence

from .ops import OPS, op_exponents


def plot_scaling(rows: Sequence[Dict[str, Any]], path: str, title: str = '') -> bool:
    """Log-log PNG: op latency and peak memory against the token count, with the fitted
    time exponent of every op in the legend. Returns ``False`` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    op_rows = [r for r in rows if r.get('suite') == 'op' and r.get('median_ms') is not None]
    if not op_rows:
        return False
    exps = op_exponents(op_rows)
    dims = sorted({r['head_dims'] for r in op_rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    styles = ['-', '--', ':', '-.']
    colors = plt.get_cmap('tab10').colors
    for j, d in enumerate(dims):
        for c, name in enumerate(OPS):  # one colour per op, one line style per head dim
            pts = sorted((r['tokens'], r['median_ms'], r.get('peak_mem_mb'))
                         for r in op_rows if r['name'] == name and r['head_dims'] == d)
            if not pts:
                continue
            label = f'{name} d={d} (N^{exps.get((name, d), float("nan")):.2f})'
            style = dict(linestyle=styles[j % 4], marker='o', ms=3, color=colors[c % 10])
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
            mem = [(p[0], p[2]) for p in pts if p[2]]
            if mem:
                axes[1].plot([m[0] for m in mem], [m[1] for m in mem], label=f'{name} d={d}',
                             **style)
    for ax, ylabel in zip(axes, ('median latency (ms)', 'peak memory of one call (MiB)')):
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('tokens N')
        ax.set_ylabel(ylabel)
        ax.grid(True, which='both', alpha=0.3)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5, ncol=1)
    return _save(fig, plt, path, title)


def plot_scale(rows: Sequence[Dict[str, Any]], path: str, budget_gb: float = None,
               title: str = '') -> bool:
    """Two panels against the image side: peak memory and step time of every probe that
    fitted (one line per backbone and checkpointing setting), with the budget drawn.
    Returns ``False`` without matplotlib or rows."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fitted = [r for r in rows if str(r.get('fits')) in ('True', 'true', '1')]
    if not fitted:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.get_cmap('tab10').colors
    names = sorted({r['name'] for r in fitted})
    for c, name in enumerate(names):
        for cp in (False, True):
            pts = sorted((int(r['side']), float(r['peak_mem_mb']) / 1024, float(r['step_s']))
                         for r in fitted
                         if r['name'] == name and str(r['with_cp']) in (str(cp), str(int(cp))))
            if not pts:
                continue
            style = dict(color=colors[c % 10], marker='o', ms=3,
                         linestyle='--' if cp else '-')
            label = name + (' (with_cp)' if cp else '')
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], label=label, **style)
    if budget_gb:
        axes[0].axhline(budget_gb, color='grey', linewidth=1)
    for ax, ylabel in zip(axes, ('peak memory of the step (GiB)', 'step time (s)')):
        ax.set_xlabel('image side (pixels, square, batch 1)')
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale('log')
    return _save(fig, plt, path, title)


def _save(fig, plt, path: str, title: Optional[str]) -> bool:
    """Title, layout and write ``fig`` to ``path`` (folders made), then close it."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
