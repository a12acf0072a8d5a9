"""Checkpoint-parity checks against golden fixtures of the official implementations.

A fixture (format: ``shared/fixtures/README.md``) holds the official constructor
arguments, the official state dict, an input and the official outputs at documented
points. A family *adapter* builds the matching flatten_mm backbone from the official
arguments, converts the state dict with the family's converter, and reads the same
points from inside the backbone. ``dev/check_parity.py`` is a thin CLI over
``run_parity``. Adapters live one family per module and register with
``register_adapter``; every module of this package is imported here.
"""
import importlib
import pkgutil

from .core import (ADAPTERS, FixtureAdapter, ParityReport, StageResult, find_adapter,
                   register_adapter, run_parity)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != 'core':
        importlib.import_module(f'{__name__}.{_mod.name}')

__all__ = [
    'ADAPTERS', 'FixtureAdapter', 'ParityReport', 'StageResult', 'find_adapter',
    'register_adapter', 'run_parity'
]
