"""tools/swap_backbone.py and flatten_mm.analysis.swap on real upstream configs.

Each produced config must parse, inherit its source, build, run the model's inference
graph on CPU (backbone + neck + heads at 224x256) with the neck / heads reading exactly
the channels the new backbone declares, and give no weight decay to norms, positional
tables and FLA scales. Configs that cannot be adapted raise a clear error and write
nothing; an existing output needs --force.
"""
import os
import os.path as osp
import re

import pytest
import torch
from mmengine.config import Config

from flatten_mm.analysis.catalogue import backbone_catalogue, get_backbone_spec
from flatten_mm.analysis.swap import (SwapError, load_source_config, plan_swap, swap_backbone,
                                      verify_config)

from conftest import REPO_ROOT

pytest.importorskip('mmdet')
pytest.importorskip('mmseg')
torch.set_num_threads(1)

# (upstream config, new backbone); small variants keep the test fast
UPSTREAM = [
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'flatten-pvt-v2-b0'),
    ('mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', 'quadtree-b-pvt-v2-b0'),
    ('mmdet::cascade_rcnn/cascade-mask-rcnn_r50_fpn_1x_coco.py', 'flatten-swin-t'),
    # mmdet 3.3.0 ships no Cascade Mask R-CNN Swin-T config; its only Cascade + Swin
    # config is the V3Det Swin-B one
    ('mmdet::v3det/cascade_rcnn_swinb_fpn_8x4_sample1e-3_mstrain_v3det_2x.py', 'flatten-cswin-t'),
    ('mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', 'flatten-pvt-t'),
    ('mmseg::sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py', 'sima-xcit-n12-p16'),
    ('mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
     'flatten-swin-t'),
    ('mmseg::upernet/upernet_r50_4xb4-80k_ade20k-512x512.py', 'pvt-v2-b0'),
    # DETR-like necks reading a subset of strides
    ('mmdet::detr/detr_r50_8xb2-150e_coco.py', 'flatten-pvt-v2-b0'),
    # a config file (not a scoped name): this repository's Cascade Mask R-CNN
    # FLatten-Swin-T (4conv1fc GIoU heads), swapped to another family
    (osp.join(REPO_ROOT, 'configs', 'mmdet', 'flatten_swin',
              'cascade-mask-rcnn_flatten-swin-t-p4-w7_fpn_4conv1fc-giou_ms-crop-3x_coco.py'),
     'quadtree-b-pvt-v2-b0'),
]


def _readers(cfg):
    """Channels read from the backbone: neck in_channels, or the heads' (mmseg, no neck)."""
    model = cfg.model
    if model.get('neck') is not None:
        neck = model.neck[0] if isinstance(model.neck, list) else model.neck
        return {'neck': list(neck.in_channels)}
    out = {}
    for key in ('decode_head', 'auxiliary_head'):
        heads = model.get(key)
        for i, h in enumerate(heads if isinstance(heads, list) else [heads] if heads else []):
            out[f'{key}{i}'] = (h.in_channels, h.in_index)
    return out


@pytest.mark.parametrize('src,name', UPSTREAM, ids=[osp.basename(s)[:-3] for s, _ in UPSTREAM])
def test_swapped_upstream_config_builds_and_runs(tmp_path, src, name):
    out = tmp_path / 'new.py'
    swap_backbone(src, name, str(out), checkpoint='checkpoints/some_backbone.pth')
    text = out.read_text()
    assert f"_base_ = [{src!r}]" in text and '_delete_=True' in text  # scoped name or path
    cfg = Config.fromfile(str(out))
    spec = get_backbone_spec(name)
    bb = cfg.model.backbone
    assert bb.type == spec.type and bb.arch == spec.arch
    assert bb.init_cfg == dict(type='Pretrained', checkpoint='checkpoints/some_backbone.pth')
    assert 'flatten_mm.models' in cfg.custom_imports.imports
    # what the source read at strides s, the new config reads from our map at stride s
    src_cfg, _ = load_source_config(src)
    plan = plan_swap(src_cfg, src, spec)
    assert plan.spec is spec
    # build + inference graph (RoI heads on 20 fixed proposals)
    shapes = verify_config(cfg)
    model_backbone = spec.build(out_indices=bb.out_indices)
    declared = list(model_backbone.out_channels)
    assert [s[1] for s in shapes] == declared
    for s, stride in zip(shapes, model_backbone.out_strides):
        assert s[2:] == (-(-224 // stride), -(-256 // stride))
    readers = _readers(cfg)
    if 'neck' in readers:
        assert readers['neck'] == declared
    else:
        for key, (chans, idx) in readers.items():
            if isinstance(idx, int):
                assert chans == declared[idx], key
            else:
                assert list(chans) == [declared[i] for i in idx], key
    if 'retinanet' in src:  # RetinaNet's FPN keeps start_level=1 with all 4 inputs
        assert cfg.model.neck.start_level == 1 and len(cfg.model.neck.in_channels) == 4
    if src.startswith('mmseg') and src_cfg.model.get('pretrained'):
        assert cfg.model.pretrained is None


@pytest.mark.parametrize('src,name', [
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'flatten-pvt-t'),
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'flatten-cswin-t'),
    ('mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', 'flatten-swin-t'),
    ('mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', 'quadtree-a-pvt-v2-b0'),
])
def test_no_weight_decay_on_norms_tables_and_scales(tmp_path, src, name):
    """Build the optimizer of the produced config: every norm / positional table / FLA
    scale parameter of the backbone gets weight decay 0, its linear weights do not."""
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import init_default_scope
    from flatten_mm.analysis.forward import build_model
    from flatten_mm.models.layers import FocusedLinearAttention
    from flatten_mm.models.layers.focused_linear_attention import _FocusedLinearRegion
    out = tmp_path / 'new.py'
    swap_backbone(src, name, str(out))
    cfg = Config.fromfile(str(out))
    model = build_model(cfg)
    init_default_scope('mmdet')
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    decay = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            decay[names[id(p)]] = group['weight_decay']
    base_wd = cfg.optim_wrapper.optimizer.weight_decay
    modules = dict(model.named_modules())
    checked = 0
    for pname, p in model.backbone.named_parameters():
        full = f'backbone.{pname}'
        owner, _, leaf = full.rpartition('.')
        mod = modules[owner]
        special = (isinstance(mod, (torch.nn.LayerNorm, torch.nn.GroupNorm,
                                    torch.nn.modules.batchnorm._BatchNorm))
                   or leaf in ('positional_encoding', 'pos_embed', 'relative_position_bias_table')
                   or (leaf == 'scale' and isinstance(mod, (FocusedLinearAttention,
                                                            _FocusedLinearRegion))))
        if special:
            assert decay[full] == 0, full
            checked += 1
        elif isinstance(mod, torch.nn.Linear) and leaf == 'weight':
            assert decay[full] == base_wd, full
    assert checked > 0


def test_sima_backbone_gets_the_maps_a_three_map_neck_reads():
    """A neck reading strides 8, 16, 32 (DINO's 4-scale ChannelMapper) gets a SimA
    backbone with ``out_indices=(1, 2, 3)`` like any other family: three maps, three
    channels, no stride-4 adapter built; the XCiT block choice keeps its default."""
    from flatten_mm.models.backbones.sima_xcit import default_block_indices
    src = 'mmdet::dino/dino-4scale_r50_8xb2-12e_coco.py'
    spec = get_backbone_spec('sima-xcit-t12-p16')
    src_cfg, _ = load_source_config(src)
    plan = plan_swap(src_cfg, src, spec)
    backbone = plan.model['backbone']
    assert backbone['out_indices'] == (1, 2, 3) and 'block_indices' not in backbone
    assert plan.model['neck']['in_channels'] == [192] * 3
    model = spec.build(out_indices=backbone['out_indices'])
    assert model.out_strides == (8, 16, 32) and model.out_channels == (192, ) * 3
    assert not hasattr(model, 'fpn1') and model.block_indices == default_block_indices(12)


@pytest.mark.parametrize('src,name,match', [
    ('mmseg::pspnet/pspnet_r50-d8_4xb2-40k_cityscapes-512x1024.py', 'flatten-pvt-v2-b0',
     r'strides \(4, 8, 8, 8\).*Dilated'),
    ('mmdet::faster_rcnn/faster-rcnn_r50-caffe_c4-1x_coco.py', 'flatten-pvt-v2-b0', 'no neck'),
    ('mmseg::vit/vit_deit-b16-ln_mln_upernet_8xb2-160k_ade20k-512x512.py', 'flatten-pvt-v2-b0',
     "backbone type 'VisionTransformer'"),
    ('mmdet::hrnet/cascade-mask-rcnn_hrnetv2p-w18_20e_coco.py', 'flatten-swin-t',
     "backbone type 'HRNet'"),
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'flatten-pvt-v9', 'unknown backbone'),
    ('mmdet::mask_rcnn/no-such-config.py', 'flatten-pvt-v2-b0', 'config not found'),
])
def test_unadaptable_configs_write_nothing(tmp_path, src, name, match):
    out = tmp_path / 'sub' / 'new.py'
    with pytest.raises(ValueError, match=match):
        swap_backbone(src, name, str(out))
    assert not out.exists() and not (tmp_path / 'sub').exists()


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / 'new.py'
    out.write_text('# mine\n')
    src = 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py'
    with pytest.raises(SwapError, match='--force'):
        swap_backbone(src, 'flatten-pvt-v2-b0', str(out))
    assert out.read_text() == '# mine\n'
    swap_backbone(src, 'flatten-pvt-v2-b0', str(out), force=True)
    assert 'flatten_mm.FLattenPVTv2' in out.read_text()
    assert not [f for f in os.listdir(tmp_path) if '.tmp' in f]


def test_cli(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        'swap_cli', osp.join(REPO_ROOT, 'tools', 'swap_backbone.py'))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(['--list']) == 0
    listing = capsys.readouterr().out
    for name in backbone_catalogue():
        assert f'\n{name} ' in listing
    assert re.search(r'^flatten-pvt-v2-b1\s+flatten_mm\.FLattenPVTv2\s+b1\s+12\.42M\s+'
                     r'64,128,320,512\s+4,8,16,32$', listing, flags=re.M)
    out = tmp_path / 'a.py'
    src = 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py'
    assert cli.main([src, '--backbone', 'flatten-pvt-v2-b0', '-o', str(out)]) == 0
    assert out.exists()
    assert cli.main([src, '--backbone', 'flatten-pvt-v2-b0', '-o', str(out)]) == 1
    assert '--force' in capsys.readouterr().err
    assert cli.main([src, '--backbone', 'nope', '-o', str(tmp_path / 'b.py')]) == 1
    assert 'unknown backbone' in capsys.readouterr().err and not (tmp_path / 'b.py').exists()


def test_catalogue_covers_every_arch():
    """Every distinct arch of every registered class has a name; names are unique and
    the declared channels / params come from the classes."""
    from flatten_mm.models.backbones import (FLattenCSWin, FLattenPVT, FLattenPVTv2,
                                             FLattenSwin, PVTv2, QuadTreePVTv2, SimAXCiT)
    cat = backbone_catalogue()
    for cls in (FLattenPVTv2, FLattenPVT, FLattenSwin, FLattenCSWin, QuadTreePVTv2, SimAXCiT,
                PVTv2):
        distinct = {repr(sorted(v.items())) for v in cls.arch_zoo.values()}
        archs = {repr(sorted(cls.arch_zoo[s.arch].items())) for s in cat.values()
                 if s.cls_name == cls.__name__}
        assert archs == distinct, cls.__name__
    for name in ('flatten-pvt-v2-b1', 'flatten-swin-t', 'flatten-cswin-s', 'sima-xcit-s12-p16',
                 'quadtree-b-pvt-v2-b2', 'quadtree-a-pvt-v2-b0', 'flatten-pvt-t'):
        assert name in cat
    spec = cat['flatten-pvt-v2-b0']
    model = spec.build()
    assert spec.out_channels == tuple(model.out_channels) == (32, 64, 160, 256)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match='Did you mean: flatten-pvt-v2-b1'):
        get_backbone_spec('flatten-pvtv2-b1')
