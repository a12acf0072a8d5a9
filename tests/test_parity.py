"""Checkpoint parity with the official implementations on every golden fixture.

Every ``../shared/fixtures/*.pt`` goes through the same library path as
``dev/check_parity.py``; fixtures of families added later are picked up automatically.
The bound is the CLI's default, ``REL_TOL = 1e-5`` of ``max(1, max|ref|)``: the shipped
fixtures agree to <= 9.1e-7 of it on every output (QuadTree: every code path, see
``test_parity_quadtree.py``).
"""
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, requires_shared, shared_fixtures
from dev.parity import find_adapter, run_parity
from dev.parity.core import REL_TOL

FIXTURES = shared_fixtures('*.pt')


@requires_shared()
@pytest.mark.parametrize('path', FIXTURES, ids=[osp.basename(p) for p in FIXTURES])
def test_fixture_parity(path):
    fx = torch.load(path, map_location='cpu', weights_only=True)
    report = run_parity(fx, name=osp.basename(path))
    print(report.format())
    assert REL_TOL == 1e-5
    assert report.passed, report.format()
    for s in report.stages:
        assert s.tolerance == pytest.approx(REL_TOL * max(1., s.max_abs_ref))
    # a classification fixture is also checked through the converted official classifier
    # (mmpretrain ImageClassifier of flatten_mm.models.classification)
    names = [s.name for s in report.stages]
    if fx.get('logits') is not None:
        assert names[-2:] == ['features', 'logits'], names
    else:
        assert 'logits' not in names


@requires_shared()
@pytest.mark.parametrize('fixture,key', [
    ('flatten_swin_small.pt', 'norm.weight'),          # -> the output norm norm3
    ('sima_xcit_small.pt', 'cls_attn_blocks.1.gamma2'),  # -> the class-attention neck
    ('flatten_pvt_v2_small.pt', 'head.bias'),          # -> LinearClsHead
])
def test_parity_detects_a_wrong_classifier_part(fixture, key):
    """The classification parts after the trunk are compared too: a 5 % change of one of
    them leaves every stage output passing and fails the logits."""
    fx = torch.load(osp.join(osp.dirname(FIXTURES[0]), fixture), map_location='cpu',
                    weights_only=True)
    fx['state_dict'] = dict(fx['state_dict'])
    fx['state_dict'][key] = fx['state_dict'][key] * 1.05 + 0.05
    report = run_parity(fx)
    by_name = {s.name: s for s in report.stages}
    assert all(s.passed for n, s in by_name.items() if n.startswith('stage_outputs'))
    assert not by_name['logits'].passed


@requires_shared()
def test_parity_detects_a_wrong_weight():
    path = osp.join(osp.dirname(FIXTURES[0]), 'flatten_pvt_v2_small.pt')
    fx = torch.load(path, map_location='cpu', weights_only=True)
    fx['state_dict'] = dict(fx['state_dict'])
    key = 'block3.0.attn.kv.weight'
    fx['state_dict'][key] = fx['state_dict'][key] * 1.05
    report = run_parity(fx)
    assert report.stages[:2] and all(s.passed for s in report.stages[:2])
    assert not report.passed  # stage 3 onwards differ


@requires_shared()
def test_default_bound_catches_a_1e4_regression():
    """The old bound (1e-4 of max(1, max|ref|)) let a regression 100x the shipped
    differences pass; with the default 1e-5 a 3e-5 relative shift of one stage fails."""
    path = osp.join(osp.dirname(FIXTURES[0]), 'flatten_pvt_v2_small.pt')
    fx = torch.load(path, map_location='cpu', weights_only=True)
    ref = fx['stage_outputs'][2]
    shift = 3e-5 * max(1., float(ref.abs().max()))
    fx['stage_outputs'] = list(fx['stage_outputs'])
    fx['stage_outputs'][2] = ref + shift
    report = run_parity(fx)
    assert not report.passed and not report.stages[2].passed
    assert report.worst.name == 'stage_outputs[2]'
    assert report.worst.rel_diff == pytest.approx(3e-5, rel=0.05)
    assert run_parity(fx, rel_tol=1e-4).passed  # what the old bound accepted
    with pytest.raises(ValueError, match='rel_tol'):
        run_parity(fx, rel_tol=0)


@requires_shared()
def test_check_parity_cli_exit_codes(tmp_path):
    good = osp.join(osp.dirname(FIXTURES[0]), 'flatten_pvt_v2_small.pt')
    fx = torch.load(good, map_location='cpu', weights_only=True)
    fx['stage_outputs'] = list(fx['stage_outputs'])
    fx['stage_outputs'][1] = fx['stage_outputs'][1] + 2e-4  # rel ~5e-5: 1e-5 < . < 1e-4
    bad = tmp_path / 'bad.pt'
    torch.save(fx, bad)
    cmd = [sys.executable, osp.join(REPO_ROOT, 'dev', 'check_parity.py')]
    ok = subprocess.run(cmd + [good], capture_output=True, text=True, cwd=REPO_ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert 'stage_outputs[3]' in ok.stdout and '1 passed, 0 failed' in ok.stdout
    assert 'worst overall' in ok.stdout and 'tol 3.9e-05' in ok.stdout  # 1e-5 * 3.855
    fail = subprocess.run(cmd + [good, str(bad)], capture_output=True, text=True,
                          cwd=REPO_ROOT)
    assert fail.returncode == 1 and 'FAIL' in fail.stdout, fail.stdout + fail.stderr
    assert '1 passed, 1 failed' in fail.stdout
    # the failure message names the fixture and its worst output with max abs and rel
    msg = fail.stderr.strip().splitlines()[-1]
    assert msg.startswith('parity check FAILED: ') and 'bad.pt' in msg
    found = re.search(r'worst stage_outputs\[1\]: max\|diff\| (\S+), rel (\S+) \(tol', msg)
    assert found, msg
    max_ref = float(fx['stage_outputs'][1].abs().max()) - 2e-4
    assert float(found[1]) == pytest.approx(2e-4, rel=0.02)
    assert float(found[2]) == pytest.approx(2e-4 / max_ref, rel=0.02)
    loose = subprocess.run(cmd + [str(bad), '--tol', '1e-4'], capture_output=True, text=True,
                           cwd=REPO_ROOT)
    assert loose.returncode == 0, loose.stdout + loose.stderr
    bad_tol = subprocess.run(cmd + [good, '--tol', '-1'], capture_output=True, text=True,
                             cwd=REPO_ROOT)
    assert bad_tol.returncode == 2 and '--tol must be positive' in bad_tol.stderr


def test_unknown_fixture_family_is_reported():
    with pytest.raises(ValueError, match='no parity adapter'):
        find_adapter({'family': 'Other', 'official_ctor': {'cls': 'X', 'module': 'x.py'}})
