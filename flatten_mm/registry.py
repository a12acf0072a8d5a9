"""The ``flatten_mm`` registry scope.

``MODELS`` is a child of mmengine's root ``MODELS`` registry, so configs that run
under ``default_scope='mmdet'`` or ``'mmseg'`` can write
``type='flatten_mm.FLattenPVTv2'``: mmengine resolves the ``flatten_mm.`` prefix
by importing this module, and ``locations`` imports the model package that
performs the registration.
"""
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import TRANSFORMS as MMENGINE_TRANSFORMS
from mmengine.registry import Registry

MODELS = Registry('model', parent=MMENGINE_MODELS, scope='flatten_mm',
                  locations=['flatten_mm.models'])
#: data transforms (``type='flatten_mm.AlignResize'`` in mmseg / mmdet pipelines)
TRANSFORMS = Registry('transform', parent=MMENGINE_TRANSFORMS, scope='flatten_mm',
                      locations=['flatten_mm.datasets'])

__all__ = ['MODELS', 'TRANSFORMS']
