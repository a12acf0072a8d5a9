"""Run an exported file in ONNX Runtime, refusing input sizes it is not valid for."""
import json
from typing import Dict, Sequence, Tuple

import numpy as np

from . import ort_ops

#: prefix of our keys in the ONNX file's ``metadata_props``
META_PREFIX = 'flatten_mm.'


def read_metadata(path: str) -> Dict[str, str]:
    """The ``flatten_mm.*`` entries of the file's ``metadata_props`` (prefix removed)."""
    import onnx
    model = onnx.load(path, load_external_data=False)
    return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props
            if p.key.startswith(META_PREFIX)}


def size_range(meta: Dict[str, str]) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """``(min (H, W), max (H, W))`` the file is valid for (equal for a fixed-size file)."""
    return tuple(json.loads(meta['min_hw'])), tuple(json.loads(meta['max_hw']))


def check_input_shape(meta: Dict[str, str], shape: Sequence[int], path: str = 'the file') -> None:
    """Raise ``ValueError`` naming the valid range when ``shape`` (B, C, H, W) is outside it."""
    if len(shape) != 4 or shape[1] != 3:
        raise ValueError(f'{path}: expected a (B, 3, H, W) input, got shape {tuple(shape)}')
    batch = int(meta.get('batch', 1))
    if shape[0] != batch:
        raise ValueError(f'{path}: exported for batch {batch}, got {shape[0]}')
    (lo_h, lo_w), (hi_h, hi_w) = size_range(meta)
    H, W = int(shape[2]), int(shape[3])
    if lo_h <= H <= hi_h and lo_w <= W <= hi_w:
        return
    if (lo_h, lo_w) == (hi_h, hi_w):
        why = meta.get('static_reason', '')
        raise ValueError(f'{path} is valid for input {lo_h}x{lo_w} only, got {H}x{W}'
                         + (f' ({why})' if why else '') + '; export again at this size')
    raise ValueError(f'{path} is valid for inputs from {lo_h}x{lo_w} to {hi_h}x{hi_w} (H x W), '
                     f'got {H}x{W}')


def ort_session(path: str, providers=('CPUExecutionProvider', ), threads: int = 0,
                spinning: bool = True):
    """An ``onnxruntime.InferenceSession`` of any ``.onnx`` file: errors-only logging (no
    unused-initializer warnings), ``threads`` intra-op threads and one inter-op thread
    (0: ONNX Runtime's defaults), and flatten_mm's operator library registered when the
    file uses it (``ort_ops``; ``RuntimeError`` saying why when it cannot be built).

    ``spinning=False`` lets the intra-op workers sleep as soon as a call ends
    (``session.intra_op.allow_spinning=0``) instead of spin-waiting for the next call and
    taking the cores from whatever else runs in the process meanwhile; a server that runs
    one session back to back keeps the default."""
    import onnx
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if ort_ops.uses_custom_ops(onnx.load(path, load_external_data=False)):
        ort_ops.register(opts)
    if not spinning:
        opts.add_session_config_entry('session.intra_op.allow_spinning', '0')
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=list(providers))


class OnnxModel:
    """An ONNX Runtime (CPU) session of a file written by ``export_onnx``.

    ``model(x)`` checks ``x (B, 3, H, W)`` against the size range in the file's metadata
    (``ValueError`` outside it) and returns the outputs as numpy arrays.

    Args:
        path: the ``.onnx`` file.
        providers: ONNX Runtime execution providers (default CPU).
        threads: intra-op threads (0: ONNX Runtime's default).
        spinning: let idle intra-op workers spin-wait (see ``ort_session``).
    """

    def __init__(self, path: str, providers=('CPUExecutionProvider', ), threads: int = 0,
                 spinning: bool = True):
        self.path = path
        self.meta = read_metadata(path)
        if 'min_hw' not in self.meta:
            raise ValueError(f'{path} has no flatten_mm size metadata: export it with '
                             'flatten_mm.deploy.export_onnx / tools/deployment/export_onnx.py')
        self.session = ort_session(path, providers, threads, spinning=spinning)
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [o.name for o in self.session.get_outputs()]

    def check(self, shape: Sequence[int]) -> None:
        check_input_shape(self.meta, shape, self.path)

    def __call__(self, x) -> list:
        x = x.detach().cpu().numpy() if hasattr(x, 'detach') else np.asarray(x)
        self.check(x.shape)
        return self.session.run(None, {self.input_name: np.ascontiguousarray(x, np.float32)})
