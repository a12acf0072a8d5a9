"""Models of flatten_mm. Importing this package registers every backbone in the
``flatten_mm`` scope (``flatten_mm.registry.MODELS``)."""
from ..utils.mmengine_compat import install as _install_checkpoint_loader
from .backbones import *  # noqa: F401,F403
from .backbones import __all__ as _backbones_all
from .layers import ATTENTIONS, build_attention

_install_checkpoint_loader()

__all__ = list(_backbones_all) + ['ATTENTIONS', 'build_attention']
