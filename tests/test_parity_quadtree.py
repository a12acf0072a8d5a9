"""The QuadTree parity rule: strict tolerance, or a localized difference explained by a
top-k near-tie that our own run recorded (see ``flatten_mm/parity/quadtree.py``)."""
import os.path as osp

import pytest
import torch

from conftest import FIXTURES_DIR, requires_shared
from flatten_mm.parity import ADAPTERS, run_parity

PATH = osp.join(FIXTURES_DIR, 'quadtree_b_det_small.pt')


@pytest.fixture(scope='module')
def fx():
    return torch.load(PATH, map_location='cpu', weights_only=True)


@requires_shared()
def test_margins_are_recorded_per_stage(fx):
    report = run_parity(fx)
    assert report.passed, report.format()
    margins = ADAPTERS['quadtree']._margins
    # stages 1-3 use their top-k (4/3/2 levels), stage 4 (one B level) does not
    assert all(margins[i] for i in range(3)) and not margins[3]
    # the fixture documents a smallest reference margin of 1.4e-6; ours is of that order
    assert min(min(m) for m in margins.values() if m) < 1e-5


def _compare(fx, outputs, margins):
    adapter = ADAPTERS['quadtree']
    adapter._margins = margins
    return adapter.compare(fx, outputs)


@requires_shared()
def test_localized_flip_needs_a_near_tie(fx):
    outs = [o.clone() for o in fx['stage_outputs']]
    outs[1][0, :, 3, 4] += 5e-3  # one token changed, like a flipped selection
    near_tie = {0: [2e-6], 1: [3e-4], 2: [], 3: []}
    res = _compare(fx, outs, near_tie)
    assert all(r.passed for r in res) and 'near-tie' in res[1].note
    no_tie = {0: [1e-3], 1: [3e-4], 2: [], 3: []}
    res = _compare(fx, outs, no_tie)
    assert not res[1].passed and 'not a near-tie' in res[1].note
    late_tie = {0: [1e-3], 1: [1e-3], 2: [1e-7], 3: []}  # a later stage cannot explain it
    assert not _compare(fx, outs, late_tie)[1].passed


@requires_shared()
def test_widespread_difference_fails_even_with_a_near_tie(fx):
    outs = [o.clone() for o in fx['stage_outputs']]
    outs[2] = outs[2] + 5e-3
    res = _compare(fx, outs, {0: [1e-7], 1: [], 2: [], 3: []})
    assert not res[2].passed and 'differ' in res[2].note
