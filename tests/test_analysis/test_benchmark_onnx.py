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


def test_lead_in_calls_precede_every_timed_call():
    """With ``lead_in=1`` every timed call of a case follows an untimed call of the same
    case, whatever ran before it."""
    from benchmarks.core.timing import measure_alternating
    log = []
    cases = {name: (lambda name=name: log.append(name)) for name in 'abc'}
    t = measure_alternating(cases, torch.device('cpu'), warmup=1, repeats=4, lead_in=1)
    assert all(len(t[name].wall) == 4 for name in 'abc')
    timed = log[3:]  # after the warm-up round: pairs (lead-in, timed call)
    assert len(timed) == 2 * 3 * 4
    assert all(timed[i] == timed[i + 1] for i in range(0, len(timed), 2))
    # the order still rotates: the first case of each round changes
    assert [timed[6 * r] for r in range(4)] == ['a', 'b', 'c', 'a']


def _relu_onnx(path):
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph(
        [helper.make_node('Relu', ['x'], ['y'])], 'relu',
        [helper.make_tensor_value_info('x', TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info('y', TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_ort_session_can_turn_spinning_off(tmp_path):
    pytest.importorskip('onnxruntime')
    import numpy as np

    from flatten_mm.deploy.runtime import ort_session
    path = tmp_path / 'relu.onnx'
    _relu_onnx(path)
    key = 'session.intra_op.allow_spinning'
    quiet = ort_session(str(path), threads=2, spinning=False)
    assert quiet.get_session_options().get_session_config_entry(key) == '0'
    default = ort_session(str(path), threads=2)
    with pytest.raises(RuntimeError, match='does not have configuration'):
        default.get_session_options().get_session_config_entry(key)
    x = np.array([[-1, 2, -3, 4]], np.float32)
    np.testing.assert_array_equal(quiet.run(None, {'x': x})[0], np.maximum(x, 0))


def test_cli_writes_paired_rows(tmp_path, monkeypatch):
    """Both sessions are timed without spin-waiting workers, each timed call after a call
    of the same case (see ``benchmarks/core/onnx.py``)."""
    pytest.importorskip('onnxruntime')
    from benchmarks.core import timing
    from flatten_mm.deploy import runtime
    spinning_seen, lead_in_seen = [], []
    real_session, real_measure = runtime.ort_session, timing.measure_alternating

    def session(*args, spinning=True, **kwargs):
        spinning_seen.append(spinning)
        return real_session(*args, spinning=spinning, **kwargs)

    def measure(*args, lead_in=0, **kwargs):
        lead_in_seen.append(lead_in)
        return real_measure(*args, lead_in=lead_in, **kwargs)

    monkeypatch.setattr(runtime, 'ort_session', session)
    monkeypatch.setattr(timing, 'measure_alternating', measure)
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
    assert spinning_seen == [False] * 4  # ours and the counterpart, at both sizes
    assert lead_in_seen == [1, 1]
    for r in rows:
        assert float(r['max_rel_diff']) < 1e-4
        assert float(r['onnx_vs_counterpart']) == pytest.approx(
            float(r['onnx_ms']) / float(r['counterpart_onnx_ms']), rel=1e-2)


def test_quadtree_is_timed_with_and_without_its_runtime_operator():
    """Where flatten_mm's ONNX Runtime operator changes the graph (QuadTree), both files
    are timed in the same rounds: one row per graph, the same eager time in both."""
    pytest.importorskip('onnxruntime')
    from flatten_mm.deploy import ort_ops
    if ort_ops.library_path() is None:  # (an error in CI: FLATTEN_MM_REQUIRE_CPU_KERNELS)
        pytest.skip(f'flatten_mm ONNX Runtime operators unavailable: {ort_ops.status()}')
    n = torch.get_num_threads()
    try:
        rows = bo.onnx_rows(['quadtree-b-pvt-v2-b0'], [(256, 256)], threads=(1, ), warmup=0,
                            repeats=1, counterparts=False)
    finally:
        torch.set_num_threads(n)
    assert [r['graph'] for r in rows] == ['standard', 'flatten_mm ops']
    assert rows[0]['eager_ms'] == rows[1]['eager_ms']
    for r in rows:
        # (QuadTree on random weights: a few near-tied top-k picks differ from eager, up to
        # 2.4e-3 relative, docs/user_guides/deploy.md; 2.1e-3 here)
        assert float(r['max_rel_diff']) < 5e-3
        assert r['onnx_vs_eager'] == pytest.approx(r['onnx_ms'] / r['eager_ms'], rel=1e-2)
