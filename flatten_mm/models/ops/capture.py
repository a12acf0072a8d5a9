"""Whether the forward is being captured as a graph for another runtime.

``torch.export`` (which ``torch.onnx.export(dynamo=True)`` and ``flatten_mm.deploy`` run)
and TorchScript tracing record the ops of one forward; the operators then take the forms
that runtime executes well where eager PyTorch prefers another (QuadTree's tile form, the
FLA key mean as a matrix product). Values are the same up to float rounding.
"""
import torch


def graph_capture() -> bool:
    """``True`` inside ``torch.export`` / ``torch.onnx.export`` or TorchScript tracing."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()
