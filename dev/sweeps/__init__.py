"""Resumable sweeps of ``swap_backbone`` over upstream mmdet / mmseg configs; the
command line is ``dev/swap_sweep.py``."""
