"""Whether the forward is being captured as a graph for another runtime.

``torch.export`` (which ``torch.onnx.export(dynamo=True)`` and ``flatten_mm.deploy`` run)
and TorchScript tracing record the ops of one forward; the operators then take the forms
that runtime executes well where eager PyTorch prefers another (QuadTree's tile form, the
FLA key mean as a matrix product). Values are the same up to float rounding.

Inside ``runtime_custom_ops()`` a captured graph may also use operators that only a
runtime with flatten_mm's custom operator library runs (``quadtree_graph_op``): the
exporter that enables them maps them to that runtime's nodes.
"""
import contextlib
from typing import Iterator

import torch

_custom_ops = False


def graph_capture() -> bool:
    """``True`` inside ``torch.export`` / ``torch.onnx.export`` or TorchScript tracing."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


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
