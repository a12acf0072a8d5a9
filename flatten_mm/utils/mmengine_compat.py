"""Make mmengine 0.10.7 read its own checkpoints under torch >= 2.6.

mmengine 0.10.7's local checkpoint loader calls ``torch.load`` without
``weights_only``; since torch 2.6 that means ``weights_only=True``, and the runner's
own checkpoints (message hub ``HistoryBuffer`` objects holding numpy arrays) are then
refused, so ``resume`` and ``load_from`` fail (mmengine#1655, fixed upstream only on an
unreleased branch).

Instead of falling back to full unpickling, the local scheme is re-registered with a
loader that keeps ``weights_only=True`` and allow-lists exactly the classes mmengine
writes into a checkpoint (``HistoryBuffer``, numpy arrays/dtypes/scalars). Foreign
files keep the safe default. For a trusted file that needs more, set
``FLATTEN_MM_TRUST_CHECKPOINTS=1`` (full unpickling, arbitrary code execution risk).
Importing ``flatten_mm.models`` (what configs' ``custom_imports`` do) installs it.
"""
import importlib
import os
import pickle
from typing import Any, List, Optional

import torch
from mmengine.runner.checkpoint import CheckpointLoader

_installed = False

#: names of globals an mmengine runner checkpoint may contain besides tensors
SAFE_GLOBAL_NAMES = {
    'mmengine.logging.history_buffer.HistoryBuffer',
    'numpy.core.multiarray._reconstruct',
    'numpy._core.multiarray._reconstruct',
    'numpy.core.multiarray.scalar',
    'numpy._core.multiarray.scalar',
    'numpy.ndarray',
    'numpy.dtype',
}
SAFE_GLOBAL_PREFIXES = ('numpy.dtypes.', )


def _resolve(name: str) -> Optional[Any]:
    module, _, attr = name.rpartition('.')
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def allowed_globals_for(filename: str) -> List[Any]:
    """The allow-listed globals that ``filename`` needs (raises if it needs others)."""
    needed = torch.serialization.get_unsafe_globals_in_checkpoint(filename)
    refused = [n for n in needed
               if n not in SAFE_GLOBAL_NAMES and not n.startswith(SAFE_GLOBAL_PREFIXES)]
    if refused:
        raise pickle.UnpicklingError(
            f'{filename} contains pickled objects outside the allow-list of mmengine '
            f'checkpoints: {refused}. If you trust this file, set '
            'FLATTEN_MM_TRUST_CHECKPOINTS=1 to load it with full unpickling.')
    return [obj for obj in (_resolve(n) for n in needed) if obj is not None]


def load_local_checkpoint(filename: str, map_location=None) -> Any:
    """Replacement of mmengine's local loader (see the module docstring)."""
    filename = os.path.expanduser(filename)
    if not os.path.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    if os.environ.get('FLATTEN_MM_TRUST_CHECKPOINTS', '0') == '1':
        return torch.load(filename, map_location=map_location, weights_only=False)
    try:
        return torch.load(filename, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        extra = allowed_globals_for(filename)
        with torch.serialization.safe_globals(extra):
            return torch.load(filename, map_location=map_location, weights_only=True)


def install() -> None:
    """Register ``load_local_checkpoint`` for plain paths (idempotent)."""
    global _installed
    if _installed:
        return
    CheckpointLoader.register_scheme(prefixes='', loader=load_local_checkpoint, force=True)
    _installed = True
