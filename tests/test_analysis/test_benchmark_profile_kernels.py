"""The profile with interpreted kernels (``--profile --interpret-kernels``, issue #13).

Without a GPU, our operators are forced onto their Triton kernels, which run under
Triton's interpreter: every launch must be counted once (as ``triton::<kernel>``), the
aten ops the interpreter runs inside a launch not at all, and a fused operator must count
as one op of its inputs + outputs in the bytes moved. Counts are asserted, never times.
"""
import os.path as osp
import sys

import pytest
import torch

from conftest import import_interpreted
from benchmarks.core import profiling

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from benchmark_cli import load_cli  # noqa: E402

# the kernel modules interpreted whatever the test order (Triton decides at import)
import_interpreted('flatten_mm.models.ops.fla_triton',
                   'flatten_mm.models.ops.quadtree_triton')

TINY = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 2),
            mlp_ratios=(2, 2, 2, 2))


def _tiny(cls, **attn_cfg):
    torch.manual_seed(0)
    return cls(arch=TINY, drop_path_rate=0., attn_cfg=attn_cfg or None)


def _fla_modules(model):
    return [m for m in model.modules() if hasattr(m, 'use_triton')]


def test_interpreted_profile_counts_each_kernel_launch_once(triton_interpreter):
    from flatten_mm.models.backbones import FLattenPVTv2
    model = _tiny(FLattenPVTv2)
    x = torch.randn(1, 3, 64, 64)
    ref, _ = profiling.profile_backbone(model, model, x, top=100)
    summary, launches = profiling.profile_backbone(model, model, x, top=100,
                                                   interpret_kernels=True)
    assert summary['forced_operators'] == len(_fla_modules(model)) == 4
    assert all(m.use_triton is None for m in _fla_modules(model))  # restored
    assert summary['launch_unit'] == 'top-level aten ops + interpreted Triton launches'
    assert summary['fwd_ms'] is None and summary['bwd_ms'] is None
    calls = {k['kernel']: k['calls'] for k in launches}
    # one forward (2 kernels per layer) and one backward (q, k and two focus kernels)
    assert calls['triton::_fla_kv_fwd'] == calls['triton::_fla_out_fwd'] == 4
    assert calls['triton::_fla_q_bwd'] == calls['triton::_fla_k_bwd'] == 4
    assert calls['triton::_focus_bwd'] == 8
    # what the interpreter runs inside a launch is not a launch: the fused path has fewer
    # top-level ops than the PyTorch path, and no launch list entry is below a launch
    assert summary['fwd_launches'] < ref['fwd_launches']
    assert summary['bwd_launches'] < ref['bwd_launches']
    # the launch list leaves views out (no kernel on a GPU)
    assert 0 < sum(k['calls'] for k in launches) < summary['fwd_launches'] + summary[
        'bwd_launches']
    assert not {'aten::reshape', 'aten::view', 'aten::t', 'aten::detach'} & set(calls)
    assert 'aten::mm' in calls and 'aten::addmm' not in calls  # (linear: one top-level op)
    assert all(k['self_ms'] is None for k in launches)
    # the fused op is one op of inputs + outputs: fewer ops and bytes inside attention
    assert summary['dispatch_ops_fwd'] < ref['dispatch_ops_fwd']
    assert summary['attn_moved_mb'] < ref['attn_moved_mb']
    assert summary['attn_ideal_mb'] == ref['attn_ideal_mb']
    # the fused op saves q, k, v and two small sums instead of the unfused intermediates
    assert 0 < summary['saved_mb'] < ref['saved_mb']
    assert summary['blocks'] == ref['blocks'] == 4


def test_interpreted_profile_of_quadtree_counts_its_level_kernels(triton_interpreter):
    from flatten_mm.models.backbones import QuadTreePVTv2
    model = _tiny(QuadTreePVTv2, topk=2)
    summary, launches = profiling.profile_backbone(model, model, torch.randn(1, 3, 64, 64),
                                                   top=200, interpret_kernels=True)
    assert summary['forced_operators'] == 4
    calls = {k['kernel']: k['calls'] for k in launches}
    # levels 4, 3, 2, 1 per stage: every finer level of B (stages 1-3: 3 final, 2 + 1
    # intermediate) is one fused kernel forward and one backward when training; each
    # intermediate level also launches the scores its top-k selects from (no autograd: no
    # backward launch)
    assert calls['triton::_qt_final_fwd'] == calls['triton::_qt_final_bwd'] == 3 + 3
    assert calls['triton::_qt_gathered_kernel'] == 3
    assert 'aten::index_select' not in calls  # no gathered rows on the kernel path


def test_baselines_and_refusals(triton_interpreter, monkeypatch):
    from timm.models.pvt_v2 import PyramidVisionTransformerV2
    from flatten_mm.models.backbones import FLattenPVTv2
    torch.manual_seed(0)
    timm_model = PyramidVisionTransformerV2(depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32),
                                            num_heads=(1, 1, 1, 2), mlp_ratios=(2, 2, 2, 2))
    summary, kernels = profiling.profile_backbone(
        timm_model, lambda t: timm_model.forward_intermediates(t, intermediates_only=True),
        torch.randn(1, 3, 64, 64), top=3, interpret_kernels=True)
    # nothing to force: profiled as without the flag (times, kernels by self time)
    assert summary['forced_operators'] == 0
    assert summary['launch_unit'] == 'top-level aten ops'
    assert summary['fwd_ms'] > 0 and all(k['self_ms'] is not None for k in kernels)

    model = _tiny(FLattenPVTv2)
    with pytest.raises(ValueError, match='on CPU tensors; got an input on meta'):
        profiling.profile_backbone(model, model, torch.empty(1, 3, 64, 64, device='meta'),
                                   interpret_kernels=True)
    monkeypatch.delenv('TRITON_INTERPRET')
    with pytest.raises(RuntimeError, match='TRITON_INTERPRET=1'):
        profiling.profile_backbone(model, model, torch.randn(1, 3, 64, 64),
                                   interpret_kernels=True)
    assert all(m.use_triton is None for m in _fla_modules(model))  # restored on errors


def test_cli_interpret_kernels(tmp_path, triton_interpreter):
    cli = load_cli()
    for argv in (['--interpret-kernels'], ['--ops', '--interpret-kernels'],
                 ['--profile', '--interpret-kernels', '--device', 'cuda']):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
    md = tmp_path / 'p.md'
    assert cli.main(['--profile', '--interpret-kernels', '--quick', '--families',
                     'flatten-pvt-v2-tiny', '--batch', '1', '--threads', '1',
                     '--profile-top', '40', '--markdown', str(md)]) == 0
    text = md.read_text()
    assert '| flatten-pvt-v2-tiny | fp32 | interpreted |' in text
    assert ('Most frequent launches, views left out (interpreted kernels, no times): '
            'flatten-pvt-v2-tiny') in text
    assert '| triton::_fla_kv_fwd | 4 |' in text
    assert 'Top kernels by self time: pvt-v2-tiny (timm)' in text
