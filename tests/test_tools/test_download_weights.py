"""tools/download_weights.py and the catalogue of official releases (flatten_mm.models.zoo):
download (file:// URLs only, never the network), resume, SHA-256 record and check,
conversion to the configs' paths, --from-file, --list; and the message a config gets
when its pretrained file is missing (variants without official weights say so)."""
import argparse
import dataclasses
import hashlib
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT
from official_layouts import to_official_pvt_keys, write_official

sys.path.insert(0, osp.join(REPO_ROOT, 'tools'))
import download_weights  # noqa: E402

from flatten_mm.models import zoo  # noqa: E402
from flatten_mm.models.catalogue import backbone_catalogue, get_backbone_spec  # noqa: E402


def official_imagenet_file(path, arch='b0'):
    """A QuadTree classification checkpoint in the official layout (``{'model', 'args',
    ...}`` with ``head.*``) from a randomly initialised backbone; returns the backbone."""
    model = get_backbone_spec(f'quadtree-b-pvt-v2-{arch}').build()
    sd = to_official_pvt_keys(model.state_dict())
    dim = model.state_dict()['stages.3.norm.weight'].shape[0]
    sd.update({'head.weight': torch.randn(1000, dim), 'head.bias': torch.randn(1000)})
    torch.save({'model': sd, 'epoch': 299, 'args': argparse.Namespace(model=f'quadtree_{arch}')},
               path)
    return model


@pytest.fixture
def file_url_zoo(tmp_path, monkeypatch):
    """The catalogue with quadtree-b-pvt-v2-b0's URL pointing at a local official file."""
    src = tmp_path / 'served' / 'b0.pth'
    src.parent.mkdir()
    model = official_imagenet_file(str(src))
    entries = tuple(dataclasses.replace(w, urls=(src.as_uri(), ))
                    if w.name == 'quadtree-b-pvt-v2-b0' else w for w in zoo.OFFICIAL_WEIGHTS)
    monkeypatch.setattr(zoo, 'OFFICIAL_WEIGHTS', entries)
    return src, model


def test_download_converts_to_the_configs_path_and_records_sha(file_url_zoo, tmp_path, capsys):
    src, model = file_url_zoo
    out_dir = tmp_path / 'ckpt'
    assert download_weights.main(['quadtree-b-pvt-v2-b0', '--dir', str(out_dir)]) == 0
    dst = out_dir / 'quadtree-b-pvt-v2-b0_in1k.pth'
    # loads through init_cfg Pretrained (checked loading) and holds the source weights
    from flatten_mm.models.pretrained import load_pretrained
    target = get_backbone_spec('quadtree-b-pvt-v2-b0').build()
    load_pretrained(target, dict(type='Pretrained', checkpoint=str(dst)))
    for k, v in model.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k
    # the raw file is kept and its sum recorded
    raw = out_dir / 'official' / 'quadtree-b-pvt-v2-b0.pth'
    assert raw.read_bytes() == src.read_bytes()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    sums = (out_dir / 'official' / 'SHA256SUMS.json').read_text()
    assert digest in sums
    err = capsys.readouterr().err
    assert 'recorded' in err and '100.0%' in err  # progress bar reached the end
    meta = torch.load(str(dst), weights_only=True)['meta']
    assert meta['sha256'] == digest and meta['source'] == src.as_uri()
    # a later run checks the recorded sum: a changed raw file is refused
    assert download_weights.main(['quadtree-b-pvt-v2-b0', '--dir', str(out_dir)]) == 0
    assert 'exists' in capsys.readouterr().out
    data = bytearray(raw.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    raw.write_bytes(bytes(data))
    dst.unlink()
    assert download_weights.main(['quadtree-b-pvt-v2-b0', '--dir', str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert re.search(r'SHA-256 [0-9a-f]{64} differs from the recorded', err)
    assert str(out_dir / 'official' / 'SHA256SUMS.json') in err and '--force' in err
    assert not dst.exists()
    # --force drops the changed file and its record: downloaded, converted, recorded again
    assert download_weights.main(['quadtree-b-pvt-v2-b0', '--dir', str(out_dir), '--force']) == 0
    assert raw.read_bytes() == src.read_bytes() and dst.exists()
    assert digest in (out_dir / 'official' / 'SHA256SUMS.json').read_text()


def test_published_sha_mismatch_is_refused(file_url_zoo, tmp_path, monkeypatch, capsys):
    entries = tuple(dataclasses.replace(w, sha256='0' * 64) if w.name == 'quadtree-b-pvt-v2-b0'
                    else w for w in zoo.OFFICIAL_WEIGHTS)
    monkeypatch.setattr(zoo, 'OFFICIAL_WEIGHTS', entries)
    assert download_weights.main(['quadtree-b-pvt-v2-b0', '--dir', str(tmp_path / 'c')]) == 2
    assert 'differs from the published' in capsys.readouterr().err


def test_interrupted_download_resumes(file_url_zoo, tmp_path, capsys):
    src, _ = file_url_zoo
    data = src.read_bytes()
    part = tmp_path / 'c' / 'official' / 'quadtree-b-pvt-v2-b0.pth.part'
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:len(data) // 2])
    assert download_weights.main(['quadtree-b-pvt-v2-b0', '--dir', str(tmp_path / 'c')]) == 0
    assert 'resuming at' in capsys.readouterr().err
    assert (part.parent / 'quadtree-b-pvt-v2-b0.pth').read_bytes() == data
    assert not part.exists()


def test_from_file_whole_model(tmp_path, capsys):
    """An official-layout RetinaNet file converted offline for its config."""
    pytest.importorskip('mmdet')
    from flatten_mm.apis.whole_model import build_config_model
    name = 'retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco'
    model = build_config_model(osp.join(REPO_ROOT, zoo.get_official_weights(name).config))
    src = tmp_path / 'b0.pth'
    write_official(model, 'retinanet', src)
    assert download_weights.main([name, '--from-file', str(src), '--dir', str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f'python tools/test.py configs/mmdet/quadtree_pvt_v2/{name}.py' in out
    ckpt = torch.load(str(tmp_path / f'{name}.pth'), weights_only=True)
    assert set(ckpt['state_dict']) == set(model.state_dict())
    assert all(torch.equal(ckpt['state_dict'][k], v) for k, v in model.state_dict().items())
    assert len(ckpt['meta']['dataset_meta']['classes']) == 80


def test_from_file_imagenet_classifier_target(tmp_path, capsys):
    """--target classifier: the official ImageNet file converts with its head to the
    classifier the variant's configs/mmpretrain config evaluates (offline, --from-file)."""
    pytest.importorskip('mmpretrain')
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint
    from mmpretrain.registry import MODELS
    src = tmp_path / 'b0.pth'
    official_imagenet_file(src)
    official = torch.load(src, weights_only=False)['model']
    name = 'quadtree-b-pvt-v2-b0'
    assert download_weights.main([name, '--target', 'classifier', '--from-file', str(src),
                                  '--dir', str(tmp_path)]) == 0
    dst = tmp_path / f'{name}_in1k-classifier.pth'
    config = zoo.pretraining_config(name)
    assert f'mim test mmpretrain {config} --checkpoint {dst}' in capsys.readouterr().out
    init_default_scope('mmpretrain')
    classifier = MODELS.build(Config.fromfile(osp.join(REPO_ROOT, config)).model)
    load_checkpoint(classifier, str(dst), strict=True)
    assert torch.equal(classifier.head.fc.weight, official['head.weight'])
    assert torch.equal(classifier.backbone.stages[0].patch_embed.proj.weight,
                       official['patch_embed1.proj.weight'])
    # the backbone target of the same file is untouched: another name in the same folder
    assert not (tmp_path / f'{name}_in1k.pth').exists()
    # whole models have no classifier
    assert download_weights.main(['retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco', '--target',
                                  'classifier', '--dir', str(tmp_path)]) == 2
    assert 'only ImageNet weights convert to a classifier' in capsys.readouterr().err


def test_unreleased_and_unknown_names(tmp_path, capsys):
    assert download_weights.main(['flatten-pvt-v2-b1', '--dir', str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert 'no official ImageNet weights were released for FLatten-PVTv2-b1' in err
    assert download_weights.main(['quadtree-b0', '--dir', str(tmp_path)]) == 2
    assert 'Did you mean' in capsys.readouterr().err
    assert download_weights.main(['not-there', '--dir', str(tmp_path)]) == 2
    assert not os.listdir(tmp_path)


def test_unreachable_url_names_the_manual_mirror(tmp_path, monkeypatch, capsys):
    entries = tuple(dataclasses.replace(w, urls=((tmp_path / 'absent.pth').as_uri(), ))
                    if w.name == 'quadtree-b-pvt-v2-b2' else w for w in zoo.OFFICIAL_WEIGHTS)
    monkeypatch.setattr(zoo, 'OFFICIAL_WEIGHTS', entries)
    assert download_weights.main(['quadtree-b-pvt-v2-b2', '--dir', str(tmp_path / 'c')]) == 2
    err = capsys.readouterr().err
    assert 'cannot download' in err and 'drive.google.com' in err and '--from-file' in err


def test_list_prints_the_catalogue():
    """A fresh process (what a user on a clean checkout runs)."""
    proc = subprocess.run([sys.executable, 'tools/download_weights.py', '--list'], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert len(zoo.OFFICIAL_WEIGHTS) == 27
    for w in zoo.OFFICIAL_WEIGHTS:
        assert w.name in rows, w.name
        for _, value in w.metrics:
            assert f'{value}' in rows[w.name], w.name
    assert 'ImageNet top-1 72.0' in rows['quadtree-b-pvt-v2-b0']
    assert 'COCO box AP 46.7, COCO mask AP 42.4' in \
        rows['mask-rcnn_quadtree-b-pvt-v2-b2_fpn_1x_coco']
    assert 'ADE20K mIoU 50.6' in rows['fpn_quadtree-b-pvt-v2-b4_8xb2-160k_ade20k-512x512']
    assert 'No official weights exist for: flatten-pvt-v2-b1' in proc.stdout


def test_catalogue_entries_are_consistent():
    names = set(backbone_catalogue())
    for w in zoo.OFFICIAL_WEIGHTS:
        assert w.urls and all(u.startswith('https://') for u in w.urls), w.name
        if w.is_whole_model:
            assert osp.isfile(osp.join(REPO_ROOT, w.config)), w.config
            assert w.target == f'checkpoints/{osp.splitext(osp.basename(w.config))[0]}.pth'
        else:
            assert w.name in names and w.target == f'checkpoints/{w.name}_in1k.pth'
            assert get_backbone_spec(w.name).arch == w.arch
    assert sum(w.kind == 'imagenet' for w in zoo.OFFICIAL_WEIGHTS) == 12
    assert sum(w.kind != 'imagenet' for w in zoo.OFFICIAL_WEIGHTS) == 15


def _config_checkpoints():
    """(pretrained checkpoint path, one config using it) for every distinct path under
    configs/ (read from the config files' text)."""
    found = {}
    for dirpath, _, files in os.walk(osp.join(REPO_ROOT, 'configs')):
        for fname in sorted(files):
            if fname.endswith('.py'):
                path = osp.join(dirpath, fname)
                for ckpt in re.findall(r"checkpoint='(checkpoints/[^']+)'", open(path).read()):
                    found.setdefault(ckpt, osp.relpath(path, REPO_ROOT))
    return sorted(found.items())


@pytest.mark.parametrize('ckpt,config', _config_checkpoints())
def test_missing_pretrained_file_says_what_exists(ckpt, config, tmp_path, monkeypatch):
    """Every pretrained path of the shipped configs, absent: a variant without official
    weights says so and names the two ways on; a released one names the download command."""
    from mmengine.config import Config
    from flatten_mm.registry import MODELS
    import flatten_mm.models  # noqa: F401
    cfg = Config.fromfile(osp.join(REPO_ROOT, config))
    backbone_cfg = cfg.model.backbone
    monkeypatch.chdir(tmp_path)  # checkpoints/ does not exist here
    backbone = MODELS.build(backbone_cfg)
    with pytest.raises(FileNotFoundError) as info:
        backbone.init_weights()
    msg = str(info.value)
    name = re.fullmatch(r'checkpoints/(.+)_in1k\.pth', ckpt).group(1)
    assert f'pretrained checkpoint {ckpt} not found' in msg
    if name in zoo.imagenet_names():  # (the shipped configs load these as flatten_mm://)
        assert f"checkpoint='flatten_mm://{name}'" in msg
    else:
        assert f'no official ImageNet weights were released for {zoo.display_name(name)}' in msg
        assert f'python tools/convert_checkpoint.py SRC {ckpt}' in msg
        assert '--cfg-options model.backbone.init_cfg=None' in msg


def test_missing_file_of_a_custom_name_is_identified_by_the_backbone(tmp_path):
    from flatten_mm.models.pretrained import load_pretrained
    model = get_backbone_spec('sima-xcit-s12-p8').build()
    with pytest.raises(FileNotFoundError, match=r'mine\.pth not found: no official ImageNet '
                       r'weights were released for SimA-XCiT-s12-p8'):
        load_pretrained(model, dict(type='Pretrained', checkpoint=str(tmp_path / 'mine.pth')))
