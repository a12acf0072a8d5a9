"""flatten_mm: efficient-attention backbones (FLatten, SimA, QuadTree) for OpenMMLab."""

from .version import __version__

__all__ = ['__version__']
