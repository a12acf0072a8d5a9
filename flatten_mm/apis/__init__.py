"""Whole models from configs: build a detector / segmentor from an mmdet / mmseg config
(``forward.build_model``), run its dense part on a tensor (``forward.dense_forward``), and
convert an official whole-model checkpoint for a config (``whole_model``)."""
from .forward import build_model, dense_forward

__all__ = ['build_model', 'dense_forward']
