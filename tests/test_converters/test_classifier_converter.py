"""The classification target: official ImageNet classifiers -> the mmpretrain classifier.

Every official model listed in ``../shared/spec/state_dict_keys`` (key, shape, dtype of the
official classifier, head included) converts to exactly the keys and shapes of the
classifier ``flatten_mm.models.classification`` builds for the same catalogue variant;
the values behind the keys are checked by the parity fixtures (``test_parity.py``
compares the converted classifiers' logits with the official code's).
"""
import os.path as osp
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, load_key_listing

pytest.importorskip('mmpretrain')

from flatten_mm.checkpoints.convert import (ConversionError,  # noqa: E402
                                            convert_classifier_checkpoint)
from flatten_mm.checkpoints.converters import convert_classifier  # noqa: E402
from flatten_mm.models.classification import classifier_state_dict  # noqa: E402

_SIMA = {'nano': 'n', 'tiny': 't', 'small': 's', 'medium': 'm', 'large': 'l'}
#: official model (key listing) -> (converter family, our arch)
LISTINGS = {
    **{f'flatten_pvt_{n}': ('flatten_pvt', a) for n, a in
       (('tiny', 't'), ('small', 's'), ('medium', 'm'), ('large', 'b'))},
    **{f'flatten_pvt_v2_b{i}': ('flatten_pvt_v2', f'b{i}') for i in range(5)},
    'flatten_swin_T_224': ('flatten_swin', 't'), 'flatten_swin_S_224': ('flatten_swin', 's'),
    'flatten_swin_B_224': ('flatten_swin', 'b'), 'flatten_swin_B_384': ('flatten_swin', 'b-384'),
    'FLatten_CSWin_64_24181_tiny_224': ('flatten_cswin', 't'),
    'FLatten_CSWin_64_24322_small_224': ('flatten_cswin', 's'),
    'FLatten_CSWin_96_36292_base_224': ('flatten_cswin', 'b'),
    'FLatten_CSWin_96_36292_base_384': ('flatten_cswin', 'b-384'),
    **{f'quadtree_b{i}': ('quadtree', f'b{i}') for i in range(5)},
    'quadtreeA_b0': ('quadtree', 'a-b0'),
    **{f'sima_{size}_{depth}_p{p}': ('sima_xcit', f'{_SIMA[size]}{depth}-p{p}')
       for size, depth in (('nano', 12), ('tiny', 12), ('small', 12), ('tiny', 24),
                           ('small', 24), ('medium', 24), ('large', 24)) for p in (16, 8)},
}


def test_the_table_covers_every_official_listing():
    import glob
    listings = glob.glob(osp.join(REPO_ROOT, '..', 'shared', 'spec', 'state_dict_keys', '*.txt'))
    if not listings:
        pytest.skip('../shared/spec/state_dict_keys not found (../shared absent)')
    assert {osp.basename(p)[:-4] for p in listings} == set(LISTINGS)


@pytest.mark.parametrize('listing', sorted(LISTINGS))
def test_official_classifier_converts_to_the_mmpretrain_classifier(listing):
    family, arch = LISTINGS[listing]
    official = load_key_listing(listing)
    # what tools/convert_checkpoint.py --target classifier --arch checks: every key and
    # shape of the classifier built for the variant, nothing else
    converted, dropped, detected = convert_classifier_checkpoint(
        {'model': official}, arch=arch, expected=classifier_state_dict)
    assert detected == family
    assert converted['head.fc.weight'].shape == official['head.weight'].shape
    assert all(k.startswith(('backbone.', 'neck.', 'head.')) for k in converted)
    # nothing the official classifier computes with is dropped: only run-time buffers and
    # FLatten-PVT v1's never-applied final norm
    for key in dropped:
        assert key.endswith(('relative_position_index', 'attn_mask')) or \
            (family == 'flatten_pvt' and key.startswith('norm.')), key
    assert len(converted) + len(dropped) == len(official)


def test_a_backbone_file_is_not_a_classifier():
    official = load_key_listing('flatten_pvt_v2_b0')
    backbone = {k: v for k, v in official.items() if not k.startswith('head.')}
    with pytest.raises(ValueError, match='no classification head'):
        convert_classifier(backbone, 'flatten_pvt_v2')
    with pytest.raises(ConversionError, match='no classification head'):
        convert_classifier_checkpoint({'model': backbone})


def test_another_variant_is_refused_with_the_mismatch():
    official = load_key_listing('flatten_pvt_v2_b1')
    with pytest.raises(ConversionError, match=r"arch='b2' classifier") as err:
        convert_classifier_checkpoint({'model': official}, arch='b2',
                                      expected=classifier_state_dict)
    assert 'missing keys' in str(err.value)


def test_convert_tool_writes_the_classifier_that_mmpretrain_loads(tmp_path):
    """tools/convert_checkpoint.py --target classifier: the file loads strictly into the
    classifier of the variant's configs/mmpretrain config and gives its logits."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint
    from mmpretrain.registry import MODELS

    official = {k: torch.randn(v.shape) if v.is_floating_point() else v
                for k, v in load_key_listing('flatten_pvt_v2_b0').items()}
    src, dst = tmp_path / 'official.pth', tmp_path / 'classifier.pth'
    torch.save({'model': official}, src)
    run = subprocess.run([sys.executable, osp.join(REPO_ROOT, 'tools', 'convert_checkpoint.py'),
                          str(src), str(dst), '--target', 'classifier', '--arch', 'b0'],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert '(flatten_pvt_v2, classifier)' in run.stdout
    cfg = Config.fromfile(osp.join(REPO_ROOT, 'configs', 'mmpretrain', 'flatten_pvt_v2',
                                   'flatten-pvt-v2-b0_8xb128_in1k.py'))
    init_default_scope('mmpretrain')
    model = MODELS.build(cfg.model).eval()
    load_checkpoint(model, str(dst), strict=True)
    torch.testing.assert_close(model.head.fc.weight, official['head.weight'])
    torch.testing.assert_close(model.backbone.stages[3].norm.weight, official['norm4.weight'])
