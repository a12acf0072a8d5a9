"""Swap the backbone of an existing mmdet / mmseg config for a flatten_mm one
(``tools/swap_backbone.py``): plan and write the new config (``plan``), measure the
source backbone's strides (``measure``), and check it with one training iteration on
demo data (``smoke``, ``demo``)."""
from .measure import SwapError
from .plan import swap_backbone, verify_config
from .smoke import SmokeReport, train_smoke

__all__ = ['SmokeReport', 'SwapError', 'swap_backbone', 'train_smoke', 'verify_config']
