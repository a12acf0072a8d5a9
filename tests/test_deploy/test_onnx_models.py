"""Whole models through ``tools/deployment/export_onnx.py`` (issue #17): the Semantic FPN
and RetinaNet configs of FLatten-PVTv2-b0 (real neck and heads, the backbone shrunk to a
tiny arch for speed) export with a dynamic size and match PyTorch in ONNX Runtime at two
sizes; Mask R-CNN exports whole (RPN proposals with NMS, RoI bbox and mask heads)."""
import os.path as osp
import sys

import pytest

# the deploy extra (pip install -e .[deploy]; scripts/setup_env.sh installs it): skipped
# without it, an error in CI (tests/required_packages.py)
pytest.importorskip('onnxruntime')
import onnx  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, osp.join(ROOT, 'tools', 'deployment'))
import export_onnx as tool  # noqa: E402

from flatten_mm.deploy import OnnxModel, read_metadata  # noqa: E402

TINY = ("dict(_delete_=True, embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), "
        "num_heads=(1, 2, 2, 4), mlp_ratios=(2, 2, 2, 2))")
CASES = {
    'seg': ('configs/mmseg/flatten_pvt_v2/'
            'fpn_flatten-pvt-v2-b0_4xb4-80k_ade20k-512x512.py', ['seg_logits']),
    'retinanet': ('configs/mmdet/flatten_pvt_v2/retinanet_flatten-pvt-v2-b0_fpn_1x_coco.py',
                  [f'head_{k}_l{i}' for k in ('cls_score', 'bbox_pred') for i in range(5)]),
    'mask_rcnn': ('configs/mmdet/flatten_pvt_v2/mask-rcnn_flatten-pvt-v2-b0_fpn_1x_coco.py',
                  ['rois', 'rpn_scores', 'roi_cls_score', 'roi_bbox_pred', 'roi_mask_preds']),
}


def _tiny_config(tmp_path, config):
    """The config with the backbone shrunk (neck in_channels to match)."""
    path = tmp_path / 'tiny.py'
    path.write_text(f"_base_ = [{osp.join(ROOT, config)!r}]\n"
                    f"model = dict(backbone=dict(arch={TINY}),"
                    " neck=dict(in_channels=[8, 16, 24, 32]))\n")
    return str(path)


@pytest.mark.parametrize('case', sorted(CASES))
def test_config_exports_through_tool(case, tmp_path, capsys):
    config, outputs = CASES[case]
    out = str(tmp_path / f'{case}.onnx')
    rc = tool.main([_tiny_config(tmp_path, config), '-o', out, '--shape', '96', '128',
                    '--dynamic', '--check', '--check-shape', '128', '96'])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert 'valid input sizes: H in [32, 4096], W in [32, 4096] (dynamic)' in text
    assert 'check 96x128' in text and 'check 128x96' in text and 'OK: worst' in text
    meta = read_metadata(out)
    assert meta['dynamic'] == 'true' and meta['kind'] == ('segmentor' if case == 'seg' else
                                                          'detector')
    session = OnnxModel(out)
    assert session.output_names == outputs
    if case == 'mask_rcnn':
        assert 'note: two-stage detector, whole mode=' in text and 'NonMaxSuppression' in text
        assert text.count('without a counterpart: 0 / 0') == 2, text  # both sizes, all rois
        ops = {n.op_type for n in onnx.load(out).graph.node}
        assert {'NonMaxSuppression', 'RoiAlign'} <= ops
    with pytest.raises(ValueError, match='valid for inputs from 32x32'):
        session.check((1, 3, 16, 96))
