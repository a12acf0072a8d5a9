"""Official QuadTree key layouts (classification and detection/segmentation checkpoints)
convert to exactly the keys and shapes of ``QuadTreePVTv2``."""
import pytest
import torch

from flatten_mm.checkpoints.converters import CONVERTERS, guess_family
from flatten_mm.models import QuadTreePVTv2
from flatten_mm.checkpoints.convert import ConversionError, convert_checkpoint

CASES = [('quadtree_b0', 'b0'), ('quadtree_b1', 'b1'), ('quadtree_b2', 'b2'),
         ('quadtree_b3', 'b3'), ('quadtree_b4', 'b4'), ('quadtreeA_b0', 'a-b0')]


@pytest.mark.parametrize('listing,arch', CASES)
def test_key_coverage(official_listing, listing, arch):
    official = official_listing(listing)
    assert guess_family(official) == ['quadtree']
    converted, dropped = CONVERTERS['quadtree'](official)
    expected = QuadTreePVTv2(arch=arch).state_dict()
    assert set(converted) == set(expected)
    for k, v in expected.items():
        assert converted[k].shape == v.shape, k
    assert dropped and all(k.startswith('head.') for k in dropped)
    again, dropped_again = CONVERTERS['quadtree'](converted)  # idempotent
    assert set(again) == set(converted) and not dropped_again


def test_detection_checkpoint_keeps_only_the_backbone(official_listing):
    """mmdet/mmseg checkpoints: ``backbone.`` + the classification keys without ``head``."""
    official = {k: v for k, v in official_listing('quadtree_b1').items()
                if not k.startswith('head.')}
    ckpt = {'meta': {}, 'state_dict': {
        **{f'backbone.{k}': v for k, v in official.items()},
        'neck.lateral_convs.0.conv.weight': torch.zeros(256, 64, 1, 1),
        'bbox_head.retina_cls.weight': torch.zeros(720, 256, 3, 3)}}
    sd, dropped, family = convert_checkpoint(ckpt, arch='b1')
    assert family == 'quadtree' and not dropped
    assert set(sd) == set(QuadTreePVTv2(arch='b1').state_dict())


def test_a_checkpoint_does_not_fit_a_b_model(official_listing):
    with pytest.raises(ConversionError, match=r"arch='b0'.*\n.*missing keys.*value_branchs"):
        convert_checkpoint({'model': official_listing('quadtreeA_b0')}, arch='b0')
