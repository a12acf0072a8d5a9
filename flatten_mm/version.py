"""Version of flatten_mm."""

__version__ = '0.1.0'
