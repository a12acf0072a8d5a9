"""Checkpoint files and their keys, without model code: reading foreign / official files
safely (``io``), the per-family key converters of the official releases (``converters``,
pure functions) and the checked conversion workflow of ``tools/convert_checkpoint.py``
(``convert``; the target backbone is built through the registry)."""
from .io import CheckpointError, load_foreign_checkpoint, save_checkpoint_file

__all__ = ['CheckpointError', 'load_foreign_checkpoint', 'save_checkpoint_file']
