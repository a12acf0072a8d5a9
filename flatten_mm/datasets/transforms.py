"""``AlignResize``: the test-time resize of the official QuadTree / PVT segmentation code.

mmseg 0.x forks (PVT, Twins, QuadTree) evaluate ADE20K with a keep-ratio resize to
(2048, 512) followed by a second resize that *stretches* the image to the next multiple
of 32 in each dimension (``AlignResize``). mmseg 1.x has no such transform; padding to a
multiple of 32 instead changes the input the model sees. This reproduces the two-step
resize; predictions are mapped back to the original size through ``scale_factor`` /
``img_shape`` as for any mmseg resize.
"""
import math
from typing import Optional

import mmcv
from mmcv.transforms import Resize

from ..registry import TRANSFORMS


@TRANSFORMS.register_module()
class AlignResize(Resize):
    """Resize like ``mmcv.transforms.Resize``, then stretch to multiples of ``size_divisor``.

    Args:
        size_divisor: the output height and width are the keep-ratio size rounded up to
            a multiple of this.
        **kwargs: arguments of ``mmcv.transforms.Resize`` (``scale``, ``keep_ratio``...).
    """

    def __init__(self, size_divisor: int = 32, **kwargs) -> None:
        super().__init__(**kwargs)
        if size_divisor < 1:
            raise ValueError(f'size_divisor must be >= 1, got {size_divisor}')
        self.size_divisor = size_divisor

    def _align(self, size: int) -> int:
        return int(math.ceil(size / self.size_divisor)) * self.size_divisor

    def transform(self, results: dict) -> Optional[dict]:
        results = super().transform(results)
        h, w = results['img'].shape[:2]
        ah, aw = self._align(h), self._align(w)
        if (ah, aw) == (h, w):
            return results
        results['img'] = mmcv.imresize(results['img'], (aw, ah), interpolation=self.interpolation,
                                       backend=self.backend)
        if results.get('gt_seg_map', None) is not None:
            results['gt_seg_map'] = mmcv.imresize(results['gt_seg_map'], (aw, ah),
                                                  interpolation='nearest', backend=self.backend)
        sx, sy = results['scale_factor']
        results['scale_factor'] = (sx * aw / w, sy * ah / h)
        results['img_shape'] = (ah, aw)
        return results

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(scale={self.scale}, scale_factor={self.scale_factor}, '
                f'keep_ratio={self.keep_ratio}, size_divisor={self.size_divisor})')
