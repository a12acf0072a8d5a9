"""Every registered backbone (tiny arch) exports to ONNX and runs in ONNX Runtime with
PyTorch's outputs (issue #17): at the export size, and with ``dynamic=True`` at a second,
non-square size; sizes outside the file's range are refused.

The backbones come from ``tests/test_reliability/backbone_specs.py`` (every class in the
registry, a missing tiny config fails there), so a new backbone is covered automatically;
it is expected to export with a dynamic H x W unless listed in ``FIXED_SIZE`` with why.
"""
import os.path as osp
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, osp.join(osp.dirname(osp.abspath(__file__)), '..', 'test_reliability'))
from backbone_specs import build, registered_backbones  # noqa: E402

# the deploy extra (pip install -e .[deploy]; scripts/setup_env.sh installs it): skipped
# without it, an error in CI (tests/required_packages.py)
pytest.importorskip('onnxruntime')

from flatten_mm.deploy import OnnxModel, backbone_target, export_onnx  # noqa: E402
from flatten_mm.deploy.export import compare_with_pytorch  # noqa: E402
from flatten_mm.deploy.runtime import check_input_shape  # noqa: E402

#: backbones whose exported graph is valid for the export size only (the reason is in the
#: file's metadata and the tool's output)
FIXED_SIZE = {
    'QuadTreePVTv2': 'QuadTree',  # levels / top-k candidates follow from H, W
    'FLattenSwin': 'shifted windows',  # window padding / shift mask per concrete size
    'FLattenCSWin': 'cross-shaped stripes',  # stripe padding per concrete size
}
#: dynamic backbones whose range starts above 32x32, and why (none at present)
MIN_HW = {}
TOL = 1e-4  # issue #17: within 1e-4 relative of PyTorch
EXPORT_HW = (64, 64)
SECOND_HW = (96, 72)


@pytest.mark.parametrize('name', registered_backbones())
def test_backbone_exports_and_matches_pytorch(name, tmp_path, monkeypatch):
    torch.manual_seed(0)
    target = backbone_target(name, build(name))
    # the fused QuadTree CPU kernel must not be traced: exporting through it fails here
    from flatten_mm.models.ops import quadtree_cpu_infer

    def no_kernel(*args, **kwargs):
        raise AssertionError('the QuadTree CPU kernel ran during the ONNX export')

    with monkeypatch.context() as m:
        m.setattr(quadtree_cpu_infer, 'finer_level_cpu', no_kernel)
        result = export_onnx(target, str(tmp_path / f'{name}.onnx'), EXPORT_HW, dynamic=True)
    assert result.dynamic == (name not in FIXED_SIZE), (result.meta, result.messages)
    sizes = [EXPORT_HW] + ([SECOND_HW] if result.dynamic else [])
    for check in compare_with_pytorch(target, result.path, sizes):
        assert len(check.diffs) == len(target.output_names)
        assert max(check.diffs) <= TOL, check
        assert check.unmatched == (0, 0)  # backbones: no instances
    session = OnnxModel(result.path)
    if result.dynamic:
        lo = MIN_HW.get(name, (32, 32))
        assert result.min_hw == lo and result.max_hw == (4096, 4096)
        assert (lo != (32, 32)) == any('dynamic range starts at' in m for m in result.messages)
        with pytest.raises(ValueError,
                           match=rf'valid for inputs from {lo[0]}x{lo[1]} to 4096x4096'):
            session(np.zeros((1, 3, 16, 40), np.float32))
    else:
        assert FIXED_SIZE[name] in result.meta['static_reason']
        assert result.min_hw == result.max_hw == EXPORT_HW
        with pytest.raises(ValueError, match=r'valid for input 64x64 only, got 96x72'):
            session(np.zeros((1, 3, *SECOND_HW), np.float32))


def test_size_check_refuses_out_of_range():
    meta = {'min_hw': '[32, 32]', 'max_hw': '[1024, 2048]', 'batch': '1'}
    check_input_shape(meta, (1, 3, 32, 2048))
    for shape in [(1, 3, 31, 64), (1, 3, 64, 2049), (1, 3, 1025, 64)]:
        with pytest.raises(ValueError, match='valid for inputs from 32x32 to 1024x2048'):
            check_input_shape(meta, shape)
    with pytest.raises(ValueError, match='exported for batch 1, got 2'):
        check_input_shape(meta, (2, 3, 64, 64))
    with pytest.raises(ValueError, match=r'expected a \(B, 3, H, W\) input'):
        check_input_shape(meta, (1, 64, 64))


def _index_numel(model, value_info, name):
    """Elements of the tensor ``name`` of an ONNX graph (initializer or inferred shape)."""
    import onnx
    for init in model.graph.initializer:
        if init.name == name:
            return int(np.prod(init.dims))
    dims = value_info[name].type.tensor_type.shape.dim
    assert all(d.HasField('dim_value') for d in dims), f'{name}: shape not inferred'
    return int(np.prod([d.dim_value for d in dims]))


@pytest.mark.parametrize('attn_type', ['A', 'B'])
def test_quadtree_graph_gathers_tiles_not_tokens(attn_type, tmp_path):
    """What keeps QuadTree fast in ONNX Runtime (``ops.quadtree_tiles``): the exported
    graph has no loop (``embedding_bag`` exports as ``Loop`` + ``SequenceInsert``: 44x
    slower than eager on 2 CPU threads at 512x512) and no ScatterND, and every gather
    index has at most a quarter of (finest level keys x top-k) entries -- one per
    selected cell of each parent, never one per query and candidate."""
    import onnx
    from flatten_mm.models.backbones import QuadTreePVTv2
    topk, hw = 4, (64, 64)
    torch.manual_seed(0)
    model = QuadTreePVTv2(arch=dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1),
                                    num_heads=(1, 2, 2, 4), mlp_ratios=(2, 2, 2, 2)),
                          attn_cfg=dict(topk=topk, attn_type=attn_type))
    target = backbone_target('quadtree', model)
    result = export_onnx(target, str(tmp_path / 'qt.onnx'), hw)
    assert max(compare_with_pytorch(target, result.path, [hw])[0].diffs) <= TOL
    # the faster form with flatten_mm's ONNX Runtime operator is named (test_ort_custom_ops)
    assert any('custom_ops=True (--custom-ops) writes flatten_mm::QuadTreeLevel' in m
               for m in result.messages), result.messages
    graph = onnx.shape_inference.infer_shapes(onnx.load(result.path))
    value_info = {v.name: v for v in list(graph.graph.value_info) + list(graph.graph.input)}
    ops = [n.op_type for n in graph.graph.node]
    assert not {'Loop', 'SequenceInsert', 'ScatterND'} & set(ops)
    finest_keys = (hw[0] // 4) * (hw[1] // 4)  # stage 1 (stride 4), one head
    gathers = [n for n in graph.graph.node if n.op_type in ('Gather', 'GatherElements',
                                                           'GatherND')]
    assert len(gathers) >= 2 * 3  # keys and values of 3 finer levels in stage 1
    for node in gathers:
        assert _index_numel(graph, value_info, node.input[1]) <= finest_keys * topk // 4, node


def test_fla_graph_has_no_token_mean(tmp_path):
    """The FLA key mean ``mean(phi(K))`` over the tokens exports as a matrix product
    (``ops.capture``): ONNX Runtime reduces over the token axis ~10x slower (11.5 ms
    against 0.8 ms for 65536 x 96 on 1 thread), 2 % of FLatten-Swin-T at 1024x1024."""
    import onnx
    torch.manual_seed(0)
    target = backbone_target('FLattenPVTv2', build('FLattenPVTv2'))
    result = export_onnx(target, str(tmp_path / 'fla.onnx'), EXPORT_HW)
    assert max(compare_with_pytorch(target, result.path, [EXPORT_HW])[0].diffs) <= TOL
    ops = {n.op_type for n in onnx.load(result.path).graph.node}
    assert 'MatMul' in ops and not {'ReduceMean', 'ReduceSum'} & ops, ops
    assert not any('--custom-ops' in m for m in result.messages)  # nothing to gain


def test_export_leaves_no_traced_mask_in_the_window_cache(tmp_path):
    """Shifted-window masks are cached per size; a size first seen by the exporter must
    not leave the trace's fake tensor there (later eager calls and exports got it)."""
    from flatten_mm.models.layers import window
    window.clear_mask_cache()
    target = backbone_target('FLattenSwin', build('FLattenSwin').eval())
    hw = (96, 128)  # shifted windows in stages 1-3
    export_onnx(target, str(tmp_path / 'swin.onnx'), hw)
    assert window.mask_cache_info().currsize == 0
    check, = compare_with_pytorch(target, str(tmp_path / 'swin.onnx'), [hw])
    assert max(check.diffs) <= TOL
    assert window.mask_cache_info().currsize > 0  # eager calls still cache


def test_pvt_exports_dynamic_at_its_position_table_size(tmp_path):
    """At the size its position tables were made for PVT v1 skips the table resize in
    eager mode; under export it always resizes (exact at the same size), else the graph
    is pinned to that size. The export verifies a second size itself."""
    model = build('FLattenPVT', pretrain_img_size=EXPORT_HW).eval()
    assert tuple(model.stages[0].pos_embed_hw) == (16, 16)  # = the 64x64 export's grid
    result = export_onnx(backbone_target('FLattenPVT', model), str(tmp_path / 'pvt.onnx'),
                         EXPORT_HW, dynamic=True)
    assert result.dynamic, result.messages
    assert result.min_hw == (32, 32)


def test_dynamic_range_starts_where_torch_export_succeeds(tmp_path, monkeypatch):
    """A dynamic export that torch.export refuses from the lowest size is retried with
    the lower end doubled (up to the export size), and the range written says so."""
    from flatten_mm.deploy import export as export_mod
    real, tried = export_mod._torch_export, []

    def refuse_below_64(module, x, path, opset, shapes, names, custom_ops=False):
        if shapes is not None:
            tried.append(shapes[0][2].min)
            if shapes[0][2].min < 64:
                raise RuntimeError('Constraints violated (height)!')
        return real(module, x, path, opset, shapes, names, custom_ops)

    monkeypatch.setattr(export_mod, '_torch_export', refuse_below_64)
    target = backbone_target('FLattenPVTv2', build('FLattenPVTv2'))
    result = export_onnx(target, str(tmp_path / 'b.onnx'), (128, 96), dynamic=True)
    assert tried == [32, 64]
    assert result.dynamic and result.min_hw == (64, 64)
    assert any(m.startswith('dynamic range starts at 64x64') and 'Constraints violated' in m
               for m in result.messages), result.messages
