"""Checkpoint converters: pure functions ``official state dict -> flatten_mm state dict``.

Each family module registers its converter with ``register_converter``; every module of
this package is imported here, so ``CONVERTERS`` lists them all.
"""
import importlib
import pkgutil

from .common import (BACKBONES, CLASSIFIER_RULES, CONVERTERS, SIGNATURES, ConvertResult,
                     guess_family, key_mismatch_report, register_converter, rename,
                     unwrap_checkpoint)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in ('common', 'classifier'):
        importlib.import_module(f'{__name__}.{_mod.name}')

from .classifier import convert_classifier  # noqa: E402

__all__ = [
    'BACKBONES', 'CLASSIFIER_RULES', 'CONVERTERS', 'SIGNATURES', 'ConvertResult',
    'convert_classifier', 'guess_family', 'key_mismatch_report', 'register_converter', 'rename',
    'unwrap_checkpoint'
]
