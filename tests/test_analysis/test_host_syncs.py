"""Host-device synchronisations in a training step (issue #13: launch-bound GPU steps).

An op that makes the host wait for the GPU (``.item()``, a tensor made from Python data
and copied to the device, value-dependent output sizes) drains the kernel queue; found
here on CPU by ``benchmarks.core.syncs``. Every backbone family's training
forward + backward must have none, on the PyTorch path and with our operators on their
Triton kernels (interpreted); the audit itself must find each kind, at the right line.
"""
import os.path as osp

import pytest
import torch
import torch.nn as nn

from conftest import import_interpreted
from benchmarks.core import profiling, syncs
from benchmarks.core.cases import tiny_backbones

import_interpreted('flatten_mm.models.ops.fla_triton',
                   'flatten_mm.models.ops.quadtree_triton')
HERE = osp.relpath(osp.abspath(__file__), osp.dirname(osp.dirname(osp.dirname(
    osp.abspath(__file__)))))


class _Syncing(nn.Module):

    def forward(self, x):
        scale = float(x.detach().abs().max())            # _local_scalar_dense
        offsets = torch.tensor([0., 1.], device=x.device)  # lift_fresh
        keep = x.flatten()[x.flatten() > 0]              # index
        rows = torch.nonzero(x.detach() > 0)[:, 0]       # nonzero
        return x * scale + offsets.sum() + keep.sum() + rows.sum()


def test_each_kind_is_found_at_its_line():
    import inspect
    x = torch.randn(4, 4, requires_grad=True)
    found = syncs.host_syncs(lambda: _Syncing()(x).sum().backward())
    src, first = inspect.getsourcelines(_Syncing.forward)
    lines = {op: first + i for i, line in enumerate(src) for op in ('_local_scalar_dense',
             'lift_fresh', 'index', 'nonzero') if line.rstrip().endswith(f'# {op}')}
    assert len(lines) == 4
    got = {(f['op'], f['where']) for f in found}
    for op, line in lines.items():
        assert (op, f'{HERE}:{line}') in got, (op, line, found)
    assert all(f['calls'] >= 1 for f in found)
    assert syncs.host_syncs(lambda: (x * 2).sum().backward()) == []


def test_a_sync_inside_the_package_is_attributed_to_it():
    """The QuadTree margin recorder (a debugging hook) reads margins on the host: found,
    at its line in quadtree_attention.py (not at the caller's)."""
    from flatten_mm.models.layers import quadtree_attention as qa
    model = tiny_backbones()['quadtree-b-pvt-v2'][0]
    attn = [m for m in model.modules() if isinstance(m, qa.QuadTreeAttention)][0]
    attn.margin_recorder = lambda level, margin: None
    found = syncs.training_step_syncs(model, torch.randn(1, 3, 64, 80))
    assert {f['op'] for f in found} == {'_local_scalar_dense'}, found
    assert all(f['where'].startswith('flatten_mm/models/layers/quadtree_attention.py:')
               for f in found), found


def test_no_backbone_family_syncs_in_a_step_or_an_inference_forward():
    """What ``benchmark --check`` reports (``host_syncs``), every family empty."""
    report = syncs.backbone_host_syncs('cpu')
    assert report == {name: [] for name in tiny_backbones()}


def test_warmup_leaves_out_what_is_cached_per_shape():
    """Swin's shifted-window mask is built on the host once per shape (then cached on the
    device): seen without the warm-up step, not with it."""
    from flatten_mm.models.layers import window
    window._shifted_window_mask.cache_clear()
    model, hw = tiny_backbones()['flatten-swin']
    x = torch.randn(1, 3, *hw)
    cold = syncs.training_step_syncs(model, x, warmup=False)
    assert cold and all(f['where'].startswith('flatten_mm/models/layers/window.py:')
                        for f in cold), cold
    assert syncs.training_step_syncs(model, x) == []


@pytest.mark.parametrize('name', ['flatten-pvt-v2', 'quadtree-b-pvt-v2', 'quadtree-a-pvt-v2',
                                  'flatten-swin'])
def test_steps_on_the_kernels_have_no_host_sync(name, triton_interpreter):
    """The CUDA dispatch path: our operators forced onto their (interpreted) Triton
    kernels (QuadTree: with the fused final level and the kernels' batched levels),
    training step and inference forward."""
    model, hw = tiny_backbones()[name]
    x = torch.randn(1, 3, *hw)
    with profiling.forced_kernels(model) as forced:
        assert forced > 0
        assert syncs.training_step_syncs(model, x) == []
        assert syncs.training_step_syncs(model, x, train=False) == []
