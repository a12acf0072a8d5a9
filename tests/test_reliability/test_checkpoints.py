"""Checkpoints from elsewhere: wrong family / variant, unconverted, truncated, corrupt,
malicious; and tools that never overwrite a user's file silently.

Three read paths are covered: ``tools/convert_checkpoint.py`` (foreign files,
``load_foreign_checkpoint``), a backbone's ``init_cfg=dict(type='Pretrained')``
(``flatten_mm.models.pretrained``) and the runner's ``resume`` / ``load_from``
(mmengine's loader, replaced by ``flatten_mm.compat``).
"""
import argparse
import os
import os.path as osp
import pathlib
import pickle
import sys

import pytest
import torch

from backbone_specs import build, build_variant, registered_backbones
from reliability_report import describe, record

from conftest import KEY_LISTINGS_DIR, REPO_ROOT, load_key_listing

from flatten_mm.checkpoints import CheckpointError, load_foreign_checkpoint
from flatten_mm.compat import load_local_checkpoint

NAMES = registered_backbones()
sys.path.insert(0, osp.join(REPO_ROOT, 'tools'))


def init_from(name: str, path: str, **cfg):
    """A fresh tiny ``name`` initialised from ``path`` through its init_cfg."""
    model = build(name, init_cfg=dict(type='Pretrained', checkpoint=path, **cfg))
    model.init_weights()
    return model


def other_family(name: str) -> str:
    return 'FLattenSwin' if name != 'FLattenSwin' else 'SimAXCiT'


@pytest.mark.parametrize('name', NAMES)
def test_matching_checkpoint_loads_exactly(name, tmp_path):
    src = build(name)
    path = str(tmp_path / 'ok.pth')
    torch.save({'state_dict': src.state_dict(), 'meta': {}}, path)
    model = init_from(name, path)
    for key, value in src.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    # a detector / segmentor checkpoint: the backbone is selected with prefix='backbone.'
    full = {f'backbone.{k}': v for k, v in src.state_dict().items()}
    full['neck.conv.weight'] = torch.zeros(1)
    torch.save({'state_dict': full}, path)
    model = init_from(name, path, prefix='backbone.')
    for key, value in src.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.parametrize('name', NAMES)
def test_checkpoint_of_another_family_is_refused(name, tmp_path):
    other = other_family(name)
    path = str(tmp_path / f'{other}.pth')
    torch.save({'state_dict': build(other).state_dict()}, path)
    with pytest.raises(ValueError) as err:
        init_from(name, path)
    msg = str(err.value)
    assert f'does not fit {name}' in msg
    assert f'looks like a flatten_mm {other} checkpoint' in msg
    assert 'missing keys' in msg and 'unexpected keys' in msg
    record('wrong_family', name, f'init_cfg Pretrained with a {other} checkpoint',
           describe(err.value, {str(tmp_path): '<tmp>'}),
           title='Checkpoint of another family (init_cfg)')


@pytest.mark.parametrize('name', NAMES)
def test_checkpoint_of_another_variant_is_refused(name, tmp_path):
    path = str(tmp_path / 'variant.pth')
    torch.save({'state_dict': build_variant(name).state_dict()}, path)
    with pytest.raises(ValueError) as err:
        init_from(name, path)
    msg = str(err.value)
    assert 'other shapes (another variant?)' in msg and 'shape mismatches' in msg
    assert f'looks like a flatten_mm {name} checkpoint' in msg
    record('wrong_variant', name, 'init_cfg Pretrained with a checkpoint of another variant',
           describe(err.value, {str(tmp_path): '<tmp>'}),
           title='Checkpoint of another variant (init_cfg)')


def test_partial_load_is_an_explicit_choice(tmp_path):
    """An FLA checkpoint into a hybrid (softmax stages 3-4): refused by default, loaded
    (shared parameters only) with ``strict=False``."""
    path = str(tmp_path / 'fla.pth')
    src = build('FLattenPVTv2')
    torch.save({'state_dict': src.state_dict()}, path)
    hybrid = dict(attn_cfg=[dict(), dict(), dict(type='SpatialReductionAttention', sr_ratio=2),
                            dict(type='SpatialReductionAttention', sr_ratio=1)])
    cfg = dict(type='Pretrained', checkpoint=path)
    with pytest.raises(ValueError, match='strict=False') as err:
        build('FLattenPVTv2', init_cfg=cfg, **hybrid).init_weights()
    record('partial', 'FLattenPVTv2', 'FLA checkpoint into a hybrid (softmax stages 3-4), '
           'default init_cfg', describe(err.value, {str(tmp_path): '<tmp>'}),
           title='Partial match (hybrid): refused unless init_cfg has strict=False')
    model = build('FLattenPVTv2', init_cfg=dict(cfg, strict=False), **hybrid)
    model.init_weights()
    for key in ('stages.0.blocks.0.attn.q.weight', 'stages.3.blocks.0.mlp.fc1.weight'):
        torch.testing.assert_close(model.state_dict()[key], src.state_dict()[key], rtol=0, atol=0)
    # a file sharing nothing is refused even then
    torch.save({'state_dict': build('FLattenSwin').state_dict()}, path)
    with pytest.raises(ValueError, match='does not fit'):
        build('SimAXCiT', init_cfg=dict(cfg, strict=False)).init_weights()


#: one official key listing per converter family (../shared/spec/state_dict_keys)
OFFICIAL = {
    'flatten_pvt_v2': 'flatten_pvt_v2_b0', 'flatten_pvt': 'flatten_pvt_tiny',
    'flatten_swin': 'flatten_swin_T_224', 'flatten_cswin': 'FLatten_CSWin_64_24181_tiny_224',
    'quadtree': 'quadtree_b0', 'sima_xcit': 'sima_nano_12_p16',
}


def official_keys_only(listing: str) -> dict:
    """The keys of an official checkpoint (tiny tensors: enough for family detection)."""
    path = osp.join(KEY_LISTINGS_DIR, f'{listing}.txt')
    if not osp.isfile(path):
        pytest.skip(f'official key listing {path} not found (../shared absent)')
    with open(path) as f:
        return {line.split('\t')[0]: torch.zeros(1) for line in f
                if line.strip() and not line.startswith('#')}


def test_official_family_table_covers_every_converter():
    from flatten_mm.checkpoints.converters import CONVERTERS
    assert set(OFFICIAL) == set(CONVERTERS), 'add an official key listing for the new family'


@pytest.mark.parametrize('family', sorted(OFFICIAL))
def test_official_checkpoint_of_another_family_is_refused(family, tmp_path):
    """(An official file of the backbone's own family is converted in memory:
    tests/test_hub.py.)"""
    from flatten_mm.checkpoints.converters import BACKBONES
    name = other_family(BACKBONES[family])
    path = str(tmp_path / 'official.pth')
    torch.save({'model': official_keys_only(OFFICIAL[family]),
                'args': argparse.Namespace(model=family)}, path)
    with pytest.raises(ValueError) as err:
        init_from(name, path)
    msg = str(err.value)
    assert f'official {family}' in msg and 'convert it first' in msg
    assert f'--family {family}' in msg
    record('unconverted', name, f'init_cfg Pretrained with an official {family} file',
           describe(err.value, {str(tmp_path): '<tmp>'}).split('\n')[0] + '\n  ...',
           title='Official checkpoint of another family (init_cfg; first line)')


def test_converter_names_the_family_a_checkpoint_looks_like(tmp_path, capsys):
    import convert_checkpoint
    from flatten_mm.checkpoints.convert import ConversionError, convert_checkpoint as convert
    official = load_key_listing('sima_nano_12_p16')
    with pytest.raises(ConversionError) as err:
        convert({'model': official}, family='flatten_pvt_v2', arch='b0')
    msg = str(err.value)
    assert "looks like ['sima_xcit']" in msg
    assert 'missing keys' in msg and 'unexpected keys' in msg
    record('convert_family', 'FLattenPVTv2', 'convert a SimA checkpoint with '
           '--family flatten_pvt_v2 --arch b0', describe(err.value),
           title='tools/convert_checkpoint.py: checkpoint of another family')
    # wrong variant of the right family: shapes differ
    b1 = load_key_listing('flatten_pvt_v2_b1')
    with pytest.raises(ConversionError, match='shape mismatches') as err:
        convert({'model': b1}, family='flatten_pvt_v2', arch='b0')
    record('convert_variant', 'FLattenPVTv2', 'convert a FLatten-PVTv2-b1 checkpoint with '
           '--arch b0', describe(err.value),
           title='tools/convert_checkpoint.py: checkpoint of another variant')
    # the CLI reports it and writes nothing
    src, dst = str(tmp_path / 'sima.pth'), str(tmp_path / 'out.pth')
    torch.save({'model': official}, src)
    assert convert_checkpoint.main([src, dst, '--family', 'flatten_pvt_v2', '--arch', 'b0']) == 2
    assert 'error: checkpoint does not match' in capsys.readouterr().err
    assert not osp.exists(dst)


# ----------------------------------------------------------------------------- bad files
def make_bad_file(kind: str, tmp_path) -> str:
    good = str(tmp_path / 'good.pth')
    torch.save({'state_dict': build('FLattenPVTv2').state_dict()}, good)
    data = open(good, 'rb').read()
    path = str(tmp_path / f'{kind}.pth')
    with open(path, 'wb') as f:
        if kind == 'truncated':
            f.write(data[:len(data) // 2])
        elif kind == 'corrupt':
            gen = torch.Generator().manual_seed(0)
            f.write(bytes(torch.randint(0, 256, (4096, ), generator=gen, dtype=torch.uint8).tolist()))
        elif kind == 'empty':
            pass
    return path


@pytest.mark.parametrize('kind', ['truncated', 'corrupt', 'empty'])
def test_unreadable_file_gives_a_clear_error_on_every_path(kind, tmp_path):
    import convert_checkpoint
    path = make_bad_file(kind, tmp_path)
    short = {str(tmp_path): '<tmp>'}
    # 1. converter
    with pytest.raises(CheckpointError, match=r'(corrupt or truncated|empty)') as err:
        load_foreign_checkpoint(path)
    assert path in str(err.value)
    record(f'file_{kind}', 'convert_checkpoint', f'{kind} file', describe(err.value, short),
           title=f'{kind.capitalize()} checkpoint file')
    assert convert_checkpoint.main([path, str(tmp_path / 'out.pth')]) == 2
    # 2. init_cfg Pretrained
    with pytest.raises(CheckpointError, match='truncated or corrupt') as err:
        init_from('FLattenPVTv2', path)
    assert path in str(err.value)
    record(f'file_{kind}', 'init_cfg', f'{kind} file', describe(err.value, short))
    # 3. runner resume / load_from (mmengine's CheckpointLoader -> our local loader)
    from mmengine.runner.checkpoint import CheckpointLoader
    with pytest.raises(RuntimeError, match='not a readable PyTorch checkpoint') as err:
        CheckpointLoader.load_checkpoint(path, map_location='cpu')
    assert path in str(err.value)
    record(f'file_{kind}', 'runner resume/load_from', f'{kind} file', describe(err.value, short))


# ----------------------------------------------------------------------------- security
class Payload:
    """Unpickling this calls ``Path.touch(marker)``: a stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker), )


def test_pickled_code_is_never_run_without_an_explicit_trust_flag(tmp_path, monkeypatch):
    marker = tmp_path / 'code_ran'
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': build('FLattenPVTv2').state_dict(), 'payload': Payload(str(marker))},
               path)
    short = {str(tmp_path): '<tmp>'}
    monkeypatch.delenv('FLATTEN_MM_TRUST_CHECKPOINTS', raising=False)
    with pytest.raises(CheckpointError, match='--trust-checkpoint') as err:
        load_foreign_checkpoint(path)
    assert 'pathlib' in str(err.value) or 'touch' in str(err.value) or 'GLOBAL' in str(err.value)
    record('pickle', 'convert_checkpoint', 'checkpoint pickling a callable (code execution)',
           describe(err.value, short), title='Checkpoint with pickled code')
    with pytest.raises(pickle.UnpicklingError, match='FLATTEN_MM_TRUST_CHECKPOINTS') as err:
        load_local_checkpoint(path)
    record('pickle', 'runner resume/load_from', 'checkpoint pickling a callable',
           describe(err.value, short))
    with pytest.raises(CheckpointError) as err:
        init_from('FLattenPVTv2', path)
    record('pickle', 'init_cfg', 'checkpoint pickling a callable', describe(err.value, short))
    assert not marker.exists(), 'pickled code ran during a safe load'
    # the explicit opt-ins do unpickle (so the payload above is real)
    load_foreign_checkpoint(path, trust=True)
    assert marker.exists()
    marker.unlink()
    monkeypatch.setenv('FLATTEN_MM_TRUST_CHECKPOINTS', '1')
    load_local_checkpoint(path)
    assert marker.exists()


def test_official_pickled_configs_are_allow_listed(tmp_path):
    """FLatten pickles a yacs CfgNode, SimA / QuadTree an argparse.Namespace: both load
    with weights_only=True and no trust flag, through the converter and through
    mmengine's loader (the CfgNode comes back as an OrderedDict of its contents)."""
    from collections import OrderedDict
    yacs = pytest.importorskip('yacs.config')
    state = build('FLattenPVTv2').state_dict()
    cases = [(argparse.Namespace(lr=1e-3, model='x'), argparse.Namespace),
             (yacs.CfgNode({'MODEL': {'TYPE': 'flatten_pvt_v2', 'DEPTHS': [2, 2]}}), OrderedDict)]
    for obj, loaded_type in cases:
        path = str(tmp_path / f'{type(obj).__name__}.pth')
        torch.save({'model': state, 'config': obj, 'epoch': 3}, path)
        for ckpt in (load_foreign_checkpoint(path), load_local_checkpoint(path)):
            assert type(ckpt['config']) is loaded_type
            if loaded_type is OrderedDict:
                assert ckpt['config']['MODEL']['TYPE'] == 'flatten_pvt_v2'
            assert set(ckpt['model']) == set(state)


# ----------------------------------------------------------------------------- overwrite
def test_converter_refuses_to_overwrite_without_force(tmp_path, capsys):
    import convert_checkpoint
    src = str(tmp_path / 'sima.pth')
    torch.save({'model': build('SimAXCiT').state_dict()}, src)
    dst = tmp_path / 'user_file.pth'
    dst.write_bytes(b'precious')
    assert convert_checkpoint.main([src, str(dst), '--family', 'sima_xcit']) == 2
    err = capsys.readouterr().err
    assert 'exists' in err and '--force' in err
    assert dst.read_bytes() == b'precious'
    record('overwrite', 'convert_checkpoint', 'existing output without --force',
           err.strip().replace(str(tmp_path), '<tmp>'), title='Existing output file')
    assert convert_checkpoint.main([src, str(dst), '--family', 'sima_xcit', '--force']) == 0
    assert 'state_dict' in torch.load(str(dst), weights_only=True)
    assert not [p for p in os.listdir(tmp_path) if '.tmp-' in p], 'temporary file left behind'


def test_config_writer_refuses_to_overwrite_without_force(tmp_path, capsys):
    script = osp.join(REPO_ROOT, 'tools', 'swap_backbone.py')
    if not osp.isfile(script):
        pytest.skip('tools/swap_backbone.py not present')
    pytest.importorskip('mmdet')
    import swap_backbone
    out = tmp_path / 'user_config.py'
    out.write_text('# my config\n')
    rc = swap_backbone.main(['mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', '--backbone',
                             'flatten-pvt-v2-b0', '-o', str(out)])
    err = capsys.readouterr().err
    assert rc != 0 and out.read_text() == '# my config\n'
    assert 'exist' in err and '--force' in err
    record('overwrite', 'swap_backbone', 'existing output without --force',
           err.strip().replace(str(tmp_path), '<tmp>'))
