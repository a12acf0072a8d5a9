"""``torch.onnx`` export of an ``ExportTarget`` with its valid size range in the file.

Exporter: the dynamo one (``torch.onnx.export(dynamo=True)``, torch.export + onnxscript).
The TorchScript exporter (``dynamo=False``) records Python integers computed from the
input size (``H // stride``, window padding, positional tables resized to the token grid)
as constants, so with ``dynamic_axes`` its files fail at a second size (reshapes to the
export grid, broadcast errors), and it stops on the FLA core with dynamic axes; torch.export
keeps these sizes symbolic. It can still specialise the input (a shape branch: the ONNX
input then has fixed dims) or freeze a size computed in Python (``int(h * 2.0)``: the graph
keeps dynamic dims but is wrong elsewhere); both are detected below (input dims, and a run
at a second size) and the file is then declared fixed-size.

Size range (``metadata_props``): ``min_hw`` / ``max_hw`` / ``export_hw`` / ``dynamic`` /
``static_reason``. With ``dynamic`` the range is the one torch.export was asked to keep
symbolic (``[max(min_input_size, 32), max_hw]``); a model whose structure depends on the
size (``SIZE_DEPENDENT``), a failed dynamic export or an input the exporter specialised
gives a fixed-size file valid for ``export_hw`` only, with the reason. ``OnnxModel``
refuses sizes outside the range.

The optional QuadTree CPU kernel is switched off during export (the PyTorch path is
exported); Triton kernels only run on CUDA tensors and the export runs on CPU.
"""
import json
import os
import os.path as osp
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .rewrites import export_rewrites
from .runtime import META_PREFIX
from .targets import ExportTarget

#: operator class name -> why its exported graph is valid for the export size only
SIZE_DEPENDENT: Dict[str, str] = {
    'QuadTreeAttention': (
        'QuadTree: the pyramid levels, their top-k candidate counts and the token grids '
        'follow from H, W; torch.export cannot keep them symbolic'),
    'ShiftedWindowAttention': (
        'shifted windows: the window padding is decided in Python (pad only when H, W are '
        'not window multiples) and the shift mask is built per concrete size, so torch.export '
        'specialises the input size'),
    'CrossShapedAttention': (
        'cross-shaped stripes: the centred stripe padding is decided in Python per concrete '
        'size, so torch.export specialises the input size'),
}
#: largest H, W a dynamic file is declared valid for (torch.export's symbolic range)
DEFAULT_MAX_HW = (4096, 4096)


@dataclass
class ExportResult:
    """What ``export_onnx`` wrote: ``path``, the metadata written (``meta``) and messages."""

    path: str
    meta: Dict[str, str]
    messages: List[str]

    @property
    def dynamic(self) -> bool:
        return self.meta['dynamic'] == 'true'

    @property
    def min_hw(self) -> Tuple[int, int]:
        return tuple(json.loads(self.meta['min_hw']))

    @property
    def max_hw(self) -> Tuple[int, int]:
        return tuple(json.loads(self.meta['max_hw']))


def size_dependent_reason(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` can only be exported at a fixed size (``None``: no such operator)."""
    for m in module.modules():
        reason = SIZE_DEPENDENT.get(type(m).__name__)
        if reason:
            return reason
    return None


def _torch_export(module, x, path, opset, dynamic_shapes, output_names):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torch.onnx.export(module, (x, ), path, dynamo=True, opset_version=opset,
                          input_names=['input'], output_names=list(output_names),
                          dynamic_shapes=dynamic_shapes, external_data=False, verbose=False)


def export_onnx(target: ExportTarget, path: str, hw: Sequence[int] = (512, 512),
                dynamic: bool = False, opset: int = 18,
                max_hw: Sequence[int] = DEFAULT_MAX_HW, verify: bool = True,
                verify_tol: float = 1e-4) -> ExportResult:
    """Export ``target.module`` for a ``(1, 3, H, W)`` input to ``path``.

    Args:
        target: what to export (``backbone_target`` / ``config_target``).
        path: output ``.onnx`` file.
        hw: ``(H, W)`` of the example input (the demo image resized).
        dynamic: keep H and W symbolic (see the module doc for when this falls back to a
            fixed-size file; the returned ``messages`` say so).
        opset: ONNX opset.
        max_hw: upper end of the dynamic range.
        verify: with ``dynamic``, run the file in ONNX Runtime at a second, non-square size
            and compare with PyTorch; above ``verify_tol`` (max relative difference) the
            file is declared fixed-size (valid for ``hw`` only) in its metadata.
        verify_tol: see ``verify``.

    Returns:
        ``ExportResult`` with the metadata written into the file.

    Raises:
        ValueError: ``hw`` below the model's ``min_input_size()``.
    """
    import onnx
    from ..models.layers import cpu_kernels
    H, W = int(hw[0]), int(hw[1])
    lo_h, lo_w = target.min_hw
    if H < lo_h or W < lo_w:
        raise ValueError(f'{target.name}: the export size {H}x{W} is below the smallest input '
                         f'the model accepts ({lo_h}x{lo_w})')
    module = target.module.eval()
    x = target.example_input((H, W))
    messages: List[str] = []
    static_reason = size_dependent_reason(module) if dynamic else None
    if static_reason:
        messages.append(f'--dynamic not possible: {static_reason}; the file is valid for '
                        f'{H}x{W} only')
    d_lo = (min(max(lo_h, 32), H), min(max(lo_w, 32), W))
    d_hi = (max(int(max_hw[0]), H), max(int(max_hw[1]), W))
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with torch.no_grad(), cpu_kernels.use_cpu_kernels(False), export_rewrites():
        if dynamic and not static_reason:
            shapes = ({2: torch.export.Dim('height', min=d_lo[0], max=d_hi[0]),
                       3: torch.export.Dim('width', min=d_lo[1], max=d_hi[1])}, )
            try:
                _torch_export(module, x, path, opset, shapes, target.output_names)
            except Exception as e:  # a shape branch torch.export cannot keep general
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                first = next((ln for ln in lines if 'violated' in ln or 'Error' in ln),
                             lines[0] if lines else type(e).__name__)
                static_reason = f'torch.export could not keep H, W symbolic ({first[:300]})'
                messages.append(f'--dynamic not possible: {static_reason}; exporting a file '
                                f'valid for {H}x{W} only')
        if not dynamic or static_reason:
            _torch_export(module, x, path, opset, None, target.output_names)
    model = onnx.load(path)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    if dynamic and not static_reason and any(d.HasField('dim_value') for d in dims[2:]):
        static_reason = 'the exporter specialised the input size (a size-dependent branch)'
        messages.append(f'--dynamic not possible: {static_reason}; the file is valid for '
                        f'{H}x{W} only')
    is_dynamic = bool(dynamic and not static_reason)
    if is_dynamic and verify:
        # the exporter may still have frozen a size computed in Python (int() of a
        # symbolic size, caches keyed by shape): run the file at another, non-square size
        probe = (max(d_lo[0], H * 3 // 4), min(W + 32, d_hi[1]))
        worst = _probe(target, path, probe)
        if worst > verify_tol:
            static_reason = (f'the exported graph differs from PyTorch at {probe[0]}x{probe[1]} '
                             f'(max relative difference {worst:.2e}): a size is fixed in it')
            messages.append(f'--dynamic not possible: {static_reason}; the file is valid for '
                            f'{H}x{W} only')
            is_dynamic = False
    meta = {
        'kind': target.kind,
        'source': target.name,
        'input': target.input_format,
        'outputs': json.dumps(list(target.output_names)),
        'batch': '1',
        'export_hw': json.dumps([H, W]),
        'dynamic': 'true' if is_dynamic else 'false',
        'min_hw': json.dumps(list(d_lo) if is_dynamic else [H, W]),
        'max_hw': json.dumps(list(d_hi) if is_dynamic else [H, W]),
        'static_reason': static_reason or '',
        'notes': ' | '.join(target.notes),
        'torch': torch.__version__,
    }
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, {META_PREFIX + k: v for k, v in meta.items()})
    onnx.save(model, path)
    return ExportResult(path, meta, messages)


def _probe(target: ExportTarget, path: str, hw: Sequence[int]) -> float:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(path, opts, providers=['CPUExecutionProvider'])
    x = target.example_input(hw)
    with torch.no_grad():
        ref = target.module(x)
    try:
        out = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        return max(max_relative_differences(ref, out))
    except Exception:  # e.g. a reshape to the export size: not valid at this size
        return float('inf')


def max_relative_differences(reference: Sequence[torch.Tensor],
                             outputs: Sequence[np.ndarray]) -> List[float]:
    """Per output ``max |out - ref| / max |ref|`` (shapes must match, else ``ValueError``)."""
    if len(reference) != len(outputs):
        raise ValueError(f'{len(outputs)} outputs, expected {len(reference)}')
    diffs = []
    for i, (r, o) in enumerate(zip(reference, outputs)):
        r = r.detach().cpu().double().numpy()
        o = np.asarray(o, dtype=np.float64)
        if r.shape != o.shape:
            raise ValueError(f'output {i}: shape {o.shape}, PyTorch gives {r.shape}')
        diffs.append(float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-12)))
    return diffs


def compare_with_pytorch(
        target: ExportTarget, path: str,
        sizes: Sequence[Sequence[int]]) -> List[Tuple[Tuple[int, int], List[float]]]:
    """Run the file in ONNX Runtime (CPU) on the demo image at each size and return the
    per-output ``max_relative_differences`` to PyTorch eager."""
    from .runtime import OnnxModel
    session = OnnxModel(path)
    results = []
    for hw in sizes:
        x = target.example_input(hw)
        with torch.no_grad():
            ref = target.module(x)
        results.append(((int(hw[0]), int(hw[1])), max_relative_differences(ref, session(x))))
    return results
