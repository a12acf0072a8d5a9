"""The registered dense backbones, one family per file: the PVT skeleton (FLatten-PVT /
PVTv2, plain and hybrid PVTv2, QuadTree on PVTv2), FLatten-Swin, FLatten-CSwin and
SimA-XCiT, each with its variants as an ``arch_zoo`` table."""
from .flatten_cswin import FLattenCSWin
from .flatten_swin import FLattenSwin
from .pvt import FLattenPVT, FLattenPVTv2, PyramidVisionBackbone
from .pvt_hybrid import PVTv2
from .quadtree_pvt import QuadTreePVTv2
from .sima_xcit import SimAXCiT

__all__ = ['FLattenCSWin', 'FLattenSwin',
           'FLattenPVT', 'FLattenPVTv2', 'PyramidVisionBackbone', 'QuadTreePVTv2', 'SimAXCiT',
           'PVTv2']
