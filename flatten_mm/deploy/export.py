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
symbolic (``[max(min_input_size, 32), max_hw]``, or from a larger lower end, doubled up
to the export size, when torch.export's shape guards only hold from there: the tool says
so); a model whose structure depends on the
size (``SIZE_DEPENDENT``), a failed dynamic export or an input the exporter specialised
gives a fixed-size file valid for ``export_hw`` only, with the reason. ``OnnxModel``
refuses sizes outside the range.

The optional QuadTree CPU kernel is switched off during export (the PyTorch path is
exported); Triton kernels only run on CUDA tensors and the export runs on CPU.

``custom_ops=True`` writes flatten_mm's ONNX Runtime operators from their schema, whether
or not their library can be built here; the file is run once in ONNX Runtime when the
library is available, and the result says plainly (a warning, ``messages``,
``verified=False``) when it could not be. ``custom_ops='auto'`` falls back to standard
operators where the library is not available.

Checks (``compare_with_pytorch``, the dynamic-size probe) compare ONNX Runtime with
PyTorch running the exported graph form (``capture.graph_form()`` under the export
rewrites): the same computation up to float rounding. Eager PyTorch may differ more, where
it sums in another order (QuadTree's fused CPU kernel) and a near-tie of a top-k then
breaks the other way; the checks report that difference, and the flipped selections,
separately.
"""
import json
import os
import os.path as osp
import warnings
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..models.ops import quadtree_cpu as cpu_kernels
from ..models.ops.capture import graph_form, runtime_custom_ops
from . import ort_ops
from .rewrites import export_rewrites
from .runtime import META_PREFIX, OnnxModel, ort_session
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
#: operator class name -> the ONNX Runtime operator ``custom_ops=True`` writes for it
RUNTIME_OPERATORS: Dict[str, str] = {'QuadTreeAttention': 'flatten_mm::QuadTreeLevel'}
#: largest H, W a dynamic file is declared valid for (torch.export's symbolic range)
DEFAULT_MAX_HW = (4096, 4096)


@dataclass
class ExportResult:
    """What ``export_onnx`` wrote: ``path``, the metadata written (``meta``) and messages;
    ``verified``: for a file with flatten_mm's ONNX Runtime operators, whether it ran in
    ONNX Runtime here and matched PyTorch (``None``: a file of standard operators)."""

    path: str
    meta: Dict[str, str]
    messages: List[str]
    verified: Optional[bool] = None

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


def _lower_bounds(lo: Tuple[int, int], export_hw: Tuple[int, int]) -> List[Tuple[int, int]]:
    """Lower ends to try for the dynamic range: ``lo``, then doubled, up to the export size."""
    out = [tuple(lo)]
    while out[-1] != tuple(export_hw):
        h, w = out[-1]
        out.append((min(h * 2, export_hw[0]), min(w * 2, export_hw[1])))
    return out


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = next((ln for ln in lines if 'violated' in ln or 'Error' in ln),
                 lines[0] if lines else type(e).__name__)
    return first[:300]


def _torch_export(module, x, path, opset, dynamic_shapes, output_names, custom_ops=False):
    extra = {}
    if custom_ops:
        extra['custom_translation_table'] = ort_ops.translation_table()
    with warnings.catch_warnings(), runtime_custom_ops(custom_ops):
        warnings.simplefilter('ignore')
        torch.onnx.export(module, (x, ), path, dynamo=True, opset_version=opset,
                          input_names=['input'], output_names=list(output_names),
                          dynamic_shapes=dynamic_shapes, external_data=False, verbose=False,
                          **extra)


def _export_dynamic(target: ExportTarget, module: torch.nn.Module, x: torch.Tensor, path: str,
                    opset: int, d_lo: Tuple[int, int], d_hi: Tuple[int, int],
                    messages: List[str], custom_ops: bool = False
                    ) -> Tuple[Optional[str], Tuple[int, int]]:
    """Export with symbolic H, W from ``d_lo`` (or the lowest lower bound that works) to
    ``d_hi``. Returns ``(static_reason, lower bound)``: a reason when no range could be
    kept symbolic (nothing written then), else ``None``; ``messages`` gets what changed.

    torch.export turns shape guards into constraints on H, W; some only hold from a larger
    size on (e.g. a conv backend choice guarded on "the last stage has more than one
    token"): the range then starts higher, never below what was asked and never above the
    export size.
    """
    H, W = x.shape[-2:]
    first_error = None
    for lower in _lower_bounds(d_lo, (H, W)):
        shapes = ({2: torch.export.Dim('height', min=lower[0], max=d_hi[0]),
                   3: torch.export.Dim('width', min=lower[1], max=d_hi[1])}, )
        try:
            _torch_export(module, x, path, opset, shapes, target.output_names, custom_ops)
        except Exception as e:  # a shape branch torch.export cannot keep general
            first_error = first_error or e
            continue
        if lower != d_lo:
            messages.append(f'dynamic range starts at {lower[0]}x{lower[1]}: torch.export '
                            f'could not keep sizes from {d_lo[0]}x{d_lo[1]} symbolic '
                            f'({_first_line(first_error)})')
        return None, lower
    reason = f'torch.export could not keep H, W symbolic ({_first_line(first_error)})'
    messages.append(f'--dynamic not possible: {reason}; exporting a file valid for '
                    f'{H}x{W} only')
    return reason, d_lo


def operator_library() -> Tuple[Optional[str], str]:
    """``(path, '')`` of flatten_mm's ONNX Runtime operator library (built on first use),
    or ``(None, why not)`` where it cannot be built here."""
    try:
        path = ort_ops.library_path()
    except Exception as e:  # (FLATTEN_MM_REQUIRE_CPU_KERNELS=1 raises where it cannot)
        return None, f'{type(e).__name__}: {e}'
    return (path, '') if path else (None, ort_ops.status())


def _runtime_operators(module: torch.nn.Module) -> List[str]:
    return sorted({RUNTIME_OPERATORS[type(m).__name__] for m in module.modules()
                   if type(m).__name__ in RUNTIME_OPERATORS})


def _resolve_custom_ops(custom_ops: Union[bool, str], module: torch.nn.Module,
                        messages: List[str]) -> Tuple[bool, Optional[str], str]:
    """``(write the operators, library path or None, why there is none)`` for the
    ``custom_ops`` argument of ``export_onnx``."""
    if not (isinstance(custom_ops, bool) or custom_ops == 'auto'):
        raise ValueError(f"custom_ops must be False, True or 'auto', got {custom_ops!r}")
    if custom_ops is False or not _runtime_operators(module):
        return bool(custom_ops), None, ''
    library, why = operator_library()
    if custom_ops == 'auto' and library is None:
        messages.append(f"custom_ops='auto': the ONNX Runtime operator library is not "
                        f'available here ({why}); the file uses standard operators only')
        return False, None, why
    return True, library, why


def _verify_custom_ops(target: ExportTarget, path: str, hw: Tuple[int, int],
                       library: Optional[str], why: str, tol: float,
                       messages: List[str]) -> bool:
    """Run a file with flatten_mm's operators once in ONNX Runtime against PyTorch's graph
    form; ``False`` (warned, and said in ``messages``) where that was not possible here
    or the outputs differ. ``RuntimeError`` when the file does not run."""
    if library is None:
        msg = (f'NOT VERIFIED: the file uses flatten_mm\'s ONNX Runtime operators, whose '
               f'library is not available here ({why}), so it was not run; run it where '
               f'the library builds (`{ort_ops.TOOL} build`) before deploying it')
        warnings.warn(f'flatten_mm: {path}: {msg}', RuntimeWarning, stacklevel=3)
        messages.append(msg)
        return False
    try:
        check = compare_with_pytorch(target, path, [hw], eager=False)[0]
    except Exception as e:
        raise RuntimeError(f'{path}: the file written with flatten_mm\'s ONNX Runtime '
                           f'operators does not run in ONNX Runtime: {_first_line(e)}') from e
    worst = max(check.diffs, default=0.0)
    if worst <= tol and check.unmatched_fraction <= MAX_UNMATCHED:
        messages.append(f'custom operators verified: ran in ONNX Runtime at {hw[0]}x{hw[1]}, '
                        f'max relative difference to PyTorch\'s graph form {worst:.2e}')
        return True
    msg = (f'NOT VERIFIED: in ONNX Runtime at {hw[0]}x{hw[1]} the file differs from '
           f'PyTorch\'s graph form by {worst:.2e} (> {tol:g}), {check.unmatched_fraction:.1%} '
           'of the instances without a counterpart')
    warnings.warn(f'flatten_mm: {path}: {msg}', RuntimeWarning, stacklevel=3)
    messages.append(msg)
    return False


def _custom_ops_note(module: torch.nn.Module, model, messages: List[str]) -> bool:
    """Whether the exported ``model`` uses our ONNX Runtime operators; ``messages`` gets
    what that means, or which operators ``custom_ops=True`` would have written."""
    uses = ort_ops.uses_custom_ops(model)
    faster = _runtime_operators(module)
    if faster and not uses:
        messages.append(f'standard operators only; custom_ops=True (--custom-ops) writes '
                        f'{", ".join(faster)} instead, 1.7-1.9x faster in ONNX Runtime, for '
                        'runtimes with the operator library of flatten_mm.deploy.ort_ops')
    if uses:
        messages.append(f'the file uses flatten_mm\'s ONNX Runtime operators '
                        f'({ort_ops.DOMAIN} domain): register the library of '
                        f'flatten_mm.deploy.ort_ops where it runs (OnnxModel does)')
    return uses


def export_onnx(target: ExportTarget, path: str, hw: Sequence[int] = (512, 512),
                dynamic: bool = False, opset: int = 18,
                max_hw: Sequence[int] = DEFAULT_MAX_HW, verify: bool = True,
                verify_tol: float = 1e-4, custom_ops: Union[bool, str] = False
                ) -> ExportResult:
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
            and compare with PyTorch's graph form; above ``verify_tol`` (max relative
            difference) the file is declared fixed-size (valid for ``hw`` only) in its
            metadata.
        verify_tol: see ``verify``; also what a file with custom operators must match.
        custom_ops: ``True``: write flatten_mm's ONNX Runtime operators where the model
            has them (each QuadTree finer level as one ``flatten_mm::QuadTreeLevel`` node,
            1.7-1.9x faster in ONNX Runtime than its standard-operator form), from their
            schema, whether or not their library builds here; the file then needs the
            library of ``ort_ops`` wherever it runs (``OnnxModel`` registers it). Where
            the library is available the file is run once in ONNX Runtime (``RuntimeError``
            if it does not run; ``verified`` in the result); where it is not, a warning
            and ``messages`` say the file was not verified. ``'auto'``: the operators
            where the library is available here, else standard operators (said in
            ``messages``). ``False``: standard operators only.

    Returns:
        ``ExportResult`` with the metadata written into the file.

    Raises:
        ValueError: ``hw`` below the model's ``min_input_size()``, or a ``custom_ops``
            other than ``False`` / ``True`` / ``'auto'``.
        RuntimeError: a file with custom operators does not run in ONNX Runtime.
    """
    import onnx
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
    custom_ops, library, no_library = _resolve_custom_ops(custom_ops, module, messages)
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with torch.no_grad(), cpu_kernels.use_cpu_kernels(False), export_rewrites():
        if dynamic and not static_reason:
            static_reason, d_lo = _export_dynamic(target, module, x, path, opset, d_lo, d_hi,
                                                  messages, custom_ops)
        if not dynamic or static_reason:
            _torch_export(module, x, path, opset, None, target.output_names, custom_ops)
    model = onnx.load(path)
    uses_custom_ops = _custom_ops_note(module, model, messages)
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
        worst = _probe(target, path, probe, verify_tol)
        if worst > verify_tol:
            static_reason = (f'the exported graph differs from PyTorch at {probe[0]}x{probe[1]} '
                             f'(max relative difference {worst:.2e}): a size is fixed in it')
            messages.append(f'--dynamic not possible: {static_reason}; the file is valid for '
                            f'{H}x{W} only')
            is_dynamic = False
    meta = _metadata(target, (H, W), (d_lo, d_hi) if is_dynamic else None, static_reason,
                     uses_custom_ops)
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, {META_PREFIX + k: v for k, v in meta.items()})
    onnx.save(model, path)
    verified = (_verify_custom_ops(target, path, (H, W), library, no_library, verify_tol,
                                   messages) if uses_custom_ops else None)
    return ExportResult(path, meta, messages, verified)


def _metadata(target: ExportTarget, hw: Tuple[int, int],
              size_range: Optional[Tuple[Tuple[int, int], Tuple[int, int]]],
              static_reason: Optional[str], uses_custom_ops: bool) -> Dict[str, str]:
    """The file's ``metadata_props`` (``size_range``: ``(min, max)`` of a dynamic file)."""
    lo, hi = size_range or (hw, hw)
    return {
        'kind': target.kind,
        'source': target.name,
        'input': target.input_format,
        'outputs': json.dumps(list(target.output_names)),
        'batch': '1',
        'export_hw': json.dumps(list(hw)),
        'dynamic': 'true' if size_range else 'false',
        'min_hw': json.dumps(list(lo)),
        'max_hw': json.dumps(list(hi)),
        'static_reason': static_reason or '',
        'custom_ops': ort_ops.DOMAIN if uses_custom_ops else '',
        'notes': ' | '.join(target.notes),
        'torch': torch.__version__,
    }


def _probe(target: ExportTarget, path: str, hw: Sequence[int], tol: float) -> float:
    session = ort_session(path)
    x = target.example_input(hw)
    ref = graph_form_outputs(target, x)
    try:
        out = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        check = compare_outputs(target, ref, out, rtol=tol)
    except Exception:  # e.g. a reshape to the export size: not valid at this size
        return float('inf')
    return float('inf') if check.unmatched_fraction > MAX_UNMATCHED else max(check.diffs)


def graph_form_outputs(target: ExportTarget, x: torch.Tensor,
                       custom_ops: bool = False) -> Tuple[torch.Tensor, ...]:
    """``target.module(x)`` run eagerly as the exported graph computes it: inside
    ``capture.graph_form()`` (QuadTree's tile form, or with ``custom_ops`` its level
    operator, whose PyTorch implementation is that form), under the export rewrites,
    without the fused CPU kernel."""
    with torch.no_grad(), cpu_kernels.use_cpu_kernels(False), export_rewrites(), \
            graph_form(), runtime_custom_ops(custom_ops):
        return target.module(x)


#: largest share of instances (proposals) that may have no counterpart in a check
#: (see ``compare_outputs``)
MAX_UNMATCHED = 0.01


class Check(NamedTuple):
    """One ONNX Runtime vs PyTorch comparison at input size ``hw``.

    ``diffs``: per output, ``max |onnx - torch| / max |torch|`` (over matched instances
    where the target has an ``instance_key``); ``unmatched``: instances of PyTorch /
    ONNX Runtime without a counterpart in the other (``(0, 0)`` without instances) and
    ``instances``: their counts."""

    hw: Tuple[int, int]
    diffs: List[float]
    unmatched: Tuple[int, int] = (0, 0)
    instances: Tuple[int, int] = (0, 0)
    #: ONNX Runtime vs eager PyTorch (``compare_with_pytorch(eager=True)``): not a verdict
    eager: Optional['Check'] = None
    #: top-k selections eager PyTorch made otherwise than the graph form, and all of them
    #: (``None``: not counted, the two made different selection calls)
    flips: Optional[Tuple[int, int]] = None

    @property
    def unmatched_fraction(self) -> float:
        return max(self.unmatched) / max(max(self.instances), 1)


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
        if r.size == 0:  # e.g. no proposal survived: equal shapes are all there is
            diffs.append(0.0)
            continue
        diffs.append(float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-12)))
    return diffs


def match_instances(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
                    rtol: float = 1e-4) -> List[Tuple[int, int]]:
    """Pairs ``(i, j)``: row ``i`` of the ``reference`` arrays and row ``j`` of the
    ``outputs`` arrays hold the same instance: every value of every array within ``rtol``
    of that array's largest value. One-to-one, closest pairs first (identical rows, e.g.
    a box clipped to the image from two RPN levels, pair up in any order)."""
    a = [np.asarray(r, dtype=np.float64).reshape(len(r), -1) for r in reference]
    b = [np.asarray(o, dtype=np.float64).reshape(len(o), -1) for o in outputs]
    n_a, n_b = len(a[0]), len(b[0])
    if not n_a or not n_b:
        return []
    dist = np.zeros((n_a, n_b))
    for x, y in zip(a, b):
        scale = max(np.abs(x).max(), np.abs(y).max(), 1e-12)
        dist = np.maximum(dist, np.abs(x[:, None, :] - y[None, :, :]).max(-1) / scale)
    pairs, used_a, used_b = [], set(), set()
    for flat in np.argsort(dist, axis=None, kind='stable'):
        i, j = divmod(int(flat), n_b)
        if dist[i, j] > rtol:
            break
        if i not in used_a and j not in used_b:
            pairs.append((i, j))
            used_a.add(i)
            used_b.add(j)
    return sorted(pairs)


def compare_outputs(target: ExportTarget, reference: Sequence[torch.Tensor],
                    outputs: Sequence[np.ndarray], hw: Sequence[int] = (0, 0),
                    rtol: float = 1e-4) -> Check:
    """ONNX Runtime ``outputs`` vs PyTorch ``reference`` of ``target``.

    Without ``target.instance_key`` every output is compared element-wise
    (``max_relative_differences``). With it (two-stage detectors: ``rois`` and
    ``rpn_scores``), the number and order of instances come from top-k and NMS decisions,
    which a 1e-6 difference in a score or an IoU can flip for near-ties: instances are
    matched by those outputs' rows (``match_instances``), every per-instance output
    (first dimension = the instance count, or a prefix of it such as the first 100 for
    masks) is compared on matched rows, and the unmatched instances are counted (rows
    match within ``rtol``)."""
    hw = (int(hw[0]), int(hw[1]))
    if target.instance_key is None:
        return Check(hw, max_relative_differences(reference, outputs))
    if len(reference) != len(outputs):
        raise ValueError(f'{len(outputs)} outputs, expected {len(reference)}')
    ref = [r.detach().cpu().double().numpy() for r in reference]
    out = [np.asarray(o, dtype=np.float64) for o in outputs]
    keys = [list(target.output_names).index(name) for name in target.instance_key]
    n_ref, n_out = len(ref[keys[0]]), len(out[keys[0]])
    pairs = match_instances([ref[i] for i in keys], [out[i] for i in keys], rtol)
    diffs = []
    for i, (r, o) in enumerate(zip(ref, out)):
        if r.shape[1:] != o.shape[1:] or r.ndim == 0:
            raise ValueError(f'output {i}: shape {o.shape}, PyTorch gives {r.shape}')
        rows = [(a, b) for a, b in pairs if a < len(r) and b < len(o)]
        if not rows:
            diffs.append(0.0)
            continue
        ia, ib = (np.array(v) for v in zip(*rows))
        diffs.append(float(np.abs(o[ib] - r[ia]).max() / max(np.abs(r).max(), 1e-12)))
    return Check(hw, diffs, (n_ref - len(pairs), n_out - len(pairs)), (n_ref, n_out))


def compare_with_pytorch(target: ExportTarget, path: str, sizes: Sequence[Sequence[int]],
                         tol: float = 1e-4, eager: bool = True) -> List[Check]:
    """Run the file in ONNX Runtime (CPU) on the demo image at each size and compare with
    PyTorch running the same graph form (``graph_form_outputs``; ``compare_outputs``,
    instances matched within ``tol``). With ``eager``, each check also holds how far eager
    PyTorch is from ONNX Runtime (``Check.eager``) and how many top-k selections eager made
    otherwise than the graph form (``Check.flips``)."""
    session = OnnxModel(path)
    custom = bool(session.meta.get('custom_ops'))
    results = []
    for hw in sizes:
        x = target.example_input(hw)
        out = session(x)
        with SelectionRecorder() as graph:
            ref = graph_form_outputs(target, x, custom)
        check = compare_outputs(target, ref, out, hw, tol)
        if eager:
            with SelectionRecorder() as plain, torch.no_grad():
                eager_ref = target.module(x)
            if not custom and _runtime_operators(target.module):
                # (the level operator: one selection per QuadTree level, as the CPU
                # kernel makes it, where the tile form selects per tile)
                with SelectionRecorder() as graph:
                    graph_form_outputs(target, x, custom_ops=True)
            check = check._replace(eager=compare_outputs(target, eager_ref, out, hw, tol),
                                   flips=count_flips(plain.selections, graph.selections))
        results.append(check)
    return results


#: operators that select (name -> index of the output holding the selected indices)
SELECTING_OPS = {'aten::topk': 1, 'flatten_mm::quadtree_level': 0,
                 'flatten_mm_graph::quadtree_level': 1}


class SelectionRecorder(TorchDispatchMode):
    """Inside the block, ``selections`` gets the indices every top-k selection returned
    (``torch.topk``, QuadTree's level operators: ``SELECTING_OPS``), in call order, each
    ``(rows, k)`` with the selecting dimension last."""

    def __init__(self):
        super().__init__()
        self.selections: List[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        which = SELECTING_OPS.get(func._schema.name)
        if which is not None:
            idx = out[which]
            if func._schema.name == 'aten::topk':
                dim = (kwargs or {}).get('dim', args[2] if len(args) > 2 else -1)
                idx = idx.movedim(dim, -1)
            if idx.numel():
                self.selections.append(idx.detach().reshape(-1, idx.shape[-1]).clone())
        return out


def count_flips(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
                ) -> Optional[Tuple[int, int]]:
    """``(selections that differ, selections)`` between two runs' ``SelectionRecorder``
    lists: rows whose selected sets differ; ``None`` when the runs made other calls."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    flipped = sum(int((x.sort(-1).values != y.sort(-1).values).any(-1).sum())
                  for x, y in zip(a, b))
    return flipped, sum(len(x) for x in a)
