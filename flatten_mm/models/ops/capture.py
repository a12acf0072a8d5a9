"""Whether the forward is being captured as a graph for another runtime.

``torch.export`` (which ``torch.onnx.export(dynamo=True)`` and ``flatten_mm.deploy`` run)
and TorchScript tracing record the ops of one forward; the operators then take the forms
that runtime executes well where eager PyTorch prefers another (QuadTree's tile form, the
FLA key mean as a matrix product). Values are the same up to float rounding.

Inside ``runtime_custom_ops()`` a captured graph may also use operators that only a
runtime with flatten_mm's custom operator library runs (``quadtree_graph_op``): the
exporter that enables them maps them to that runtime's nodes.

Inside ``graph_form()`` an eager forward takes the captured forms too: what an exported
file computes, run by PyTorch (the reference an export check compares a runtime with).
"""
import contextlib
from typing import Iterator

import torch

_custom_ops = False
_graph_form = False


def graph_capture() -> bool:
    """``True`` inside ``torch.export`` / ``torch.onnx.export``, TorchScript tracing or
    ``graph_form()``."""
    return _graph_form or torch.compiler.is_exporting() or torch.jit.is_tracing()


@contextlib.contextmanager
def graph_form(enabled: bool = True) -> Iterator[None]:
    """Run eager forwards inside the block in the forms a captured graph takes
    (``graph_capture()`` is ``True``): the same computation as the exported file, up to
    float rounding, where eager PyTorch may sum in another order (QuadTree's fused CPU
    kernel) and so break near-ties of a top-k differently. Not thread-safe."""
    global _graph_form
    previous, _graph_form = _graph_form, bool(enabled)
    try:
        yield
    finally:
        _graph_form = previous


@contextlib.contextmanager
def runtime_custom_ops(enabled: bool = True) -> Iterator[None]:
    """Let graphs captured inside the block use flatten_mm's runtime custom operators
    (not thread-safe; the exporter must translate them, see ``deploy.export_onnx``)."""
    global _custom_ops
    previous, _custom_ops = _custom_ops, bool(enabled)
    try:
        yield
    finally:
        _custom_ops = previous


def custom_ops_requested() -> bool:
    """``True`` while a graph is captured inside ``runtime_custom_ops()``."""
    return _custom_ops and graph_capture()
