"""Export-time rewrites of OpenMMLab modules whose Python size arithmetic would freeze the
input size into the graph (what mmdeploy's function rewriters do, for the modules our
configs use). Each rewrite computes the same values in a form torch.export keeps symbolic.

* ``mmseg.models.utils.Upsample`` (Semantic FPN's ``FPNHead.scale_heads``):
  ``size = [int(t * scale_factor) ...]`` turns the symbolic size into a float and back,
  and the exported file then resizes to the export size at every input size. For an
  integral ``scale_factor`` (2 in every mmseg config) the rewrite uses ``t * int(sf)``:
  the same sizes, kept symbolic.
* ``torch.nn.AdaptiveAvgPool2d`` (UperNet's PPM, pooling to 1/2/3/6 bins): the exporter
  decomposes it into gathers at indices computed for the export size (the file failed
  at a second size: ``GatherND ... invalid index``). The rewrite averages each bin
  ``[floor(i H / n), ceil((i + 1) H / n))`` as a slice, the bins PyTorch uses.
* ``torch.nn.GELU`` (exact, ``approximate='none'``): the exporter writes
  ``x * (0.5 * (1 + erf(x / sqrt 2)))``, which ONNX Runtime's GELU fusion does not match
  (it runs as five element-wise ops over the MLP's hidden map); the rewrite writes
  ``(x * 0.5) * (1 + erf(x / sqrt 2))``, the same function, which ONNX Runtime fuses
  into one ``Gelu`` kernel (opset 18 has no GELU operator; ``Gelu`` is opset 20).
* two-stage mmdet detectors (RPN proposals, RoI extractor, RoIAlign, mmdet's legacy ONNX
  branches): ``two_stage.two_stage_rewrites``, see there.

Our operators need no rewrite: while a graph is captured (``torch.export``, which the
dynamo ONNX exporter runs) they take the forms ONNX Runtime runs fast themselves
(``models.ops.capture``: QuadTree's tile form, the FLA key mean as a matrix product),
also for a user's own ``torch.onnx.export`` call.
"""
import contextlib
import math
from typing import Iterator, List

import torch
import torch.nn as nn

from .two_stage import two_stage_rewrites


def _adaptive_avg_pool2d_forward(original):

    def forward(self, x):
        out = self.output_size
        oh, ow = (out, out) if isinstance(out, int) else tuple(out)
        if oh is None or ow is None:
            return original(self, x)
        H, W = x.shape[-2:]
        rows = []
        for i in range(oh):  # bin i covers [floor(i H / oh), ceil((i + 1) H / oh))
            h0, h1 = (i * H) // oh, ((i + 1) * H + oh - 1) // oh
            rows.append(torch.cat([
                x[..., h0:h1, (j * W) // ow:((j + 1) * W + ow - 1) // ow].mean(
                    (-2, -1), keepdim=True) for j in range(ow)], -1))
        return torch.cat(rows, -2)

    return forward


def _gelu_forward(original):

    def forward(self, x):
        if self.approximate != 'none':
            return original(self, x)
        return (x * 0.5) * (1.0 + torch.erf(x / math.sqrt(2.0)))

    return forward


def _mmseg_upsample_forward(original):

    def forward(self, x):
        sf = self.scale_factor
        if not self.size and isinstance(sf, float) and sf.is_integer():
            from mmseg.models.utils import resize
            size = [t * int(sf) for t in x.shape[-2:]]
            return resize(x, size, None, self.mode, self.align_corners)
        return original(self, x)

    return forward


@contextlib.contextmanager
def export_rewrites() -> Iterator[List[str]]:
    """Apply the rewrites inside the block; yields the names of those applied."""
    applied: List[str] = []
    undo = []
    try:
        from mmseg.models.utils import Upsample
    except Exception:  # mmseg not installed: nothing of it to rewrite
        Upsample = None
    if Upsample is not None and isinstance(Upsample, type) and issubclass(Upsample, nn.Module):
        original = Upsample.forward
        Upsample.forward = _mmseg_upsample_forward(original)
        undo.append(lambda: setattr(Upsample, 'forward', original))
        applied.append('mmseg.models.utils.Upsample')
    pool = nn.AdaptiveAvgPool2d
    original_pool = pool.forward
    pool.forward = _adaptive_avg_pool2d_forward(original_pool)
    undo.append(lambda: setattr(pool, 'forward', original_pool))
    applied.append('torch.nn.AdaptiveAvgPool2d (bins as slices)')
    original_gelu = nn.GELU.forward
    nn.GELU.forward = _gelu_forward(original_gelu)
    undo.append(lambda: setattr(nn.GELU, 'forward', original_gelu))
    applied.append('torch.nn.GELU (the form ONNX Runtime fuses)')
    stack = contextlib.ExitStack()
    undo.append(stack.close)
    applied.extend(stack.enter_context(two_stage_rewrites()))
    try:
        yield applied
    finally:
        for fn in reversed(undo):
            fn()
