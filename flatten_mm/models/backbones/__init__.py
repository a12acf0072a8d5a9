"""Registered dense backbones (one family per file)."""
from .pvt import FLattenPVT, FLattenPVTv2, PyramidVisionBackbone

__all__ = ['FLattenPVT', 'FLattenPVTv2', 'PyramidVisionBackbone']
