"""Data transforms used by flatten_mm configs (registered in ``flatten_mm.registry.TRANSFORMS``)."""
from .transforms import AlignResize

__all__ = ['AlignResize']
