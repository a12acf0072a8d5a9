"""``torch.compile`` traces every backbone family as one graph (no graph breaks in the
attention ops), checked with ``torch._dynamo.explain`` on small models (tracing only, no
code generation, so no C++ compiler is needed). The benchmark's ``--compile`` option
additionally compiles and runs them (``--compile-backend inductor``)."""
import pytest
import torch

from benchmarks import core as bm

dynamo = pytest.importorskip('torch._dynamo')
# one model per attention operator family (QuadTree A shares B's code paths)
MODELS = {k: v for k, v in bm.tiny_backbones().items() if k != 'quadtree-a-pvt-v2'}


@pytest.mark.timeout(300)
@pytest.mark.parametrize('name', sorted(MODELS))
def test_backbone_traces_without_graph_breaks(name):
    if not callable(getattr(dynamo, 'explain', None)):
        # the one condition that is not a failure: this torch has no explain API
        pytest.skip(f'torch {torch.__version__} has no torch._dynamo.explain')
    model, hw = MODELS[name]
    report = bm.compile_report(model, torch.randn(1, 3, *hw))
    # any error (a tracing failure included) fails, whatever its message says
    assert report['error'] is None, report['error']
    assert report['graph_breaks'] == 0, report['break_reasons']
    assert report['graphs'] == 1


@pytest.mark.timeout(300)
def test_compiled_fla_model_matches_eager():
    """AOT autograd (functionalisation, no code generation) keeps the outputs."""
    model, hw = MODELS['flatten-pvt-v2']
    report = bm.compile_report(model, torch.randn(1, 3, *hw), backend='aot_eager')
    assert report['error'] is None, report['error']
    assert report['max_abs_diff'] < 1e-5
