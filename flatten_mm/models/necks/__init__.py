"""Classification parts that sit between a dense backbone and mmpretrain's heads."""
from .sima_class_attention import SimAClassAttentionNeck

__all__ = ['SimAClassAttentionNeck']
