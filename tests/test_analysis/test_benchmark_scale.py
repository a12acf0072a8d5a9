"""The scale suite (``benchmarks/benchmark_scale.py``, issue #35): the search finds the
largest fitting side, a probe runs a real training step in a child process and is refused
when its resident memory passes the budget, checkpointing switches reach every block."""
import csv

import pytest
import torch

from benchmarks.core import scale


@pytest.mark.parametrize('limit', [0, 100, 1024, 1100, 2047, 5000, 20000])
def test_search_finds_the_largest_fitting_multiple_of_step(limit):
    seen = []

    def fake(name, side, with_cp, budget_gb, **kwargs):
        seen.append(side)
        return dict(name=name, side=side, with_cp=with_cp, budget_gb=budget_gb,
                    fits=side <= limit)

    rows = scale.largest_side('x', False, 1.0, start=1024, step=128, max_side=8192, run=fake)
    largest = max([r['side'] for r in rows if r['fits']], default=0)
    assert largest == min(limit // 128 * 128, 8192)
    assert len(seen) == len(set(seen))  # no side probed twice
    assert len(seen) <= 12  # doubling + bisection, not a linear scan


def test_a_model_without_checkpointing_is_probed_once_and_said_so():
    """mmdet's PVTv2 has no ``with_cp``: one probe, no search down to the smallest side,
    and the summary names the reason instead of a side."""
    def fake(name, side, with_cp, budget_gb, **kwargs):
        return dict(name=name, side=side, with_cp=with_cp, budget_gb=budget_gb, fits=False,
                    step_s='', peak_mem_mb=900.0,
                    error=f'ValueError: PyramidVisionTransformerV2 {scale.NO_CHECKPOINTING}')

    rows = scale.largest_side('x', True, 4.0, start=1024, step=256, run=fake)
    assert [r['side'] for r in rows] == [1024]
    (summary, ) = scale.scale_summary(rows)
    assert summary['largest_side'] == 0
    assert summary['first_failing_side'] == 'no with_cp switch'


def test_probe_runs_a_training_step_and_the_budget_refuses_it():
    fits = scale.run_probe('flatten-pvt-v2-tiny', 64, False, 8.0, quick=True, threads=1)
    assert fits['fits'] is True and fits['error'] == ''
    assert fits['step_s'] > 0 and 100 < fits['peak_mem_mb'] < 8 * 1024
    # a budget below what the same child needed: killed or refused, and said so
    tight = scale.run_probe('flatten-pvt-v2-tiny', 64, False,
                            0.5 * fits['peak_mem_mb'] / 1024, quick=True, threads=1)
    assert tight['fits'] is False
    assert 'resident memory over the budget' in tight['error']


def test_cli_writes_rows_summary_and_plot(tmp_path, monkeypatch):
    import importlib.util
    import os.path as osp
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        'benchmark_scale', osp.join(root, 'benchmarks', 'benchmark_scale.py'))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    def fake(name, side, with_cp, budget_gb, **kwargs):
        ok = side <= (512 if name.startswith('pvt') else 1024)
        return dict(name=name, side=side, with_cp=with_cp, budget_gb=budget_gb, fits=ok,
                    step_s=0.1 * side / 64 if ok else '', peak_mem_mb=side if ok else '',
                    error='' if ok else 'resident memory over the budget')

    monkeypatch.setattr(scale, 'run_probe', fake)
    out = tmp_path / 'scale.csv'
    assert cli.main(['--budget-gb', '1', '--quick', '--families', 'flatten-pvt-v2-tiny',
                     '--start', '256', '--step', '128', '--max-side', '2048',
                     '--csv', str(out), '--markdown', str(tmp_path / 's.md'),
                     '--png', str(tmp_path / 's.png')]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert {(r['name'], r['with_cp']) for r in rows} == {
        ('flatten-pvt-v2-tiny', 'False'), ('flatten-pvt-v2-tiny', 'True'),
        ('pvt-v2-tiny (timm)', 'False'), ('pvt-v2-tiny (timm)', 'True')}
    text = (tmp_path / 's.md').read_text()
    assert '| flatten-pvt-v2-tiny | False | 1.0 | 1024 |' in text
    assert '| pvt-v2-tiny (timm) | True | 1.0 | 512 |' in text
    assert (tmp_path / 's.png').stat().st_size > 1000 or not _has_matplotlib()


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.parametrize('name', ['flatten-pvt-v2-tiny', 'pvt-v2-tiny (timm)'])
def test_checkpointing_reaches_every_block_and_keeps_the_loss(name):
    from benchmarks.core.cases import backbone_cases
    from benchmarks.core.train import output_loss
    case = backbone_cases(quick=True)[name]
    x = torch.randn(1, 3, 64, 64)
    losses = []
    for cp in (False, True):
        torch.manual_seed(0)
        model = case.build((64, 64)).train()
        if cp:
            scale.enable_checkpointing(model)
            flags = [getattr(m, 'with_cp', getattr(m, 'grad_checkpointing', None))
                     for m in model.modules()
                     if hasattr(m, 'with_cp') or hasattr(m, 'grad_checkpointing')]
            assert flags and all(flags)
        losses.append(output_loss(case.run(model, x)))
    torch.testing.assert_close(losses[0], losses[1])
