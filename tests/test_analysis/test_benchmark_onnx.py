"""The ONNX Runtime benchmark pairs like with like and runs end to end.

No timing is asserted: the benchmark is a tool, not a timed test.
"""
import csv
import os.path as osp
import sys

import pytest
import torch

from benchmarks.core import onnx as bo

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from benchmark_cli import load_cli  # noqa: E402


def test_sima_counterpart_computes_the_same_maps():
    """XCiT from timm returns stride-16 maps only; its counterpart runs them through copies
    of our SimA's dense adapters, so both sides return the same four maps."""
    from flatten_mm.models.backbones import SimAXCiT
    torch.manual_seed(0)
    ours = SimAXCiT('s12', block_indices=(3, 5, 7, 11)).eval()
    label, theirs = bo.counterpart_model('sima-xcit-s12-p16', (64, 64), ours)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert [t.shape for t in theirs(x)] == [t.shape for t in ours(x)]
    assert 'adapters' in label
    # copies: the counterpart does not share (or move) our modules
    assert all(a is not getattr(ours, f'fpn{k + 1}')
               for a, k in zip(theirs.adapters, ours.out_indices))


def test_backbone_without_counterpart_is_refused():
    with pytest.raises(ValueError, match='no counterpart for'):
        bo.onnx_rows(['flatten-pvt-tiny'], [(64, 64)])


def test_cli_writes_paired_rows(tmp_path):
    pytest.importorskip('onnxruntime')
    out = tmp_path / 'rows.csv'
    n = torch.get_num_threads()
    try:
        assert load_cli('benchmark_onnx.py').main([
            '--backbones', 'flatten-pvt-v2-b0', '--resolutions', '64,96x64', '--threads', '1',
            '--warmup', '0', '--repeats', '1', '--csv', str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    rows = list(csv.DictReader(open(out)))
    assert [(r['resolution'], r['counterpart']) for r in rows] == [
        ('64x64', 'pvt-v2-b0 (timm)'), ('96x64', 'pvt-v2-b0 (timm)')]
    for r in rows:
        assert float(r['max_rel_diff']) < 1e-4
        assert float(r['onnx_vs_counterpart']) == pytest.approx(
            float(r['onnx_ms']) / float(r['counterpart_onnx_ms']), rel=1e-2)
