"""Attention visualisation (flatten_mm.analysis.visualize, tools/analysis/visualize_attention.py).

The PNGs must be valid and of the input image's size; the maps they show must be the
attention the operators actually compute (checked against the operators' own kernels),
the FLA rank plot must show rank <= head dim without DWC and full rank with it, and the
QuadTree selection must be the one the attention core uses.
"""
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flatten_mm.analysis.visualize import (dwc_matrix, find_attention_layers, fla_features,
                                           fla_query_map, fla_rank_matrices,
                                           quadtree_selection, sima_norm_maps, sima_query_map,
                                           visualize_attention)
from flatten_mm.models.backbones import PVTv2
from flatten_mm.models.layers import (FocusedLinearAttention, FocusedLinearAttentionQKV,
                                      QuadTreeAttention, SimAAttention)
from flatten_mm.models.layers.focused_linear_attention import focused_linear_core_reference
from flatten_mm.models.layers.quadtree_attention import quadtree_attention_core
from flatten_mm.models.layers.sima_attention import sima_core

from conftest import REPO_ROOT

torch.set_num_threads(1)
TINY = dict(embed_dims=(16, 32, 32, 32), depths=(1, 1, 1, 2), num_heads=(1, 2, 2, 2),
            mlp_ratios=(2, 2, 2, 2))
IMAGE_HW = (97, 131)


def _image():
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, size=(*IMAGE_HW, 3), dtype=np.uint8)


def _assert_png(path, size=None):
    assert osp.isfile(path)
    with open(path, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == 'PNG'
        if size is not None:
            assert img.size == size  # (W, H)


@pytest.fixture(scope='module')
def hybrid():
    torch.manual_seed(0)
    return PVTv2(arch=TINY, pretrain_img_size=64, attn_cfg=[
        dict(type='FocusedLinearAttention'),
        dict(type='QuadTreeAttention', num_levels=3, topk=3),
        dict(type='SimAAttention'),
        dict(type='SpatialReductionAttention', sr_ratio=1)]).eval()


@pytest.mark.parametrize('stage,names', [
    (1, ['fla_map_s1b0.png', 'fla_rank_s1b0.png']),
    (2, ['quadtree_level0_s2b0.png', 'quadtree_level1_s2b0.png', 'quadtree_level2_s2b0.png']),
    (3, ['sima_map_s3b0.png', 'sima_qnorm_s3b0.png', 'sima_knorm_s3b0.png']),
])
def test_pngs_have_the_image_size(hybrid, tmp_path, stage, names):
    paths = visualize_attention(_image(), hybrid, str(tmp_path), stage=stage, size=160,
                                query_xy=(30.0, 70.0))
    assert [osp.basename(p) for p in paths] == names
    for p in paths:
        _assert_png(p, None if 'rank' in p else (IMAGE_HW[1], IMAGE_HW[0]))


def test_unsupported_layer_and_stage(hybrid, tmp_path):
    with pytest.raises(NotImplementedError, match='SpatialReductionAttention'):
        visualize_attention(_image(), hybrid, str(tmp_path), stage=4, size=160)
    with pytest.raises(ValueError, match='stages: \\[1, 2, 3, 4\\]'):
        visualize_attention(_image(), hybrid, str(tmp_path), stage=7, size=160)


def test_find_layers(hybrid):
    layers = find_attention_layers(hybrid)
    assert [(la.stage, la.block, la.kind) for la in layers] == [
        (0, 0, 'fla'), (1, 0, 'quadtree'), (2, 0, 'sima'), (3, 0, 'other'), (3, 1, 'other')]


# ---------------------------------------------------------------- the maps are the attention
@pytest.mark.parametrize('module', [
    FocusedLinearAttention(32, 2, pretrain_hw_shape=(4, 4)),
    FocusedLinearAttentionQKV(32, 2, pretrain_hw_shape=(4, 4)),
])
def test_fla_map_is_the_linear_attention(module):
    """sum_j a_ij v_j over the map equals the operator's attention (without DWC)."""
    torch.manual_seed(1)
    with torch.no_grad():
        module.scale.normal_()
        module.positional_encoding.normal_()
    hw = (6, 7)
    x = torch.randn(1, 42, 32)
    phi_q, phi_k, v, kv_hw, region = fla_features(module, x, hw)
    assert kv_hw == hw and region is module
    q = module.q(x) if hasattr(module, 'q') else module.qkv(x).chunk(3, -1)[0]
    k_raw = (module.kv(x).chunk(2, -1)[0] if hasattr(module, 'kv') else
             module.qkv(x).chunk(3, -1)[1])
    pe = F.interpolate(module.positional_encoding.reshape(1, 4, 4, 32).permute(0, 3, 1, 2),
                       size=hw, mode='bilinear', align_corners=False).flatten(2).transpose(1, 2)
    with torch.no_grad():
        ref = focused_linear_core_reference(q, k_raw + pe, v, module.scale, 2, 3)
    for i in (0, 17, 41):
        heads = []
        for hd in range(2):
            w = phi_k[0, :, hd * 16:(hd + 1) * 16] @ phi_q[0, i, hd * 16:(hd + 1) * 16]
            heads.append((w / w.sum()) @ v[0, :, hd * 16:(hd + 1) * 16])
        torch.testing.assert_close(torch.cat(heads), ref[0, i].float(), rtol=1e-4, atol=1e-5)
        m, grid = fla_query_map(module, x, hw, i)
        assert grid == hw and m.shape == hw
        assert float(m.sum()) == pytest.approx(1.0, abs=1e-5) and float(m.min()) >= 0


def test_dwc_matrix_is_the_convolution():
    w = torch.randn(5, 5, dtype=torch.float64)
    img = torch.randn(6, 9, dtype=torch.float64)
    ref = F.conv2d(img[None, None], w[None, None], padding=2)[0, 0].reshape(-1)
    torch.testing.assert_close(dwc_matrix(w, (6, 9)) @ img.reshape(-1), ref)


def test_rank_restoration():
    """rank(A) <= d; the DWC term makes the matrix full rank (the paper's Fig.)."""
    module = FocusedLinearAttention(32, 4, pretrain_hw_shape=(7, 7))
    torch.nn.init.normal_(module.dwc.weight, std=0.3)
    A, AD = fla_rank_matrices(module, torch.randn(1, 49, 32), (7, 7), head=1, channel=2)
    assert A.shape == AD.shape == (49, 49)
    assert torch.linalg.matrix_rank(A) <= 8
    assert torch.linalg.matrix_rank(AD) == 49


def test_sima_map_is_the_attention():
    module = SimAAttention(32, 2).eval()
    x = torch.randn(1, 20, 32)
    qkv = module.qkv(x).reshape(1, 20, 3, 2, 16).permute(2, 0, 3, 1, 4)
    out = sima_core(qkv[0], qkv[1], qkv[2])  # (1, h, N, d)
    for i in (0, 13):
        m = sima_query_map(module, x, (4, 5), i)
        # mean over heads of (row i of the matrix) . V_h = mean of the heads' outputs
        rows = [torch.einsum('hd,hnd->hn', *_norm_qk(qkv, i, h)) for h in range(2)]
        torch.testing.assert_close(m.reshape(-1), torch.stack(rows).mean(0).reshape(-1))
        recon = torch.stack([rows[h][0] @ qkv[2][0, h] for h in range(2)])
        torch.testing.assert_close(recon, out[0, :, i], rtol=1e-4, atol=1e-6)
    qn, kn = sima_norm_maps(module, x, (4, 5))
    assert qn.shape == kn.shape == (4, 5) and (qn > 0).all()


def _norm_qk(qkv, i, h):
    q = F.normalize(qkv[0][0, h:h + 1], p=1.0, dim=-2)
    k = F.normalize(qkv[1][0, h:h + 1], p=1.0, dim=-2)
    return q[:, i], k


@pytest.mark.parametrize('variant', ['B', 'A'])
def test_quadtree_selection_matches_the_core(variant):
    """With one head, identity values at the finest level and only the finest level's
    message kept, the core's output row of a query is its weight on every finest key:
    exactly the candidates / weights ``quadtree_selection`` reports."""
    torch.manual_seed(3)
    C, hw, S = 64, (8, 8), 3
    module = QuadTreeAttention(C, 1, attn_type=variant, num_levels=S, topk=(3, 5)).eval()
    x = torch.randn(1, 64, C)
    x_map = x.transpose(1, 2).reshape(1, C, *hw)
    q, k = module.q_proj(x_map), module.k_proj(x_map)
    qs, ks = [q], [k]
    for _ in range(S - 1):
        qs.append(F.avg_pool2d(qs[-1], 2))
        ks.append(F.avg_pool2d(ks[-1], 2))
    eye = torch.eye(64).reshape(64, 8, 8)[None]  # channel c = 1 at token c
    values = [torch.zeros(1, C, 2, 2), torch.zeros(1, C, 4, 4), eye]
    weights = torch.tensor([0., 0., 1.]) if variant == 'B' else None
    with torch.no_grad():
        out = quadtree_attention_core(qs[::-1], ks[::-1], values, 1, module.topks, variant,
                                      level_weights=weights)[0, 0]  # (64 tokens, 64)
    for qy, qx in ((0, 0), (3, 6), (7, 2)):
        levels = quadtree_selection(module, x, hw, (qy, qx))
        assert [lv.grid for lv in levels] == [(2, 2), (4, 4), (8, 8)]
        assert [lv.selected.shape[-1] for lv in levels[:-1]] == [3, 5]
        finest = levels[-1]
        row = torch.zeros(64).index_add_(0, finest.candidates[0], finest.weights[0])
        torch.testing.assert_close(row, out[qy * 8 + qx], rtol=1e-5, atol=1e-6)
        # candidates of each level are the children of the previous level's selection
        for prev, cur in zip(levels[:-1], levels[1:]):
            parents = {(i // prev.grid[1], i % prev.grid[1]) for i in prev.selected[0].tolist()}
            kids = {(i // cur.grid[1] // 2, i % cur.grid[1] // 2)
                    for i in cur.candidates[0].tolist()}
            assert kids == parents


def test_cli_writes_pngs(tmp_path):
    img = tmp_path / 'img.png'
    Image.fromarray(_image()).save(img)
    out = tmp_path / 'maps'
    res = subprocess.run(
        [sys.executable, osp.join(REPO_ROOT, 'tools', 'analysis', 'visualize_attention.py'),
         str(img), '--backbone', 'flatten-pvt-v2-b0', '--stage', '2', '--size', '96',
         '--query', '10', '20', '-o', str(out)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr
    paths = res.stdout.split()
    assert [osp.basename(p) for p in paths] == ['fla_map_s2b0.png', 'fla_rank_s2b0.png']
    _assert_png(paths[0], (IMAGE_HW[1], IMAGE_HW[0]))
    _assert_png(paths[1])
    bad = subprocess.run(
        [sys.executable, osp.join(REPO_ROOT, 'tools', 'analysis', 'visualize_attention.py'),
         str(img), '--backbone', 'flatten-pvt-v9', '-o', str(out)], capture_output=True,
        text=True, cwd=REPO_ROOT)
    assert bad.returncode == 1 and 'unknown backbone' in bad.stderr


def test_checkpoint_is_loaded_and_checked(tmp_path):
    from flatten_mm.models.catalogue import get_backbone_spec
    from flatten_mm.analysis.visualize import build_backbone
    ref = get_backbone_spec('flatten-pvt-v2-b0').build()
    path = str(tmp_path / 'b0.pth')
    torch.save(ref.state_dict(), path)
    model = build_backbone('flatten-pvt-v2-b0', path)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match='does not fit'):
        visualize_attention(_image(), 'quadtree-b-pvt-v2-b0', str(tmp_path / 'maps'),
                            checkpoint=path, size=192)
