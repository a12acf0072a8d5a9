"""``tools/swap_backbone.py --train-smoke`` says no when the iteration is not one a
training job can start from: exit status 1 and an error line with the reason, for a
non-finite loss (a real RetinaNet iteration with a NaN loss weight) and for a trainable
backbone parameter without a gradient (a real iteration where the FPN skips a map the
backbone computes); ``SmokeReport.ok`` / ``failures`` for each condition alone."""
import importlib.util
import math
import os.path as osp

import pytest

pytest.importorskip('mmdet')
from mmengine.config import Config  # noqa: E402

from flatten_mm.swap.smoke import SmokeReport  # noqa: E402

from conftest import REPO_ROOT  # noqa: E402

RETINANET = 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py'


@pytest.fixture
def cli():
    spec = importlib.util.spec_from_file_location(
        'swap_cli', osp.join(REPO_ROOT, 'tools', 'swap_backbone.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(losses=None, no_grad=(), nonfinite=()):
    return SmokeReport(losses if losses is not None else {'loss': 1.5, 'loss_cls': 1.0},
                       backbone_params=10, frozen=0, no_grad=list(no_grad),
                       nonfinite=list(nonfinite), seconds=0.1)


@pytest.mark.parametrize('kwargs,reason', [
    (dict(losses={'loss': math.nan, 'loss_cls': math.nan}), 'non-finite losses: loss, loss_cls'),
    (dict(losses={'loss': math.inf, 'loss_bbox': 0.5}), 'non-finite losses: loss'),
    (dict(no_grad=['backbone.fpn1.0.weight']),
     '1 trainable backbone parameter tensors received no gradient: backbone.fpn1.0.weight'),
    (dict(nonfinite=['neck.fpn_convs.0.conv.weight']),
     '1 parameter tensors have a non-finite gradient: neck.fpn_convs.0.conv.weight'),
], ids=['nan-loss', 'inf-loss', 'no-grad', 'nonfinite-grad'])
def test_each_failure_alone_makes_the_report_fail(kwargs, reason):
    r = report(**kwargs)
    assert not r.ok
    assert r.failures == [reason]


def test_finite_losses_and_gradients_pass():
    r = report()
    assert r.ok and r.failures == []


def test_cli_fails_on_a_nan_loss(cli, tmp_path, capsys):
    src = tmp_path / 'retinanet_nan.py'
    src.write_text(f'_base_ = {RETINANET!r}\n'
                   "model = dict(bbox_head=dict(loss_cls=dict(loss_weight=float('nan'))))\n")
    out = tmp_path / 'swapped.py'
    code = cli.main([str(src), '--backbone', 'flatten-pvt-v2-b0', '-o', str(out),
                     '--train-smoke', '--smoke-size', '64', '64'])
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    error = [line for line in captured.err.splitlines() if line.startswith('error:')]
    assert len(error) == 1 and error[0].startswith('error: --train-smoke failed: '
                                                   'non-finite losses: loss, loss_cls'), error
    assert 'non-finite losses: loss, loss_cls' in captured.out  # the summary says it too


def test_cli_fails_on_a_backbone_parameter_without_gradient(cli, tmp_path, capsys,
                                                            monkeypatch):
    """The swap drops the maps a neck does not read; the smoke here runs the written
    config with SimA's stride-4 map put back and RetinaNet's FPN starting at level 1,
    so that map's adapter gets no gradient (what the swap wrote before it dropped unread
    maps)."""
    real = cli.train_smoke

    def smoke_with_unread_map(path, **kwargs):
        cfg = Config.fromfile(path)
        cfg.model.backbone.out_indices = (0, 1, 2, 3)
        cfg.model.neck.in_channels = [128] * 4
        cfg.model.neck.start_level = 1
        return real(cfg, **kwargs)

    monkeypatch.setattr(cli, 'train_smoke', smoke_with_unread_map)
    out = tmp_path / 'swapped.py'
    code = cli.main([RETINANET, '--backbone', 'sima-xcit-n12-p16', '-o', str(out),
                     '--train-smoke', '--smoke-size', '64', '64'])
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    error = [line for line in captured.err.splitlines() if line.startswith('error:')]
    assert len(error) == 1, captured.err
    assert error[0].startswith('error: --train-smoke failed: ') and \
        'trainable backbone parameter tensors received no gradient: backbone.fpn1.' in error[0]
    assert 'non-finite' not in error[0]
