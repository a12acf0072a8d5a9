"""User-facing analysis: backbone catalogue, config swapping, FLOP counting, attention
visualisation. The CLIs in ``tools/`` are thin wrappers around these modules."""
from .catalogue import BackboneSpec, backbone_catalogue, format_catalogue, get_backbone_spec

__all__ = ['BackboneSpec', 'backbone_catalogue', 'format_catalogue', 'get_backbone_spec']
