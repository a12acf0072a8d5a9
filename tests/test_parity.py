"""Checkpoint parity with the official implementations on every golden fixture.

Every ``../shared/fixtures/*.pt`` goes through the same library path as
``tools/check_parity.py``; fixtures of families added later are picked up automatically.
"""
import os.path as osp
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, requires_shared, shared_fixtures
from flatten_mm.parity import find_adapter, run_parity

FIXTURES = shared_fixtures('*.pt')


@requires_shared()
@pytest.mark.parametrize('path', FIXTURES, ids=[osp.basename(p) for p in FIXTURES])
def test_fixture_parity(path):
    fx = torch.load(path, map_location='cpu', weights_only=True)
    report = run_parity(fx, name=osp.basename(path))
    print(report.format())
    assert report.passed, report.format()


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
def test_check_parity_cli_exit_codes(tmp_path):
    good = osp.join(osp.dirname(FIXTURES[0]), 'flatten_pvt_v2_small.pt')
    fx = torch.load(good, map_location='cpu', weights_only=True)
    fx['stage_outputs'] = [o + 1e-2 for o in fx['stage_outputs']]
    bad = tmp_path / 'bad.pt'
    torch.save(fx, bad)
    cmd = [sys.executable, osp.join(REPO_ROOT, 'tools', 'check_parity.py')]
    ok = subprocess.run(cmd + [good], capture_output=True, text=True, cwd=REPO_ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert 'stage_outputs[3]' in ok.stdout and '1 passed, 0 failed' in ok.stdout
    fail = subprocess.run(cmd + [str(bad)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert fail.returncode == 1 and 'FAIL' in fail.stdout


def test_unknown_fixture_family_is_reported():
    with pytest.raises(ValueError, match='no parity adapter'):
        find_adapter({'family': 'Other', 'official_ctor': {'cls': 'X', 'module': 'x.py'}})
