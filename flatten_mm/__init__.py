"""flatten_mm: efficient-attention backbones (FLatten, SimA, QuadTree) for OpenMMLab."""
import torch

from .version import MIN_TORCH, __version__


def _torch_version(text: str) -> tuple:
    """``(major, minor)`` of a torch version string (``'2.14.1+cu130'`` -> ``(2, 14)``)."""
    parts = text.split('+')[0].split('.')[:2]
    return tuple(int(''.join(c for c in p if c.isdigit()) or 0) for p in parts)


# flatten_mm uses torch.library.custom_op / triton_op and torch.compiler.is_exporting
# (torch 2.7): fail here, with both versions named, not later with an AttributeError
if _torch_version(torch.__version__) < MIN_TORCH:
    raise ImportError(
        f'flatten_mm {__version__} needs torch >= {".".join(map(str, MIN_TORCH))}; '
        f'found torch {torch.__version__}. Upgrade torch (and rebuild mmcv against it: '
        'bash scripts/setup_env.sh does both).')

__all__ = ['__version__']
