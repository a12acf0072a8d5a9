"""Export-time rewrites of OpenMMLab modules whose Python size arithmetic would freeze the
input size into the graph (what mmdeploy's function rewriters do, for the modules our
configs use). Each rewrite computes the same values in a form torch.export keeps symbolic.

* ``mmseg.models.utils.Upsample`` (Semantic FPN's ``FPNHead.scale_heads``):
  ``size = [int(t * scale_factor) ...]`` turns the symbolic size into a float and back,
  and the exported file then resizes to the export size at every input size. For an
  integral ``scale_factor`` (2 in every mmseg config) the rewrite uses ``t * int(sf)``:
  the same sizes, kept symbolic.
* ``QuadTreeAttention`` inference: every level as one chunk
  (``quadtree_attention.levels_in_one_chunk``): the chunk loop is Python, so the traced
  graph would hold every chunk unrolled (5x slower export at 256x256, impractical at 512x512).
"""
import contextlib
from typing import Iterator, List

import torch.nn as nn


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
    from flatten_mm.models.layers.quadtree_attention import levels_in_one_chunk
    stack = contextlib.ExitStack()
    stack.enter_context(levels_in_one_chunk())
    undo.append(stack.close)
    applied.append('flatten_mm QuadTreeAttention (levels in one chunk)')
    try:
        yield applied
    finally:
        for fn in reversed(undo):
            fn()
