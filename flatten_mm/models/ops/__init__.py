"""Optional fast paths of the attention operators and what they share with the operators.

The operators in ``models/layers`` are plain PyTorch and stay the reference; the fast paths
here are used only through ``dispatch`` (Triton kernels: ``fla_triton``, ``quadtree_triton``)
or with their own fallback (``quadtree_cpu``: a compiled CPU inference kernel). Nothing here
imports ``models/layers``: ``layout`` / ``quadtree_layout`` / ``autograd_paths`` are the
helpers both sides use. Importing this package does not import Triton.
"""
from . import dispatch

__all__ = ['dispatch']
