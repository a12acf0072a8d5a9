"""Op-level suite: every attention on given ``q, k, v`` (after the projections) over a
range of token counts, and SimA's automatic order against both fixed orders."""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .timing import _row, fit_exponent, measure_alternating, peak_memory_bytes

#: ops of the op-level suite, in table order
OPS = ('fla', 'fla_unfused', 'relu_linear', 'sima', 'sima_qk_first', 'sima_kv_first',
       'quadtree_a', 'quadtree_b', 'softmax_sdpa')
#: ops whose cost is quadratic in the token count (skipped above ``max_quadratic_tokens``)
QUADRATIC_OPS = ('softmax_sdpa', 'sima_qk_first')


def relu_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          num_heads: int) -> torch.Tensor:
    """Plain ReLU linear attention ``phi(Q) (phi(K)^T V) / (phi(Q) . sum phi(K) + 1e-6)``,
    ``phi = ReLU``, on ``(B, N, C)`` tokens (the yardstick of the FLA kernel)."""
    B, N, C = q.shape
    d = C // num_heads
    q = F.relu(q).reshape(B, N, num_heads, d).transpose(1, 2)
    k = F.relu(k).reshape(B, -1, num_heads, d).transpose(1, 2)
    v = v.reshape(B, -1, num_heads, d).transpose(1, 2)
    kv = k.transpose(-2, -1) @ v
    z = 1.0 / (q @ k.sum(dim=-2, keepdim=True).transpose(-2, -1) + 1e-6)
    return ((q @ kv) * z).transpose(1, 2).reshape(B, N, C)


def quadtree_levels(side: int, topk: int, max_levels: int = 4) -> int:
    """Pyramid levels for a ``side x side`` map: the most (up to ``max_levels``) whose
    coarsest level is a whole grid of at least ``max(2 * topk, 64)`` tokens (1 if none)."""
    best = 1
    for levels in range(2, max_levels + 1):
        f = 2**(levels - 1)
        if side % f == 0 and (side // f)**2 >= max(2 * topk, 64):
            best = levels
    return best


def make_op(name: str, side: int, head_dims: int, num_heads: int = 1, batch: int = 1,
            device: torch.device = torch.device('cpu'), dtype: torch.dtype = torch.float32,
            quadtree_topk: int = 32, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running op ``name`` on random ``q, k, v`` of
    ``N = side**2`` tokens, ``num_heads`` heads of ``head_dims`` channels.

    FLA and ReLU-LA take ``(B, N, C)`` tokens, SimA and SDPA ``(B, h, N, d)`` views of
    them; QuadTree runs ``QuadTreeAttention.attend`` (pyramid + attention) on the
    ``side x side`` map with ``quadtree_levels(side, topk)`` levels.
    """
    from flatten_mm.models.layers.focused_linear_attention import (
        focused_linear_core, focused_linear_core_reference)
    from flatten_mm.models.layers.quadtree_attention import QuadTreeAttention
    from flatten_mm.models.layers.sima_attention import sima_core

    g = torch.Generator().manual_seed(seed)
    N, C, h, d = side * side, head_dims * num_heads, num_heads, head_dims
    q, k, v = (torch.randn(batch, N, C, generator=g).to(device, dtype) for _ in range(3))
    scale = (0.5 * torch.randn(1, 1, C, generator=g)).to(device, dtype)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, N, h, d).transpose(1, 2)

    if name == 'fla':
        return lambda: focused_linear_core(q, k, v, scale, h, 3)
    if name == 'fla_unfused':
        return lambda: focused_linear_core_reference(q, k, v, scale, h, 3)
    if name == 'relu_linear':
        return lambda: relu_linear_attention(q, k, v, h)
    if name == 'softmax_sdpa':
        qh, kh, vh = heads(q), heads(k), heads(v)
        return lambda: F.scaled_dot_product_attention(qh, kh, vh)
    if name in ('sima', 'sima_qk_first', 'sima_kv_first'):
        order = {'sima': 'auto', 'sima_qk_first': 'qk_first', 'sima_kv_first': 'kv_first'}[name]
        qh, kh, vh = heads(q), heads(k), heads(v)
        return lambda: sima_core(qh, kh, vh, order)
    if name in ('quadtree_a', 'quadtree_b'):
        levels = quadtree_levels(side, quadtree_topk)
        torch.manual_seed(seed)
        module = QuadTreeAttention(C, h, attn_type=name[-1].upper(), num_levels=levels,
                                   topk=quadtree_topk).to(device, dtype).eval()
        return lambda: module.attend(q, k, v, (side, side))
    raise KeyError(f'unknown op {name!r}; available: {OPS}')


def run_op_benchmark(ops: Sequence[str] = OPS,
                     sides: Sequence[int] = (32, 64, 128, 256),
                     head_dims: Sequence[int] = (32, 64),
                     num_heads: int = 1,
                     batch: int = 1,
                     device: str = 'cpu',
                     dtype: torch.dtype = torch.float32,
                     warmup: int = 2,
                     repeats: int = 10,
                     max_quadratic_tokens: int = 128 * 128,
                     memory: bool = True,
                     quadtree_topk: int = 32,
                     log: Optional[Callable[[str], None]] = None) -> List[Dict[str, Any]]:
    """Op-level suite: for every ``(side, head_dims)`` all ``ops`` alternate.

    Args:
        ops: op names (see ``OPS``).
        sides: map sides ``s`` (``N = s * s`` tokens).
        head_dims: head dims ``d``.
        num_heads: heads ``h`` (``C = h * d``).
        batch: batch size.
        device: ``'cpu'`` or ``'cuda'``.
        dtype: input dtype (FLA / SimA / QuadTree compute their kernels in float32).
        warmup: untimed rounds.
        repeats: timed rounds.
        max_quadratic_tokens: ops in ``QUADRATIC_OPS`` are skipped above this ``N``.
        memory: also measure the peak memory of one call.
        quadtree_topk: top-k of the QuadTree ops.
        log: optional progress callback.

    Returns:
        One dict per (op, side, head dim) with ``tokens``, ``head_dims``, ``median_ms``,
        ``min_ms``, ``cpu_ms``, ``peak_mem_mb`` and, for skipped cases, a ``note``.
    """
    device_ = torch.device(device)
    rows = []
    for d in head_dims:
        for s in sides:
            N = s * s
            cases, skipped = {}, {}
            for name in ops:
                if name in QUADRATIC_OPS and N > max_quadratic_tokens:
                    skipped[name] = f'skipped: N={N} > max_quadratic_tokens'
                    continue
                try:
                    cases[name] = make_op(name, s, d, num_heads, batch, device_, dtype,
                                          quadtree_topk)
                except (ValueError, RuntimeError) as err:
                    skipped[name] = f'error: {err}'
            if log is not None:
                log(f'ops  N={N:6d} ({s}x{s}) d={d}: {", ".join(cases)}')
            timings = measure_alternating(cases, device_, warmup, repeats)
            for name in ops:
                extra = dict(tokens=N, height=s, width=s, head_dims=d, heads=num_heads)
                if name in skipped:
                    rows.append(_row('op', name, None, device_, dtype, batch, note=skipped[name],
                                     **extra))
                    continue
                row = _row('op', name, timings[name], device_, dtype, batch, **extra)
                if memory:
                    peak = peak_memory_bytes(cases[name], device_)
                    row['peak_mem_mb'] = None if peak is None else peak / 2**20
                rows.append(row)
            del cases
    return rows


def run_sima_order_grid(tokens: Sequence[int] = (16, 32, 48, 64, 96, 128, 192, 256, 512, 1024),
                        head_dims: Sequence[int] = (32, 48, 64, 128),
                        num_heads: int = 4, batch: int = 1, device: str = 'cpu',
                        warmup: int = 3, repeats: int = 15,
                        log: Optional[Callable[[str], None]] = None) -> List[Dict[str, Any]]:
    """SimA ``order='auto'`` against both fixed orders on a grid of ``(N, d)`` covering
    both regimes (``N < d``: ``qk_first`` cheaper; ``N > d``: ``kv_first``).

    Returns one dict per ``(N, d)`` with the three medians/minima,
    ``auto_vs_best = min_ms(auto) / min(min_ms(qk_first), min_ms(kv_first))`` (and the
    same with medians), and ``chosen_vs_best``: the fixed order that ``auto`` picks
    against the faster one (the rule's quality without the noise of separate runs).
    """
    from flatten_mm.models.layers.sima_attention import sima_core, sima_order
    device_ = torch.device(device)
    rows = []
    g = torch.Generator().manual_seed(0)
    for d in head_dims:
        for N in tokens:
            q, k, v = (torch.randn(batch, num_heads, N, d, generator=g).to(device_)
                       for _ in range(3))
            cases = {order: (lambda o: lambda: sima_core(q, k, v, o))(order)
                     for order in ('auto', 'qk_first', 'kv_first')}
            t = measure_alternating(cases, device_, warmup, repeats)
            best = min(t['qk_first'].minimum, t['kv_first'].minimum)
            best_med = min(t['qk_first'].median, t['kv_first'].median)
            row = _row('sima_order', 'sima', None, device_, torch.float32, batch, tokens=N,
                       head_dims=d, heads=num_heads, chosen=sima_order(N, d))
            for order, tim in t.items():
                row[f'{order}_median_ms'] = tim.median * 1e3
                row[f'{order}_min_ms'] = tim.minimum * 1e3
            row['auto_vs_best'] = t['auto'].minimum / best
            row['auto_vs_best_median'] = t['auto'].median / best_med
            # quality of the rule alone (no timing noise of the extra 'auto' runs)
            row['chosen_vs_best'] = t[row['chosen']].minimum / best
            rows.append(row)
            if log is not None:
                log(f'sima N={N} d={d}: auto/best {row["auto_vs_best"]:.3f}')
    return rows


def op_exponents(rows: Sequence[Dict[str, Any]], min_tokens: int = 0,
                 max_tokens: Optional[int] = None) -> Dict[Tuple[str, int], float]:
    """Fitted time exponent ``a`` (``median ~ N^a``) per ``(op, head_dims)``."""
    series: Dict[Tuple[str, int], List[Tuple[int, float]]] = {}
    for r in rows:
        if r.get('suite') != 'op' or r.get('median_ms') is None:
            continue
        if r['tokens'] < min_tokens or (max_tokens is not None and r['tokens'] > max_tokens):
            continue
        series.setdefault((r['name'], r['head_dims']), []).append((r['tokens'], r['median_ms']))
    return {key: fit_exponent([p[0] for p in pts], [p[1] for p in pts])
            for key, pts in series.items()}
