"""flatten_mm.AlignResize: keep-ratio resize, then stretch to multiples of the divisor."""
import math

import numpy as np
import pytest

pytest.importorskip('mmcv')
from flatten_mm.registry import TRANSFORMS  # noqa: E402


@pytest.mark.parametrize('hw', [(375, 500), (512, 683), (300, 400), (1024, 2048)])
def test_align_resize_shapes_and_scale_factor(hw):
    t = TRANSFORMS.build(dict(type='flatten_mm.AlignResize', scale=(2048, 512), keep_ratio=True))
    img = np.random.randint(0, 255, (*hw, 3), dtype=np.uint8)
    out = t(dict(img=img, gt_seg_map=np.zeros(hw, dtype=np.uint8), img_shape=hw, ori_shape=hw))
    h, w = out['img'].shape[:2]
    ratio = min(2048 / max(hw), 512 / min(hw))
    exp_h = math.ceil(int(hw[0] * ratio + 0.5) / 32) * 32
    exp_w = math.ceil(int(hw[1] * ratio + 0.5) / 32) * 32
    assert (h, w) == (exp_h, exp_w) == tuple(out['img_shape'])
    assert h % 32 == 0 and w % 32 == 0
    assert out['gt_seg_map'].shape == (h, w)
    sx, sy = out['scale_factor']
    assert abs(sx * hw[1] - w) < 1e-6 and abs(sy * hw[0] - h) < 1e-6


def test_align_resize_rejects_bad_divisor():
    with pytest.raises(ValueError, match='size_divisor'):
        TRANSFORMS.build(dict(type='flatten_mm.AlignResize', scale=(64, 64), size_divisor=0))
