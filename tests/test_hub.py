"""Official weights the OpenMMLab way: the ``flatten_mm://`` checkpoint scheme
(``flatten_mm.models.hub``) and official files loaded as they are.

Official files are written by the tests in the official key layouts (the key listings of
``../shared/spec/state_dict_keys`` with random values, classification head included;
mmdet 2.x whole models from ``official_layouts.write_official``) and served from
``file://`` URLs: never the network. Every way in must give the weights of today's
convert-then-load (``tools/convert_checkpoint.py``, then ``init_cfg`` / ``load_from``).
"""
import argparse
import dataclasses
import importlib.util
import os
import os.path as osp
import shutil

import pytest
import torch

from conftest import REPO_ROOT, load_key_listing
from official_layouts import write_official

from flatten_mm.checkpoints.download import DownloadError
from flatten_mm.models import hub, zoo
from flatten_mm.registry import MODELS

NAME = 'flatten-pvt-v2-b0'


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, osp.join(REPO_ROOT, 'tools', f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(monkeypatch, name, url):
    """The zoo entry ``name`` downloading from ``url``."""
    entries = tuple(dataclasses.replace(w, urls=(url, )) if w.name == name else w
                    for w in zoo.OFFICIAL_WEIGHTS)
    monkeypatch.setattr(zoo, 'OFFICIAL_WEIGHTS', entries)


@pytest.fixture
def official_b0(tmp_path, monkeypatch):
    """An official FLatten-PVTv2-b0 ImageNet file (``{'model', 'args'}``), served from a
    ``file://`` URL; ``$FLATTEN_MM_HOME`` is a fresh folder. Returns the file."""
    listing = load_key_listing('flatten_pvt_v2_b0')  # skips when ../shared is absent
    gen = torch.Generator().manual_seed(7)
    official = {k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                for k, v in listing.items()}
    src = tmp_path / 'served' / 'flatten_pvt_v2_b0.pth'
    src.parent.mkdir()
    torch.save({'model': official, 'args': argparse.Namespace(model='flatten_pvt_v2_b0')}, src)
    serve(monkeypatch, NAME, src.as_uri())
    monkeypatch.setenv(hub.HOME_ENV, str(tmp_path / 'home'))
    return src


def init_from(checkpoint):
    model = MODELS.build(dict(type='flatten_mm.FLattenPVTv2', arch='b0',
                              init_cfg=dict(type='Pretrained', checkpoint=checkpoint)))
    model.init_weights()
    return model.state_dict()


def assert_same(a, b):
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


def spec_layout(official):
    """Official FLatten-PVTv2 keys in our classifier's layout, by the mapping of
    ``shared/spec/state_dicts.md`` written out here (not the converter's rules):
    ``patch_embed{i}`` / ``block{i}.{j}`` / ``norm{i}`` -> ``backbone.stages.{i-1}.*``, the
    MLP's ``mlp.dwconv.dwconv`` -> ``mlp.dwconv``, ``head.*`` -> ``head.fc.*``."""
    out = {}
    for key, value in official.items():
        first, rest = key.split('.', 1)
        if first == 'head':
            out[f'head.fc.{rest}'] = value
            continue
        stem = first.rstrip('0123456789')
        stage = int(first[len(stem):]) - 1
        if stem == 'block':
            block, rest = rest.split('.', 1)
            rest = rest.replace('mlp.dwconv.dwconv.', 'mlp.dwconv.')
            out[f'backbone.stages.{stage}.blocks.{block}.{rest}'] = value
        else:  # patch_embed{i}, norm{i}
            out[f'backbone.stages.{stage}.{stem}.{rest}'] = value
    return out


def spec_backbone(path):
    """The backbone weights the official file ``path`` must give (``spec_layout``)."""
    official = torch.load(path, weights_only=False)['model']
    return {k[len('backbone.'):]: v for k, v in spec_layout(official).items()
            if k.startswith('backbone.')}


@pytest.fixture
def logged(monkeypatch):
    """Messages of ``print_log`` in the loading code."""
    import flatten_mm.checkpoints.official as official
    import flatten_mm.models.pretrained as pretrained
    lines = []
    for module in (pretrained, official):
        monkeypatch.setattr(module, 'print_log', lambda msg, **kw: lines.append(str(msg)))
    return lines


def test_scheme_and_official_file_load_what_convert_then_load_gives(official_b0, tmp_path,
                                                                    logged):
    converted = str(tmp_path / 'converted.pth')
    assert _tool('convert_checkpoint').main([str(official_b0), converted, '--arch', 'b0']) == 0
    expected = init_from(converted)
    assert not any('converted in memory' in line for line in logged)
    assert_same(expected, spec_backbone(official_b0))  # (independent of the converter)

    assert_same(init_from(f'flatten_mm://{NAME}'), expected)
    home = tmp_path / 'home'
    assert (home / 'official' / f'{NAME}.pth').read_bytes() == official_b0.read_bytes()
    assert (home / f'{NAME}_in1k.pth').is_file()
    # the official file as it is (local path): converted in memory, said once in the log
    official = tmp_path / 'as_downloaded.pth'
    shutil.copy(official_b0, official)
    # a second use reads the cache (the official file and its URL are not needed)
    os.remove(official_b0)
    os.remove(home / 'official' / f'{NAME}.pth')
    assert_same(init_from(f'flatten_mm://{NAME}'), expected)
    logged.clear()
    assert_same(init_from(str(official)), expected)
    assert [line for line in logged if 'converted in memory' in line] == [
        f'FLattenPVTv2: {official} holds official flatten_pvt_v2 weights; converted in '
        'memory to the layout of this backbone']


def test_offline_the_file_put_by_hand_is_picked_up(official_b0, tmp_path, monkeypatch):
    url = (tmp_path / 'nowhere' / 'b0.pth').as_uri()  # no network: the URL cannot be read
    serve(monkeypatch, NAME, url)
    picked = tmp_path / 'home' / 'official' / f'{NAME}.pth'
    with pytest.raises(DownloadError) as err:
        init_from(f'flatten_mm://{NAME}')
    assert url in str(err.value) and str(picked) in str(err.value)
    picked.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(official_b0, picked)
    got = init_from(f'flatten_mm://{NAME}')
    converted = str(tmp_path / 'converted.pth')
    assert _tool('convert_checkpoint').main([str(official_b0), converted, '--arch', 'b0']) == 0
    assert_same(got, init_from(converted))


def test_classifier_target_by_name(official_b0, tmp_path):
    """``flatten_mm://<name>/classifier``: the official ImageNet file with its head as the
    mmpretrain classifier of the variant's configs/mmpretrain config (``load_from``)."""
    pytest.importorskip('mmpretrain')
    from mmengine.config import Config
    from mmengine.runner import load_checkpoint

    from flatten_mm.models.classification import build_classifier
    official = torch.load(official_b0, weights_only=False)['model']
    cfg = Config.fromfile(osp.join(REPO_ROOT, zoo.pretraining_config(NAME)))
    classifier = build_classifier(cfg.model)
    load_checkpoint(classifier, f'flatten_mm://{NAME}/classifier', strict=True)
    # the expectation comes from the official tensors and the spec's key mapping, not
    # from the converter the scheme runs
    assert_same(classifier.state_dict(), spec_layout(official))
    assert osp.isfile(osp.join(hub.home(), f'{NAME}_in1k-classifier.pth'))
    assert not osp.exists(osp.join(hub.home(), f'{NAME}_in1k.pth'))  # the other target
    with pytest.raises(ValueError, match='unknown target'):
        hub.parse_uri(f'flatten_mm://{NAME}/neck')


def test_scheme_names_without_official_weights(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.HOME_ENV, str(tmp_path))
    with pytest.raises(ValueError, match='no official ImageNet weights were released for '
                       'FLatten-PVTv2-b1'):
        init_from('flatten_mm://flatten-pvt-v2-b1')
    with pytest.raises(ValueError, match='Did you mean'):
        init_from('flatten_mm://flatten-pvt-v2-bo')
    assert not os.listdir(tmp_path)


def test_home_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.HOME_ENV, str(tmp_path / 'mine'))
    assert hub.home() == str(tmp_path / 'mine')
    monkeypatch.delenv(hub.HOME_ENV)
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))
    assert hub.home() == osp.join(str(tmp_path / 'torch'), 'hub', 'flatten_mm')


def test_official_file_of_another_family_is_still_refused(tmp_path):
    listing = load_key_listing('flatten_swin_T_224')
    path = tmp_path / 'swin.pth'
    torch.save({'model': listing}, path)
    with pytest.raises(ValueError) as err:
        init_from(str(path))
    msg = str(err.value)
    assert 'does not fit FLattenPVTv2' in msg
    assert 'official flatten_swin checkpoint that was not converted' in msg


def test_official_file_of_another_variant_is_still_refused(tmp_path):
    path = tmp_path / 'b1.pth'
    torch.save({'model': load_key_listing('flatten_pvt_v2_b1')}, path)
    with pytest.raises(ValueError, match=r'does not fit FLattenPVTv2 .*other shapes '
                       r'\(another variant\?\)'):
        init_from(str(path))


def test_missing_local_file_of_a_released_variant_names_the_scheme(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        init_from(str(tmp_path / f'{NAME}_in1k.pth'))
    assert f"checkpoint='flatten_mm://{NAME}'" in str(err.value)


@pytest.fixture(scope='module')
def retinanet():
    """The RetinaNet QuadTree-B-b0 config's model (random weights) and its name."""
    pytest.importorskip('mmdet')
    from flatten_mm.apis.whole_model import build_config_model
    name = 'retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco'
    torch.manual_seed(3)
    return build_config_model(osp.join(REPO_ROOT, zoo.get_official_weights(name).config)), name


def test_official_whole_model_loads_as_it_is_and_by_name(retinanet, tmp_path, monkeypatch,
                                                         logged):
    from mmengine.runner.checkpoint import CheckpointLoader
    model, name = retinanet
    src = tmp_path / 'b0.pth'
    write_official(model, 'retinanet', src)
    expected = model.state_dict()
    # load_from / tools/test.py CHECKPOINT with the official file
    ckpt = CheckpointLoader.load_checkpoint(str(src), map_location='cpu')
    assert_same(ckpt['state_dict'], expected)
    assert len(ckpt['meta']['dataset_meta']['classes']) == 80
    assert [line for line in logged if 'whole-model' in line] == [
        f'{src} is an official quadtree whole-model checkpoint (mmdet 2.x / mmseg 0.x '
        'layout): converted in memory to the layout of this release']
    # the same by name, through the cache
    serve(monkeypatch, name, src.as_uri())
    monkeypatch.setenv(hub.HOME_ENV, str(tmp_path / 'home'))
    logged.clear()
    ckpt = CheckpointLoader.load_checkpoint(f'flatten_mm://{name}', map_location='cpu')
    assert_same(ckpt['state_dict'], expected)
    assert ckpt['meta']['name'] == name and len(ckpt['meta']['dataset_meta']['classes']) == 80
    assert not logged  # the cached file is already converted
    # a checkpoint of this release is handed over untouched
    ours = tmp_path / 'ours.pth'
    torch.save(dict(state_dict=expected, meta={}), ours)
    assert_same(CheckpointLoader.load_checkpoint(str(ours))['state_dict'], expected)
    assert not logged
