"""tools/analysis/swap_sweep.py --all-configs (flatten_mm/analysis/swap_sweep_all.py).

Every config of a family is enumerated; one with a model.backbone is swapped, written and
its model built; refusals carry the tool's reason; the CSV resumes (a rerun skips what
is there, --redo runs the rows of the given statuses again). Small families only.
"""
import importlib.util
import os
import os.path as osp

import pytest
import torch

from conftest import REPO_ROOT

pytest.importorskip('mmdet')
pytest.importorskip('mmseg')
torch.set_num_threads(1)


def _cli():
    spec = importlib.util.spec_from_file_location(
        'swap_sweep_cli', osp.join(REPO_ROOT, 'tools', 'analysis', 'swap_sweep.py'))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_family_configs_counts_every_file_and_skips_those_without_a_backbone():
    """A family's configs are all its ``.py`` files (own, then sub-directories'); a
    tracker's configs (model.detector, no model.backbone) are skipped with the reason."""
    from flatten_mm.analysis.swap_sweep import configs_root
    from flatten_mm.analysis.swap_sweep_all import family_configs, read_backbone_config
    for scope, fam in (('mmdet', 'qdtrack'), ('mmseg', 'segformer'), ('mmdet', 'common')):
        top = osp.join(configs_root(scope), fam)
        on_disk = sorted(osp.relpath(osp.join(d, f), top) for d, _, files in os.walk(top)
                         for f in files if f.endswith('.py'))
        listed = family_configs(scope, fam)
        assert sorted(listed) == sorted(f'{fam}/{f}' for f in on_disk) and len(listed) > 1
    for rel in family_configs('mmdet', 'qdtrack'):
        cfg, status, why = read_backbone_config(f'mmdet::{rel}')
        assert cfg is None and status == 'skipped'
        assert why.startswith('no model.backbone (QDTrack wraps a detector config under '
                              'model.detector'), why
    # mmdet's common/ holds model-less pieces (dataset / schedule configs)
    skipped = [read_backbone_config(f'mmdet::{rel}')[1:] for rel in
               family_configs('mmdet', 'common')]
    assert ('skipped', 'no model (a base / dataset / schedule config)') in skipped
    cfg, status, why = read_backbone_config('mmdet::atss/atss_r50_fpn_1x_coco.py')
    assert cfg.model.backbone.type == 'ResNet' and (status, why) == ('', '')


def test_all_configs_rows_table_and_resume(tmp_path, capsys, monkeypatch):
    """One adapted and built config (autoassign), one refused (ERFNet's stride-2 map, the
    tool's reason naming it), two skipped trackers; Markdown per-family counts and the
    refusal listed; a rerun does nothing; --redo failed reruns only that row."""
    from flatten_mm.analysis.swap_sweep_all import (ConfigRow, append_all_row,
                                                    read_all_rows)
    cli = _cli()
    csv_path, md_path = str(tmp_path / 'all.csv'), str(tmp_path / 'all.md')
    argv = ['--all-configs', '--families', 'autoassign', 'erfnet', 'qdtrack',
            '--csv', csv_path, '--md', md_path]
    assert cli.main(argv + ['--fresh']) == 0
    rows = {r.config: r for r in read_all_rows(csv_path)}
    assert sorted(rows) == ['autoassign/autoassign_r50-caffe_fpn_1x_coco.py',
                            'erfnet/erfnet_fcn_4xb4-160k_cityscapes-512x1024.py',
                            'qdtrack/qdtrack_faster-rcnn_r50_fpn_4e_base.py',
                            'qdtrack/qdtrack_faster-rcnn_r50_fpn_8xb2-4e_mot17halftrain_'
                            'test-mot17halfval.py']
    ok = rows['autoassign/autoassign_r50-caffe_fpn_1x_coco.py']
    assert (ok.scope, ok.family, ok.status, ok.reason, ok.build, ok.build_error) == \
        ('mmdet', 'autoassign', 'adapted', '', 'ok', '')
    refused = rows['erfnet/erfnet_fcn_4xb4-160k_cityscapes-512x1024.py']
    assert (refused.scope, refused.status, refused.build) == ('mmseg', 'refused', '')
    assert refused.reason.startswith('the source backbone (ERFNet) returns maps at strides '
                                     '(2,); flatten-pvt-v2-b0 returns one map at each of '
                                     '(4, 8, 16, 32)'), refused.reason
    tracks = [r for r in rows.values() if r.family == 'qdtrack']
    assert [r.status for r in tracks] == ['skipped'] * 2
    assert all('QDTrack wraps a detector config' in r.reason for r in tracks)
    md = open(md_path, encoding='utf-8').read()
    assert 'Status: 1 adapted, 1 refused, 2 skipped (4 configs in 3 families).' in md
    assert '| mmdet | autoassign | 1 | 1 | 0 | 0 | 0 | 0 | 0 |' in md
    assert '| mmseg | erfnet | 1 | 0 | 1 | 0 | 0 | 0 | 0 |' in md
    assert '| mmdet | qdtrack | 2 | 0 | 0 | 0 | 0 | 0 | 2 |' in md
    assert '## Refused (1)' in md and '## Failed (0)' in md
    assert '| mmseg | `erfnet/erfnet_fcn_4xb4-160k_cityscapes-512x1024.py` | ' \
        'the source backbone (ERFNet) returns maps at strides (2,)' in md
    assert '| mmdet | `qdtrack/qdtrack_faster-rcnn_r50_fpn_4e_base.py` | no model.backbone ' \
        '(QDTrack wraps a detector config' in md
    capsys.readouterr()

    # resume: everything is in the CSV, nothing runs again
    calls = []
    real = cli.sweep_config

    def counting(scope, rel, *a, **k):
        calls.append(rel)
        return real(scope, rel, *a, **k)

    monkeypatch.setattr(cli, 'sweep_config', counting)
    before = open(csv_path, encoding='utf-8').read()
    assert cli.main(argv) == 0
    assert calls == [] and open(csv_path, encoding='utf-8').read() == before
    # --redo failed: only the failed row runs again (and is replaced, not duplicated)
    append_all_row(csv_path, ConfigRow('mmdet', 'autoassign', ok.config, 'failed',
                                       'build of the written config failed', 'failed', 'boom'))
    assert cli.main(argv + ['--redo', 'failed']) == 0
    assert calls == [ok.config]
    again = read_all_rows(csv_path)
    assert len(again) == 4
    redone = [r for r in again if r.config == ok.config]
    assert [(r.status, r.build, r.build_error) for r in redone] == [('adapted', 'ok', '')]


def test_build_failure_is_classified_against_the_source(tmp_path, monkeypatch):
    """A build error of the written config is ``failed`` with the one-line error, unless
    the unswapped source fails the same way (``source-fails``) or a package is missing
    (``needs-package``)."""
    from flatten_mm.analysis import swap_sweep_all
    rel = 'autoassign/autoassign_r50-caffe_fpn_1x_coco.py'
    real = swap_sweep_all.build_config

    def only_swapped_fails(cfg):
        if cfg.model.backbone.type.startswith('flatten_mm.'):
            raise RuntimeError('boom\nsecond line')
        real(cfg)

    monkeypatch.setattr(swap_sweep_all, 'build_config', only_swapped_fails)
    row = swap_sweep_all.sweep_config('mmdet', rel, 'flatten-pvt-v2-b0', str(tmp_path))
    assert (row.status, row.build, row.build_error) == ('failed', 'failed', 'RuntimeError: boom')
    assert row.reason == 'build of the written config failed'

    def both_fail(cfg):
        raise RuntimeError('same everywhere')

    monkeypatch.setattr(swap_sweep_all, 'build_config', both_fail)
    row = swap_sweep_all.sweep_config('mmdet', rel, 'flatten-pvt-v2-b0', str(tmp_path))
    assert (row.status, row.build_error) == ('source-fails', 'RuntimeError: same everywhere')

    def missing(cfg):
        raise RuntimeError('skimage is not installed, please install it')

    monkeypatch.setattr(swap_sweep_all, 'build_config', missing)
    row = swap_sweep_all.sweep_config('mmdet', rel, 'flatten-pvt-v2-b0', str(tmp_path))
    assert row.status == 'needs-package'
    assert row.reason == 'written; building it needs skimage, not installed here'

    def fairscale(cfg):  # mmdet's grounding-DINO wording: the name ends the sentence
        raise NotImplementedError('If you want to reduce GPU memory usage, please install '
                                  'fairscale by executing the following command: '
                                  'pip install fairscale.')

    monkeypatch.setattr(swap_sweep_all, 'build_config', fairscale)
    row = swap_sweep_all.sweep_config('mmdet', rel, 'flatten-pvt-v2-b0', str(tmp_path))
    assert row.reason == 'written; building it needs fairscale, not installed here'


def test_cached_metafiles_answers_as_mmengine():
    """The per-package metafile index gives mmengine's answer (the first weight of a
    config) and its ValueError for a name without a metafile entry (mmengine then
    resolves the name as a base path); restored on exit."""
    from mmengine.config import utils
    from mmengine.utils import get_installed_path
    from flatten_mm.analysis.swap_sweep_all import cached_metafiles
    pkg = get_installed_path('mmdet')
    original = utils._get_cfg_metainfo
    name = 'mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py'  # as the metafiles name it
    expected = original(pkg, name)
    assert expected['Config'] == 'configs/mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py'
    with cached_metafiles():
        assert utils._get_cfg_metainfo is not original
        assert utils._get_cfg_metainfo(pkg, name) == expected
        with pytest.raises(ValueError, match='but got no-such-config'):
            utils._get_cfg_metainfo(pkg, 'no-such-config')
    assert utils._get_cfg_metainfo is original
