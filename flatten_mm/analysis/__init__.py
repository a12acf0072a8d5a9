"""What a model costs and what its attention does: FLOP / parameter counting
(``flops``, ``tools/analysis/get_flops.py``) and attention maps (``visualize``,
``tools/analysis/visualize_attention.py``)."""
