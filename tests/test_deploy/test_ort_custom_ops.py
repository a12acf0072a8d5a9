"""flatten_mm's ONNX Runtime operator (``flatten_mm::QuadTreeLevel``, issue #46): it
computes what the PyTorch kernel computes, an export with ``custom_ops=True`` writes one
node per QuadTree finer level and matches PyTorch, and without the library everything
falls back or stops with a message saying why.

The library needs ONNX Runtime's C API headers (``scripts/setup_env.sh`` fetches them);
without them these tests skip, naming why -- except in CI, where
``FLATTEN_MM_REQUIRE_CPU_KERNELS=1`` turns a failed build into an error.
"""
import hashlib
import io
import lzma
import tarfile
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip('onnxruntime')

from flatten_mm.deploy import (OnnxModel, backbone_target, export_onnx, ort_ops,  # noqa: E402
                               read_metadata)
from flatten_mm.deploy.export import compare_with_pytorch  # noqa: E402
from flatten_mm.models.ops import quadtree_cpu  # noqa: E402
from flatten_mm.models.ops import quadtree_graph_op  # noqa: E402

TOL = 1e-4  # the export tolerance of issue #17 (relative to the largest output value)


@pytest.fixture(scope='module')
def library():
    path = ort_ops.library_path()  # raises in CI when it cannot be built
    if path is None:
        pytest.skip(f'flatten_mm ONNX Runtime operators unavailable: {ort_ops.status()}')
    return path


def _level_model(type_a: bool, width: int, scale: float, topk: int):
    from onnx import TensorProto, helper
    names = ['q', 'k', 'v', 'prev_idx', 'prev_score', 'init']
    node = helper.make_node('QuadTreeLevel', names, ['msg', 'next_idx', 'next_score'],
                            domain=ort_ops.DOMAIN, width=width, scale=scale, topk=topk,
                            type_a=int(type_a))
    inputs = [helper.make_tensor_value_info(
        n, TensorProto.INT64 if n == 'prev_idx' else TensorProto.FLOAT, None) for n in names]
    outputs = [helper.make_tensor_value_info('msg', TensorProto.FLOAT, None),
               helper.make_tensor_value_info('next_idx', TensorProto.INT64, None),
               helper.make_tensor_value_info('next_score', TensorProto.FLOAT, None)]
    model = helper.make_model(helper.make_graph([node], 'level', inputs, outputs),
                              opset_imports=[helper.make_opsetid('', 18),
                                             helper.make_opsetid(ort_ops.DOMAIN, 1)])
    model.ir_version = 8
    return model.SerializeToString()


def _session(model: bytes, threads: int):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    ort_ops.register(opts)
    return ort.InferenceSession(model, opts, providers=['CPUExecutionProvider'])


def _level_inputs(BH, H, W, d, Kp, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = H * W
    q, k, v, init = (torch.randn(BH, M, d, generator=g) for _ in range(4))
    # distinct cells per parent, as a coarser level's top-k gives
    prev_idx = torch.stack([torch.randperm(M // 4, generator=g)[:Kp]
                            for _ in range(BH * M // 4)]).view(BH, M // 4, Kp)
    prev_score = torch.rand(BH, M // 4, Kp, generator=g)
    return q, k, v, prev_idx, prev_score, init


@pytest.mark.parametrize('type_a', [False, True], ids=['B', 'A'])
@pytest.mark.parametrize('d', [32, 24])  # a compiled head width, and the generic loop
@pytest.mark.parametrize('topk', [0, 6])
@pytest.mark.parametrize('with_init', [False, True])
def test_operator_computes_the_pytorch_level(library, type_a, d, topk, with_init):
    """Bit for bit the PyTorch CPU kernel (the same C++ forward: this checks the layouts,
    attributes, ``init`` and thread split of the ONNX Runtime glue), at 1 and 2 threads;
    and the standard-operator form within float rounding."""
    kernel = quadtree_cpu.quadtree_level_kernel()
    BH, H, W, Kp, scale = 3, 8, 12, 4, d**-0.5
    q, k, v, prev_idx, prev_score, init = _level_inputs(BH, H, W, d, Kp)
    empty = torch.zeros(0)
    feed = dict(q=q.numpy(), k=k.numpy(), v=v.numpy(), prev_idx=prev_idx.numpy(),
                prev_score=(prev_score if type_a else empty).numpy(),
                init=(init if with_init else empty).numpy())
    model = _level_model(type_a, W, scale, topk)
    outs = [_session(model, threads).run(None, feed) for threads in (1, 2)]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    msg, next_idx, next_score = outs[0]
    assert next_idx.shape == (BH, H * W, topk)
    assert next_score.shape == (BH, H * W, topk if type_a else 0)
    if kernel is not None:  # (built in CI: FLATTEN_MM_REQUIRE_CPU_KERNELS=1)
        ref_msg = init.clone() if with_init else torch.zeros_like(q)
        ref_idx, ref_score = kernel(q, k, v, prev_idx, prev_score if type_a else None,
                                    ref_msg, W, scale, topk, type_a)
        np.testing.assert_array_equal(msg, ref_msg.numpy())
        np.testing.assert_array_equal(next_idx, ref_idx.numpy())
        np.testing.assert_array_equal(next_score, ref_score.numpy())
    tiles = quadtree_graph_op.quadtree_level(
        q, k, v, prev_idx, prev_score if type_a else empty, init if with_init else empty, W,
        scale, topk, type_a)
    assert np.abs(msg - tiles[0].numpy()).max() <= 1e-5 * np.abs(tiles[0].numpy()).max()
    # the same candidates passed on (each query's set; the order is unspecified)
    np.testing.assert_array_equal(np.sort(next_idx, -1), np.sort(tiles[1].numpy(), -1))


def test_operator_names_bad_input(library):
    BH, H, W, d, Kp = 1, 4, 4, 8, 2
    q, k, v, prev_idx, prev_score, init = _level_inputs(BH, H, W, d, Kp)
    session = _session(_level_model(True, W, 0.5, 2), 1)
    feed = dict(q=q.numpy(), k=k.numpy(), v=v.numpy(), prev_idx=prev_idx.numpy(),
                prev_score=prev_score.numpy(), init=init.numpy())
    bad_cell = prev_idx.clone()
    bad_cell[0, 1, 0] = H * W // 4  # one past the parent grid
    with pytest.raises(Exception, match=r'QuadTreeLevel: prev_idx entry 4 is outside the '
                                        r'parent grid of 4 tokens'):
        session.run(None, dict(feed, prev_idx=bad_cell.numpy()))
    with pytest.raises(Exception, match=r'variant A: prev_score must be shaped like prev_idx'):
        session.run(None, dict(feed, prev_score=np.zeros(0, np.float32)))
    with pytest.raises(Exception, match=r'init must be empty or shaped like q'):
        session.run(None, dict(feed, init=init[:, :4].numpy()))
    with pytest.raises(Exception, match=r'the level must have even height and width'):
        _session(_level_model(True, 3, 0.5, 2), 1).run(None, feed)


def _quadtree(attn_type):
    from flatten_mm.models.backbones import QuadTreePVTv2
    torch.manual_seed(0)
    return QuadTreePVTv2(arch=dict(embed_dims=(8, 16, 24, 32), depths=(1, 2, 1, 1),
                                   num_heads=(1, 2, 2, 4), mlp_ratios=(2, 2, 2, 2)),
                         attn_cfg=dict(topk=4, attn_type=attn_type)).eval()


@pytest.mark.parametrize('attn_type', ['A', 'B'])
def test_export_writes_one_operator_per_finer_level(library, attn_type, tmp_path):
    """No gathered tiles left: every finer level of every block is one node (and only the
    coarsest level keeps a TopK); ONNX Runtime with the library gives PyTorch's maps."""
    import onnx
    from flatten_mm.models.layers import QuadTreeAttention
    model = _quadtree(attn_type)
    target = backbone_target('quadtree', model)
    hw = (64, 64)
    result = export_onnx(target, str(tmp_path / 'qt.onnx'), hw, custom_ops=True)
    assert result.meta['custom_ops'] == ort_ops.DOMAIN
    assert any('register the library' in m for m in result.messages)
    attention = [m for m in model.modules() if isinstance(m, QuadTreeAttention)]
    ops = [n.op_type for n in onnx.load(result.path).graph.node]
    assert ops.count('QuadTreeLevel') == sum(m.num_levels - 1 for m in attention) > 0
    assert ops.count('TopK') <= len(attention)
    assert not {'Gather', 'GatherElements', 'GatherND'} & set(ops), sorted(set(ops))
    assert max(compare_with_pytorch(target, result.path, [hw])[0].diffs) <= TOL


def test_without_the_library_export_falls_back_once_and_loading_explains(
        tmp_path, monkeypatch):
    """No headers: the first export asking for the operators warns and writes standard
    operators (said in its messages), the next one does not warn again; a file that uses
    the operators is refused with the reason and the way out."""
    monkeypatch.delenv('FLATTEN_MM_REQUIRE_CPU_KERNELS', raising=False)
    monkeypatch.delenv(ort_ops.ENV_INCLUDE, raising=False)
    monkeypatch.setenv('FLATTEN_MM_EXT_DIR', str(tmp_path / 'empty_cache'))
    monkeypatch.setattr(ort_ops, '_SYSTEM_INCLUDES', ())
    monkeypatch.setattr(ort_ops, '_built', {})
    target = backbone_target('quadtree', _quadtree('B'))
    with pytest.warns(RuntimeWarning, match='ONNX Runtime custom operators could not be built'):
        result = export_onnx(target, str(tmp_path / 'plain.onnx'), (64, 64), custom_ops=True)
    assert result.meta['custom_ops'] == ''
    assert any('standard operators only' in m and 'no ONNX Runtime headers' in m
               for m in result.messages)
    # (and says what it would have written)
    assert any('--custom-ops) writes flatten_mm::QuadTreeLevel' in m for m in result.messages)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        again = export_onnx(target, str(tmp_path / 'plain2.onnx'), (64, 64), custom_ops=True)
    assert again.meta['custom_ops'] == ''
    assert max(compare_with_pytorch(target, result.path, [(64, 64)])[0].diffs) <= TOL
    # a file written elsewhere with the operators
    import onnx
    from onnx import helper
    m = onnx.load(result.path)
    m.opset_import.append(helper.make_opsetid(ort_ops.DOMAIN, 1))
    onnx.save(m, str(tmp_path / 'uses_ops.onnx'))
    with pytest.raises(RuntimeError, match=r'could not be built here: .*no ONNX Runtime '
                                           r'headers.*fetch-headers'):
        OnnxModel(str(tmp_path / 'uses_ops.onnx'))
    monkeypatch.setenv('FLATTEN_MM_REQUIRE_CPU_KERNELS', '1')
    with pytest.raises(RuntimeError, match='FLATTEN_MM_REQUIRE_CPU_KERNELS is set'):
        ort_ops.library_path()


def _ar(members):
    out = b'!<arch>\n'
    for name, data in members:
        out += f'{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n'.encode()
        out += data + (b'\n' if len(data) % 2 else b'')
    return out


def _debian_mirror(root, header: bytes, tamper: bool = False) -> str:
    """A file:// mirror with one package, libonnxruntime-dev, in a suite 'test'."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w') as tar:
        info = tarfile.TarInfo('./usr/include/onnxruntime/onnxruntime_c_api.h')
        info.size = len(header)
        tar.addfile(info, io.BytesIO(header))
    deb = _ar([('debian-binary', b'2.0\n'), ('control.tar.xz', lzma.compress(b'')),
               ('data.tar.xz', lzma.compress(buf.getvalue()))])
    pool = root / 'pool' / 'main' / 'o' / 'onnxruntime'
    pool.mkdir(parents=True)
    (pool / 'libonnxruntime-dev_1.0_amd64.deb').write_bytes(deb + (b'x' if tamper else b''))
    index = (f'Package: libonnxruntime1.0\nVersion: 1.0\n\n'
             f'Package: libonnxruntime-dev\nVersion: 1.0\n'
             f'Filename: pool/main/o/onnxruntime/libonnxruntime-dev_1.0_amd64.deb\n'
             f'SHA256: {hashlib.sha256(deb).hexdigest()}\n\n')
    for arch in ('amd64', 'arm64'):
        folder = root / 'dists' / 'test' / 'main' / f'binary-{arch}'
        folder.mkdir(parents=True)
        (folder / 'Packages.xz').write_bytes(lzma.compress(index.encode()))
    return root.as_uri()


def test_fetch_headers_unpacks_the_debian_package_it_checked(tmp_path, monkeypatch):
    monkeypatch.setenv('FLATTEN_MM_EXT_DIR', str(tmp_path / 'cache'))
    monkeypatch.delenv(ort_ops.ENV_INCLUDE, raising=False)
    monkeypatch.setattr(ort_ops, '_SYSTEM_INCLUDES', ())
    header = b'#define ORT_API_VERSION 7\n'
    folder = ort_ops.fetch_headers('test', _debian_mirror(tmp_path / 'good', header))
    assert ort_ops.header_dir() == folder
    assert ort_ops.api_version(folder) == 7
    with pytest.raises(RuntimeError, match='SHA-256 differs from the package index'):
        ort_ops.fetch_headers('test', _debian_mirror(tmp_path / 'bad', header, tamper=True))
    assert ort_ops.api_version(folder) == 7  # what was there is kept


def test_detector_config_exports_with_the_operators_through_the_tool(library, tmp_path,
                                                                     capsys):
    """A QuadTree RetinaNet config (backbone shrunk) through ``export_onnx.py --custom-ops
    --check``: the file uses the operator, the tool says where the library is, and ONNX
    Runtime matches PyTorch."""
    import os.path as osp
    import sys

    import onnx
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    sys.path.insert(0, osp.join(root, 'tools', 'deployment'))
    import export_onnx as tool
    config = tmp_path / 'tiny.py'
    base = osp.join(root, 'configs/mmdet/quadtree_pvt_v2/'
                          'retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco.py')
    config.write_text(
        f'_base_ = [{base!r}]\n'
        'model = dict(backbone=dict(arch=dict(_delete_=True, embed_dims=(8, 16, 24, 32), '
        'depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), mlp_ratios=(2, 2, 2, 2)), '
        'attn_cfg=dict(topk=4)), neck=dict(in_channels=[8, 16, 24, 32]))\n')
    out = str(tmp_path / 'det.onnx')
    rc = tool.main([str(config), '-o', out, '--shape', '128', '160', '--custom-ops',
                    '--check'])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f'operator library: {library}' in text and 'OK: worst' in text
    assert read_metadata(out)['custom_ops'] == ort_ops.DOMAIN
    assert 'QuadTreeLevel' in {n.op_type for n in onnx.load(out).graph.node}


def _build_tool():
    import os.path as osp
    import sys
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    sys.path.insert(0, osp.join(root, 'tools', 'deployment'))
    import build_ort_ops
    return build_ort_ops


def test_build_tool_prints_the_library_or_why_there_is_none(library, tmp_path, monkeypatch,
                                                           capsys):
    """``build_ort_ops.py build`` prints the path ``register`` uses; without headers it
    exits 1 and ``status`` / the message name the command that fetches them."""
    tool = _build_tool()
    assert tool.main(['build']) == 0
    assert capsys.readouterr().out.strip() == library
    assert tool.main(['status']) == 0
    assert capsys.readouterr().out.strip() == library
    monkeypatch.delenv('FLATTEN_MM_REQUIRE_CPU_KERNELS', raising=False)
    monkeypatch.delenv(ort_ops.ENV_INCLUDE, raising=False)
    monkeypatch.setenv('FLATTEN_MM_EXT_DIR', str(tmp_path / 'empty_cache'))
    monkeypatch.setattr(ort_ops, '_SYSTEM_INCLUDES', ())
    monkeypatch.setattr(ort_ops, '_built', {})
    with pytest.warns(RuntimeWarning, match='could not be built'):
        assert tool.main(['build']) == 1
    err = capsys.readouterr().err
    assert err.startswith('not built: unavailable: no ONNX Runtime headers')
    assert f'{ort_ops.TOOL} fetch-headers' in err
