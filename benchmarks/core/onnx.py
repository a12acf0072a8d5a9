"""ONNX Runtime (CPU) vs PyTorch eager latency of exported backbones.

Same paired protocol as ``benchmarks.core``: both sides of a backbone run
in one process, alternating round-robin after warm-up (``measure_alternating``); rows
give medians and the ratio ONNX Runtime / eager (< 1: ONNX Runtime faster). Eager runs
the default inference path (the fused QuadTree CPU kernel when built); the ONNX file is
the exported PyTorch path. Both sides use ``threads`` intra-op threads.
"""
import os.path as osp
import tempfile
from typing import Dict, List, Sequence

import torch

#: the issue #17 row: FLatten-PVTv2-b0, QuadTree-B-b0, SimA-S12
DEFAULT_BACKBONES = ('flatten-pvt-v2-b0', 'quadtree-b-pvt-v2-b0', 'sima-xcit-s12-p16')


def onnx_vs_eager_rows(names: Sequence[str] = DEFAULT_BACKBONES,
                       hw: Sequence[int] = (512, 512), batch: int = 1, threads: int = 1,
                       warmup: int = 2, repeats: int = 10,
                       workdir: str = None, on_row=None) -> List[Dict[str, object]]:
    """Export each catalogue backbone (random weights, fixed size ``hw``), then time ONNX
    Runtime and PyTorch eager on the same input.

    Args:
        names: catalogue names.
        hw: input ``(H, W)``.
        batch: must be 1 (the exported files take batch 1).
        threads: intra-op threads of both PyTorch and ONNX Runtime.
        warmup: untimed rounds.
        repeats: timed rounds.
        workdir: where the ``.onnx`` files go (default: a temporary folder).
        on_row: called with each row as soon as it is measured.

    Returns:
        One row per backbone: ``backbone, resolution, batch, threads, eager_ms, onnx_ms``
        (medians), ``ratio`` (onnx / eager), ``eager_min_ms``, ``onnx_min_ms``,
        ``max_rel_diff`` (worst output), ``repeats``.
    """
    from .timing import measure_alternating
    from flatten_mm.deploy.export import export_onnx, max_relative_differences
    from flatten_mm.deploy.runtime import OnnxModel
    from flatten_mm.deploy.targets import backbone_target
    if batch != 1:
        raise ValueError(f'batch must be 1 (the exported files take batch 1), got {batch}')
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                torch.manual_seed(0)
                target = backbone_target(name)
                path = osp.join(workdir or tmp, f'{name}_{hw[0]}x{hw[1]}.onnx')
                export_onnx(target, path, hw, dynamic=False)
                session = OnnxModel(path, threads=threads)
                x = target.example_input(hw)
                xn = x.numpy()
                with torch.no_grad():
                    diff = max(max_relative_differences(target.module(x), session(xn)))
                timings = measure_alternating(
                    {'eager': lambda: target.module(x), 'onnx': lambda: session(xn)},
                    torch.device('cpu'), warmup=warmup, repeats=repeats)
                eager, onnx_ = timings['eager'], timings['onnx']
                rows.append(dict(
                    backbone=name, resolution=f'{hw[0]}x{hw[1]}', batch=batch, threads=threads,
                    eager_ms=round(eager.median * 1e3, 2), onnx_ms=round(onnx_.median * 1e3, 2),
                    ratio=round(onnx_.median / eager.median, 3),
                    eager_min_ms=round(eager.minimum * 1e3, 2),
                    onnx_min_ms=round(onnx_.minimum * 1e3, 2),
                    max_rel_diff=f'{diff:.2e}', repeats=repeats))
                if on_row is not None:
                    on_row(rows[-1])
    finally:
        torch.set_num_threads(previous)
    return rows
