"""dev/swap_sweep.py --all-configs (dev/sweeps/swap_sweep_all.py).

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
        'swap_sweep_cli', osp.join(REPO_ROOT, 'dev', 'swap_sweep.py'))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_family_configs_counts_every_file_and_skips_those_without_a_backbone():
    """A family's configs are all its ``.py`` files (own, then sub-directories'); a
    tracker's configs (model.detector, no model.backbone) are skipped with the reason."""
    from dev.sweeps.swap_sweep import configs_root
    from dev.sweeps.swap_sweep_all import family_configs, read_backbone_config
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
    from dev.sweeps.swap_sweep_all import (ConfigRow, append_all_row,
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
    assert '| mmdet | autoassign | 1 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 0 + 0 / 1 |' in md
    assert '| mmseg | erfnet | 1 | 0 | 1 | 0 | 0 | 0 | 0 | 0 | 0 + 0 / 0 |' in md
    assert '| mmdet | qdtrack | 2 | 0 | 0 | 0 | 0 | 0 | 0 | 2 | 0 + 0 / 0 |' in md
    assert '## Refused (1)' in md and '## Failed (0)' in md
    assert 'Run: 0 of 1 built configs were run (0 themselves, 0 identical to one of those); ' \
        '0 passed the forward and the training step; 1 not run yet.' in md
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
    from dev.sweeps import swap_sweep_all
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
    from dev.sweeps.swap_sweep_all import cached_metafiles
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


def test_run_pass_runs_identical_configs_once(tmp_path, capsys, monkeypatch):
    """--run: every built config gets a forward and a training step; the ADE20K r50 and
    r101 Semantic FPN configs are the same model once swapped (same run_key), so the
    second takes the first's result (same_as) without running; the Cityscapes ones
    (19 classes, another pipeline) run themselves. A rerun runs nothing."""
    from dev.sweeps import swap_sweep
    from dev.sweeps.swap_sweep_all import read_all_rows
    cli = _cli()
    csv_path, md_path = str(tmp_path / 'all.csv'), str(tmp_path / 'all.md')
    argv = ['--all-configs', '--run', '--families', 'sem_fpn', '--csv', csv_path,
            '--md', md_path]
    ran = []
    real_check = swap_sweep.check_adapted

    def counting(row, cfg, src, *a, **k):
        ran.append(src)
        return real_check(row, cfg, src, *a, **k)

    monkeypatch.setattr(swap_sweep, 'check_adapted', counting)
    assert cli.main(argv + ['--fresh']) == 0
    rows = {r.config.split('/')[-1]: r for r in read_all_rows(csv_path)}
    ade = ['fpn_r50_4xb4-160k_ade20k-512x512.py', 'fpn_r101_4xb4-160k_ade20k-512x512.py']
    city = ['fpn_r50_4xb2-80k_cityscapes-512x1024.py', 'fpn_r101_4xb2-80k_cityscapes-512x1024.py']
    assert sorted(rows) == sorted(ade + city)
    for r in rows.values():
        assert (r.status, r.build, r.forward, r.train_smoke, r.losses_finite) == \
            ('adapted', 'ok', 'ok', 'ok', 'yes'), r
        assert r.batch and r.size == '128' and len(r.run_key) == 16
        n, total = map(int, r.backbone_grads.split('/'))
        assert n == total > 0
    # sorted order: r101 before r50, so the r101 configs run and the r50 ones are taken over
    assert rows[ade[0]].run_key == rows[ade[1]].run_key
    assert rows[city[0]].run_key == rows[city[1]].run_key != rows[ade[0]].run_key
    assert (rows[ade[0]].same_as, rows[ade[1]].same_as) == (f'sem_fpn/{ade[1]}', '')
    assert (rows[city[0]].same_as, rows[city[1]].same_as) == (f'sem_fpn/{city[1]}', '')
    assert sorted(ran) == sorted(f'mmseg::sem_fpn/{c}' for c in (ade[1], city[1]))
    md = open(md_path, encoding='utf-8').read()
    assert 'Run: 4 of 4 built configs were run (2 themselves, 2 identical to one of ' \
        'those); 4 passed the forward and the training step; 0 not run yet.' in md
    assert '| mmseg | sem_fpn | 4 | 4 | 0 | 0 | 0 | 0 | 0 | 0 | 2 + 2 / 4 |' in md
    ran.clear()
    assert cli.main(argv) == 0
    assert ran == []


def test_run_failure_is_classified_and_taken_over(tmp_path, monkeypatch):
    """A forward error of the written config is ``failed`` with the stage and the
    one-line error (``source-fails`` when the unswapped source fails the same way); an
    identical config takes the failure over, naming the config that failed."""
    from dev.sweeps import swap_sweep, swap_sweep_all
    from dev.sweeps.swap_sweep_all import ConfigRow, run_config

    def swapped_fails(cfg, hw, train, time_limit):
        if cfg.model.backbone.type.startswith('flatten_mm.'):
            return 'forward', RuntimeError('boom\nmore'), None
        return '', None, None

    monkeypatch.setattr(swap_sweep, '_check', swapped_fails)
    fam = 'sem_fpn'
    r101 = ConfigRow('mmseg', fam, f'{fam}/fpn_r101_4xb4-160k_ade20k-512x512.py', 'adapted',
                     build='ok')
    r50 = ConfigRow('mmseg', fam, f'{fam}/fpn_r50_4xb4-160k_ade20k-512x512.py', 'adapted',
                    build='ok')
    ran = {}
    run_config(r101, 'flatten-pvt-v2-b0', str(tmp_path), ran=ran, isolate_failures=False)
    assert (r101.status, r101.reason, r101.forward, r101.train_smoke, r101.same_as) == \
        ('failed', 'forward: RuntimeError: boom', 'failed', '', '')
    assert list(ran) == [r101.run_key]
    run_config(r50, 'flatten-pvt-v2-b0', str(tmp_path), ran=ran, isolate_failures=False)
    assert (r50.status, r50.reason, r50.forward, r50.same_as, r50.run_seconds) == \
        ('failed', 'forward: RuntimeError: boom', 'failed', r101.config, '0')

    monkeypatch.setattr(swap_sweep, '_check',
                        lambda cfg, hw, train, tl: ('forward', RuntimeError('everywhere'), None))
    row = ConfigRow('mmseg', fam, r101.config, 'adapted', build='ok')
    run_config(row, 'flatten-pvt-v2-b0', str(tmp_path), isolate_failures=False)
    assert row.status == 'source-fails' and row.reason == (
        'adapted; the unswapped source config fails the forward the same way here: '
        'RuntimeError: everywhere')
    assert swap_sweep_all.runs_by_key([r101, r50, row]) == {r101.run_key: row}


def test_failed_run_is_retried_in_a_new_process(tmp_path, monkeypatch):
    """A run that fails in the sweep's process (here: a forward error patched into this
    process only) is run again in a new Python process; its pass is kept, and the reason
    keeps the first error and says where each result came from. The Markdown lists it."""
    from dev.sweeps import swap_sweep
    from dev.sweeps.swap_sweep_all import ConfigRow, render_markdown_all, run_config
    monkeypatch.setattr(swap_sweep, '_check', lambda cfg, hw, train, tl: (
        'forward', RuntimeError('state of an earlier model'), None)
        if cfg.model.backbone.type.startswith('flatten_mm.') else ('', None, None))
    row = ConfigRow('mmseg', 'sem_fpn', 'sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py',
                    'adapted', build='ok')
    run_config(row, 'flatten-pvt-v2-b0', str(tmp_path), size=64)
    assert (row.status, row.forward, row.train_smoke, row.losses_finite) == \
        ('adapted', 'ok', 'ok', 'yes'), row.reason
    assert row.reason == ("passed as the first model of a new process; in the sweep's "
                          'process, after other models: forward: RuntimeError: state of '
                          'an earlier model')
    md = render_markdown_all([row], 'flatten-pvt-v2-b0')
    assert '## Adapted, passed in a new process only (1)' in md
    assert '| mmseg | `sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py` | passed as the first' in md
