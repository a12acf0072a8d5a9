"""Log-log scaling plot of the op-level suite."""
import os
from typing import Any, Dict, Sequence

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
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
