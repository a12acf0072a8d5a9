"""The benchmark tool runs end to end (``--quick``) and its helpers are right.

No timing is asserted: the benchmark is a tool, not a timed test.
"""
import csv
import math
import os.path as osp
import sys

import pytest
import torch

from benchmarks import core as bm

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from benchmark_cli import load_cli  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_quick_cli_writes_csv_png_and_tables(tmp_path, capsys, restore_threads):
    pytest.importorskip('matplotlib')
    cli = load_cli()
    out_csv, out_png = tmp_path / 'bench.csv', tmp_path / 'bench.png'
    rc = cli.main(['--quick', '--ops', '--backbones', '--threads', '1', '--no-memory',
                   '--csv', str(out_csv), '--png', str(out_png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert '## Op level' in printed and '## Ours / softmax counterpart' in printed
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    ops = {r['name'] for r in rows if r['suite'] == 'op' and r['median_ms']}
    assert set(bm.OPS) <= ops  # every op ran (quick sizes are below the quadratic cap)
    backbones = [r for r in rows if r['suite'] == 'backbone']
    assert backbones and all(r['median_ms'] for r in backbones), backbones
    assert any(r['suite'] == 'ratio' for r in rows)
    assert out_png.stat().st_size > 10_000
    with open(out_png, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_fit_exponent_recovers_power_law():
    tokens = [1024, 4096, 16384, 65536]
    assert bm.fit_exponent(tokens, [3e-9 * n**1.5 for n in tokens]) == pytest.approx(1.5)
    assert math.isnan(bm.fit_exponent([10], [1.0]))


def test_peak_memory_counts_an_allocation():
    size = 1 << 22  # 4 MiB of float32

    def fn():
        a = torch.ones(size // 4)
        b = a * 2  # a second buffer alive at the same time
        return b.sum()

    peak = bm.peak_memory_bytes(fn, torch.device('cpu'))
    if peak is None:
        pytest.skip('the profiler records no CPU allocations here')
    assert 2 * size <= peak < 3 * size


def test_relu_linear_attention_matches_quadratic_form():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, 8, dtype=torch.float64) for _ in range(3))
    out = bm.relu_linear_attention(q, k, v, num_heads=2)
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        A = q[..., sl].relu() @ k[..., sl].relu().transpose(1, 2)
        ref = (A @ v[..., sl]) / (A.sum(-1, keepdim=True) + 1e-6)
        assert torch.allclose(out[..., sl], ref, atol=1e-10)


def test_quadtree_levels_keep_a_valid_coarsest_grid():
    assert bm.quadtree_levels(128, 32) == 4
    assert bm.quadtree_levels(32, 32) == 3
    assert bm.quadtree_levels(8, 32) == 1
    for side in (16, 32, 64, 128, 256):
        levels = bm.quadtree_levels(side, 32)
        f = 2**(levels - 1)
        assert side % f == 0 and (levels == 1 or (side // f)**2 >= 64)


def test_ratio_rows_pair_ours_with_baselines():
    rows = [
        dict(suite='backbone', name='a', group='a@8x8', height=8, width=8, device='cpu',
             dtype='float32', median_ms=2.0, min_ms=1.0, _wall=[2.0, 4.0], peak_mem_mb=1.0),
        dict(suite='backbone', name='b (timm)', group='a@8x8', height=8, width=8,
             device='cpu', dtype='float32', median_ms=4.0, min_ms=4.0, _wall=[4.0, 4.0],
             peak_mem_mb=2.0),
    ]
    (r, ) = bm.ratio_rows(rows, {'a': ('b (timm)', )})
    assert r['ratio_median'] == 0.5 and r['ratio_min'] == 0.25
    assert r['ratio_rounds'] == pytest.approx(0.75) and r['mem_ratio'] == 0.5
