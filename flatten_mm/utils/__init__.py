"""Utilities (checkpoint I/O)."""
from .checkpoint_io import CheckpointError, load_foreign_checkpoint, save_checkpoint_file

__all__ = ['CheckpointError', 'load_foreign_checkpoint', 'save_checkpoint_file']
