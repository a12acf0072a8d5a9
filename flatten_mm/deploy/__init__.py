"""Export to ONNX and run in ONNX Runtime (``tools/deployment/export_onnx.py``).

* ``targets``: what is exported -- a bare backbone (tuple of NCHW maps), an mmseg
  segmentor (``mode='tensor'`` logits) or an mmdet detector (raw head outputs), each
  wrapped so that the graph input is a float32 RGB 0-255 ``(B, 3, H, W)`` batch.
* ``export``: the ``torch.onnx`` (dynamo) export with the size range written into the
  file's ``metadata_props``.
* ``runtime``: ``OnnxModel``, an ONNX Runtime session that reads that metadata and
  refuses input sizes the file is not valid for.
* ``ort_ops``: flatten_mm's ONNX Runtime operator library (QuadTree's levels as one node
  each, ``export_onnx(custom_ops=True)``): build, locate, register.

The latency benchmark against eager PyTorch is ``benchmarks/benchmark_onnx.py`` in a
checkout.
"""
from .export import ExportResult, export_onnx, max_relative_differences
from .runtime import OnnxModel, read_metadata
from .targets import ExportTarget, backbone_target, config_target, load_demo_image

__all__ = [
    'ExportResult', 'export_onnx', 'max_relative_differences', 'OnnxModel', 'read_metadata',
    'ExportTarget', 'backbone_target', 'config_target', 'load_demo_image'
]
