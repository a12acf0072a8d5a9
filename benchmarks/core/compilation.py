"""``torch.compile`` graph breaks and compiled outputs of a backbone. (Fast paths against
their reference paths are tests: ``tests/test_layers/test_fast_paths.py``, on a GPU with
``pytest -m cuda``.)"""
from typing import Any, Dict, Optional

import torch
import torch.nn as nn


def compile_report(model: nn.Module, x: torch.Tensor, backend: Optional[str] = None
                   ) -> Dict[str, Any]:
    """``torch.compile`` compatibility of ``model`` on input ``x``.

    Always counts graphs and graph breaks with ``torch._dynamo.explain`` (tracing only).
    With ``backend`` (e.g. ``'inductor'``, ``'aot_eager'``) the model is also compiled
    and run, and the largest absolute difference to eager mode is reported.

    Returns:
        ``dict(graphs, graph_breaks, break_reasons, max_abs_diff, error)``.
    """
    report: Dict[str, Any] = dict(graphs=None, graph_breaks=None, break_reasons=[],
                                  max_abs_diff=None, error=None)
    try:
        import torch._dynamo as dynamo
    except ImportError as err:  # pragma: no cover
        report['error'] = f'no torch._dynamo: {err}'
        return report
    model = model.eval()
    try:
        with torch.no_grad():
            dynamo.reset()
            explanation = dynamo.explain(model)(x)
        report['graphs'] = explanation.graph_count
        report['graph_breaks'] = explanation.graph_break_count
        report['break_reasons'] = [str(getattr(b, 'reason', b))[:200]
                                   for b in explanation.break_reasons][:5]
        if backend is not None:
            dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            with torch.no_grad():
                ref = model(x)
                out = compiled(x)
            ref = ref if isinstance(ref, (tuple, list)) else (ref, )
            out = out if isinstance(out, (tuple, list)) else (out, )
            report['max_abs_diff'] = max(float((a - b).abs().max()) for a, b in zip(ref, out))
    except Exception as err:  # noqa: BLE001 - reported, the benchmark goes on
        report['error'] = f'{type(err).__name__}: {str(err)[:300]}'
    finally:
        dynamo.reset()
    return report
