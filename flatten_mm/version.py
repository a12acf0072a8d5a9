"""Version of flatten_mm, and the oldest torch it runs on."""

__version__ = '0.1.0'
#: the oldest torch release whose APIs flatten_mm uses (torch.compiler.is_exporting: 2.7)
MIN_TORCH = (2, 7)
