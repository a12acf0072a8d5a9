"""The models: importing this package registers every backbone in the ``flatten_mm``
scope (``flatten_mm.registry.MODELS``); configs name it in ``custom_imports``.

From the bottom up: ``ops`` (optional fast paths -- Triton, C++ -- behind one dispatch,
each with the PyTorch path as fallback), ``layers`` (the attention operators and blocks
in plain PyTorch, the reference), ``catalogue`` (every backbone variant under a
user-facing name, derived from the registered arch tables), ``zoo`` (the official
checkpoints of those variants), ``hub`` (the ``flatten_mm://`` checkpoint scheme over
them), ``pretrained`` (checked ``init_cfg=Pretrained`` loading),
``backbones`` (one skeleton per family, variants as ``arch_zoo`` tables), ``necks`` (the
classification parts between a backbone and mmpretrain's heads) and ``classification``
(the mmpretrain classifier config of any backbone).
"""
from ..compat import install as _install_checkpoint_loader
from .backbones import *  # noqa: F401,F403
from .backbones import __all__ as _backbones_all
from .hub import install as _install_checkpoint_scheme
from .layers import ATTENTIONS, build_attention
from .necks import SimAClassAttentionNeck

_install_checkpoint_loader()
_install_checkpoint_scheme()

__all__ = list(_backbones_all) + ['ATTENTIONS', 'build_attention', 'SimAClassAttentionNeck']
