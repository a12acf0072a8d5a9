"""tools/swap_backbone.py and flatten_mm.swap.plan on real upstream configs.

Each produced config must parse, inherit its source, build, run the model's inference
graph on CPU (backbone + neck + heads at 224x256) with the neck / heads reading exactly
the channels the new backbone declares, and give no weight decay to norms, positional
tables and FLA scales. Configs that cannot be adapted raise a clear error and write
nothing; an existing output needs --force.
"""
import importlib.util
import os
import os.path as osp
import re

import pytest
import torch
from mmengine.config import Config

from flatten_mm.models.catalogue import backbone_catalogue, get_backbone_spec
from flatten_mm.swap.plan import (SwapError, load_source_config, plan_swap, swap_backbone,
                                      verify_config)

from conftest import REPO_ROOT

#: mmpretrain (installed by scripts/setup_env.sh) registers mmdet's `mmpretrain.` backbones
HAS_MMPRETRAIN = importlib.util.find_spec('mmpretrain') is not None

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
    # MaskFormer-style heads without a neck: the pixel decoder reads every map
    ('mmdet::mask2former/mask2former_r50_8xb2-lsj-50e_coco.py', 'flatten-pvt-v2-b0'),
    ('mmdet::maskformer/maskformer_r50_ms-16xb1-75e_coco.py', 'flatten-pvt-v2-b0'),
    ('mmseg::mask2former/mask2former_r50_8xb2-160k_ade20k-512x512.py', 'flatten-pvt-v2-b0'),
    ('mmseg::maskformer/maskformer_r50-d32_8xb2-160k_ade20k-512x512.py', 'flatten-pvt-v2-b0'),
    # HRFPN upsamples map i by 2**i and concatenates: any pyramid at strides 4-32
    ('mmdet::hrnet/cascade-mask-rcnn_hrnetv2p-w18_20e_coco.py', 'flatten-swin-t'),
    # K-Net: the kernel generator (UPerHead) of IterativeDecodeHead reads the maps
    ('mmseg::knet/knet-s3_swin-t_upernet_8xb2-adamw-80k_ade20k-512x512.py', 'flatten-pvt-v2-b0'),
    # CenterNet's CTResNetNeck reads the last of the maps (one in_channels)
    ('mmdet::centernet/centernet_r18_8xb16-crop512-140e_coco.py', 'flatten-pvt-v2-b0'),
    # no tensor-mode forward in mmdet: the predict graph runs (HTC's semantic head,
    # Cascade RPN)
    ('mmdet::htc/htc_r50_fpn_1x_coco.py', 'flatten-pvt-v2-b0'),
    ('mmdet::cascade_rpn/cascade-rpn_faster-rcnn_r50-caffe_fpn_1x_coco.py', 'flatten-pvt-v2-b0'),
    # Mask2Former VIS: the track head is a Mask2Former head over the frames of a clip
    ('mmdet::mask2former_vis/mask2former_r50_8xb2-8e_youtubevis2019.py', 'flatten-pvt-v2-b0'),
    # backbones of another scope (mmpretrain, not installed): exact geometry, imports dropped
    ('mmseg::poolformer/fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py', 'flatten-pvt-v2-b0'),
    ('mmdet::convnext/mask-rcnn_convnext-t-p4-w7_fpn_amp-ms-crop-3x_coco.py', 'flatten-pvt-v2-b0'),
    # three- and two-map necks (SimA through out_indices too)
    ('mmdet::deformable_detr/deformable-detr_r50_16xb2-50e_coco.py', 'sima-xcit-n12-p16'),
    ('mmdet::yolo/yolov3_d53_8xb8-320-273e_coco.py', 'flatten-pvt-v2-b0'),  # deepest first
    ('mmdet::rtmdet/rtmdet_l_convnext_b_4xb32-100e_coco.py', 'flatten-pvt-v2-b1'),
    ('mmdet::ssd/ssd300_coco.py', 'flatten-pvt-v2-b0'),
]

#: the backbone maps each MaskFormer-style head reads (all of them, in order)
_ALL_MAPS_HEADS = ('Mask2FormerHead', 'MaskFormerHead')


def _readers(cfg):
    """Channels read from the backbone, by map: neck in_channels (YOLOv3's neck lists
    the deepest map first), MaskFormer-style heads' in_channels (every map), or mmseg
    heads' in_channels for their in_index."""
    model = cfg.model
    if model.get('neck') is not None:
        neck = model.neck[0] if isinstance(model.neck, list) else model.neck
        if neck.type == 'CTResNetNeck':  # one in_channels: the last map
            return {'neck': (neck.in_channels, -1)}
        chans = [neck.in_channels] if isinstance(neck.in_channels, int) else neck.in_channels
        return {'neck': list(chans)[::-1] if neck.type == 'YOLOV3Neck' else list(chans)}
    for key in ('panoptic_head', 'track_head'):
        if model.get(key) is not None:
            return {key: list(model[key].in_channels)}
    out = {}
    for key in ('decode_head', 'auxiliary_head'):
        heads = model.get(key)
        for i, h in enumerate(heads if isinstance(heads, list) else [heads] if heads else []):
            if h.type == 'IterativeDecodeHead':  # K-Net: its kernel generator reads them
                h = h.kernel_generate_head
            if h.type in _ALL_MAPS_HEADS:
                out[f'{key}{i}'] = list(h.in_channels)
            else:
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
        h, w = (300, 300) if 'ssd300' in src else (224, 256)  # SSD300 needs its size
        assert s[2:] == (-(-h // stride), -(-w // stride))
    readers = _readers(cfg)
    assert readers
    for key, read in readers.items():
        if isinstance(read, list):  # reads every map, in order
            assert read == declared, key
        else:
            chans, idx = read
            if isinstance(idx, int):
                assert chans == declared[idx], key
            else:
                assert list(chans) == [declared[i] for i in idx], key
    if 'retinanet' in src:  # RetinaNet's FPN never read the stride-4 map: not requested
        assert src_cfg.model.neck.start_level == 1 and len(src_cfg.model.neck.in_channels) == 4
        assert cfg.model.neck.start_level == 0 and len(cfg.model.neck.in_channels) == 3
        assert tuple(bb.out_indices) == (1, 2, 3) and cfg.model.neck.num_outs == 5
    if src.startswith('mmseg') and src_cfg.model.get('pretrained'):
        assert cfg.model.pretrained is None
    # the written config is usable without the packages only the old backbone needed
    assert not [m for m in cfg.custom_imports.imports if m.startswith('mmpretrain')]
    Config.fromfile(str(out), import_custom_modules=True)  # imports what it lists
    if 'convnext' in src or 'poolformer' in src:
        assert src_cfg.model.backbone.type.startswith('mmpretrain.')
        assert [m for m in src_cfg.custom_imports.imports if m.startswith('mmpretrain')]
    if src_cfg.get('optim_wrapper', {}).get('constructor') == \
            'LearningRateDecayOptimizerConstructor':  # tied to ConvNeXt's parameter names
        assert cfg.optim_wrapper.constructor == 'DefaultOptimWrapperConstructor'
        assert 'decay_rate' not in cfg.optim_wrapper.paramwise_cfg
    if 'mask2former' in src:  # the pixel decoder's levels keep their strides
        head = (cfg.model.get('panoptic_head') or cfg.model.get('track_head')
                or cfg.model.decode_head)
        assert list(head.strides) == [4, 8, 16, 32]
    if 'ssd300' in src:  # SSDNeck passes its inputs through: out_channels start with them
        assert list(cfg.model.neck.out_channels[:2]) == declared
        assert list(cfg.model.bbox_head.in_channels) == list(cfg.model.neck.out_channels)


@pytest.mark.parametrize('src,name', [
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'flatten-pvt-t'),
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'flatten-cswin-t'),
    ('mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', 'flatten-swin-t'),
    ('mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', 'quadtree-a-pvt-v2-b0'),
    # layer-wise decay constructor of the source (ConvNeXt names) replaced
    ('mmdet::convnext/mask-rcnn_convnext-t-p4-w7_fpn_amp-ms-crop-3x_coco.py', 'flatten-pvt-v2-b0'),
])
def test_no_weight_decay_on_norms_tables_and_scales(tmp_path, src, name):
    """Build the optimizer of the produced config: every norm / positional table / FLA
    scale parameter of the backbone gets weight decay 0, its linear weights do not."""
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import init_default_scope
    from flatten_mm.apis.forward import build_model
    from flatten_mm.models.layers import FocusedLinearAttention
    from flatten_mm.models.layers.focused_linear_attention import _FocusedLinearRegion
    out = tmp_path / 'new.py'
    swap_backbone(src, name, str(out))
    cfg = Config.fromfile(str(out))
    model = build_model(cfg)
    init_default_scope('mmdet')
    wrapper_cfg = cfg.optim_wrapper
    if wrapper_cfg.get('type') == 'AmpOptimWrapper':  # CUDA only; grouping is the same
        wrapper_cfg = dict(wrapper_cfg, type='OptimWrapper')
        wrapper_cfg.pop('loss_scale', None)
    wrapper = build_optim_wrapper(model, wrapper_cfg)
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
    ('mmdet::faster_rcnn/faster-rcnn_r50-caffe_c4-1x_coco.py', 'flatten-pvt-v2-b0',
     r'no neck and its RoI head runs a ResLayer shared head .*C4 model'),
    # measured: a plain ViT returns its four maps at stride 16
    ('mmseg::vit/vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py', 'flatten-pvt-v2-b0',
     r'\(VisionTransformer\) returns all its 4 maps at stride 16: a single-stride'),
    # BEiT / MAE cannot run the 128x160 probe (position tables fixed to the training
    # size): measured again at their img_size, refused for what they are
    ('mmseg::beit/beit-base_upernet_8xb2-160k_ade20k-640x640.py', 'flatten-pvt-v2-b0',
     r'^the source backbone \(BEiT\) returns all its 4 maps at stride 16 \(measured at '
     r'640x640, the size it is built for: it cannot run a 128x160 image.*\): a '
     r'single-stride backbone such as a plain ViT'),
    ('mmseg::mae/mae-base_upernet_8xb2-amp-160k_ade20k-512x512.py', 'flatten-pvt-v2-b0',
     r'^the source backbone \(MAE\) returns all its 4 maps at stride 16 \(measured at '
     r'512x512, the size it is built for: it cannot run a 128x160 image.*\): a '
     r'single-stride backbone such as a plain ViT'),
    ('mmdet::detectors/cascade-rcnn_r50-rfp_1x_coco.py', 'flatten-swin-t',
     'neck RFP cannot be adapted: the recursive FPN feeds features back into a DetectoRS'),
    # a backbone of mmpretrain's scope whose geometry is not known exactly: not installed,
    # or (installed: scripts/setup_env.sh) its TIMMBackbone does not build with timm 1.x
    ('mmdet::timm_example/retinanet_timm-tv-resnet50_fpn_1x_coco.py', 'flatten-pvt-v2-b0',
     r"cannot measure the output strides of backbone 'mmpretrain.TIMMBackbone': building it "
     r'and running a 128x160 image failed' if HAS_MMPRETRAIN else
     r"backbone 'mmpretrain.TIMMBackbone': it is registered by mmpretrain, which is not "
     'installed'),
    # an mmpretrain config: swap_backbone writes detection / segmentation configs (without
    # mmpretrain it cannot even be read)
    ('mmdet::rtmdet/classification/cspnext-s_8xb256-rsb-a1-600e_in1k.py', 'flatten-pvt-v2-b0',
     r"^the config's default_scope is 'mmpretrain'; mmdet 3.x and mmseg 1.x configs are "
     'supported$' if HAS_MMPRETRAIN else
     r'^mmdet::rtmdet/classification/cspnext-s_8xb256-rsb-a1-600e_in1k.py cannot be read '
     r'without mmpretrain \(its _base_ configs are in that package\), which is not installed$'),
    # CSPNeXtPAFPN halves in_channels into GN(32) layers: b0's 160 -> 80 does not divide
    ('mmdet::rtmdet/rtmdet_l_convnext_b_4xb32-100e_coco.py', 'flatten-pvt-v2-b0',
     r'neck CSPNeXtPAFPN does not build with in_channels \[64, 160, 256\] of the new '
     r'backbone: .*num_channels \(80\) must be divisible by num_groups \(32\)'),
    # heads that read a real-time net's own branches, not a pyramid
    ('mmseg::ddrnet/ddrnet_23-slim_in1k-pre_2xb6-120k_cityscapes-1024x1024.py',
     'flatten-pvt-v2-b0', r'^decode_head DDRHead cannot be adapted: DDRHead reads DDRNet'),
    ('mmseg::pidnet/pidnet-s_2xb6-120k_1024x1024-cityscapes.py', 'flatten-pvt-v2-b0',
     r'^decode_head PIDHead cannot be adapted: PIDHead reads PIDNet'),
    # DPT's ViT returns (map, class token) pairs: measured from the maps, single-stride
    ('mmseg::dpt/dpt_vit-b16_8xb2-160k_ade20k-512x512.py', 'flatten-pvt-v2-b0',
     r'^the source backbone \(VisionTransformer\) returns all its 4 maps at stride 16: a '
     'single-stride'),
    # DC5: the heads read ResNet's single dilated map
    ('mmdet::faster_rcnn/faster-rcnn_r50-caffe-dc5_1x_coco.py', 'flatten-pvt-v2-b0',
     r'^the detector \(FasterRCNN\) has no neck and its heads \(rpn_head, roi_head\) read '
     r'the single map of the source backbone, at stride 16 \(a C4 / DC5 model'),
    # a change-detection Swin takes the two images of a pair stacked (6 channels)
    ('mmseg::swin/swin-tiny-patch4-window7_upernet_1xb8-20k_levir-256x256.py',
     'flatten-pvt-v2-b0', r'^the source backbone \(SwinTransformer\) takes 6-channel images '
     r'\(in_channels=6'),
    # its neck (a project's FPN with force_grad_on_level) does not build here at all
    ('mmdet::v3det/fcos_swinb_fpn_8x4_sample1e-3_mstrain_v3det_2x.py', 'flatten-pvt-v2-b0',
     r"^neck FPN does not build here, not even as the source config writes it: TypeError: "
     r".*'force_grad_on_level'"),
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'flatten-pvt-v9', 'unknown backbone'),
    ('mmdet::mask_rcnn/no-such-config.py', 'flatten-pvt-v2-b0', 'config not found'),
])
def test_unadaptable_configs_write_nothing(tmp_path, src, name, match):
    out = tmp_path / 'sub' / 'new.py'
    with pytest.raises(ValueError, match=match):
        swap_backbone(src, name, str(out))
    assert not out.exists() and not (tmp_path / 'sub').exists()


def test_plans_of_necks_with_their_own_rules():
    """FastFCN's JPU passes backbone maps through to the auxiliary head (its in_channels
    follow; the neck keeps the tuple JPU asserts); NAS-FCOS's searched FPN keeps its
    start_level and every map; a scoped name mmengine cannot parse as a _base_ (the '+'
    of gn+ws) is inherited by its file path."""
    spec = get_backbone_spec('flatten-pvt-v2-b0')  # 32, 64, 160, 256
    src = 'mmseg::fastfcn/fastfcn_r50-d32_jpu_aspp_4xb2-80k_cityscapes-512x1024.py'
    cfg, base = load_source_config(src)
    plan = plan_swap(cfg, base, spec)
    assert plan.model['backbone']['out_indices'] == (1, 2, 3)
    assert plan.model['neck'] == dict(in_channels=(64, 160, 256))
    assert cfg.model.auxiliary_head.in_index == 1 and cfg.model.auxiliary_head.in_channels == 1024
    assert plan.model['auxiliary_head'] == dict(in_channels=160)
    assert 'decode_head' not in plan.model  # reads the JPU's own fused map
    src = 'mmdet::nas_fcos/nas-fcos_r50-caffe_fpn_fcoshead-gn-head_4xb4-1x_coco.py'
    cfg, base = load_source_config(src)
    plan = plan_swap(cfg, base, spec)
    assert plan.model['backbone']['out_indices'] == (0, 1, 2, 3)
    assert plan.model['neck'] == dict(in_channels=[32, 64, 160, 256])  # start_level 1 kept
    src = 'mmdet::gn+ws/faster-rcnn_r50_fpn_gn-ws-all_1x_coco.py'
    cfg, base = load_source_config(src)
    assert base.endswith(osp.join('configs', 'gn+ws', 'faster-rcnn_r50_fpn_gn-ws-all_1x_coco.py'))
    assert osp.isabs(base)
    text = swap_backbone(src, 'flatten-pvt-v2-b0')
    assert f"_base_ = [{base!r}]" in text


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
    # no --checkpoint: said loudly (stderr and the config's header), with the official name
    err = capsys.readouterr().err
    assert 'warning: No checkpoint given: the backbone trains from random weights' in err
    assert '--checkpoint flatten_mm://flatten-pvt-v2-b0' in err
    assert '# No checkpoint given: the backbone trains from random weights' in out.read_text()
    assert cli.main([src, '--backbone', 'flatten-pvt-v2-b1', '-o', str(tmp_path / 'b1.py')]) == 0
    assert 'no official ImageNet weights exist for flatten-pvt-v2-b1' in capsys.readouterr().err
    assert cli.main([src, '--backbone', 'flatten-pvt-v2-b0', '--checkpoint',
                     'flatten_mm://flatten-pvt-v2-b0', '-o', str(tmp_path / 'c0.py')]) == 0
    assert 'random weights' not in capsys.readouterr().err
    assert "checkpoint='flatten_mm://flatten-pvt-v2-b0'" in (tmp_path / 'c0.py').read_text()
    assert cli.main([src, '--backbone', 'flatten-pvt-v2-b0', '-o', str(out)]) == 1
    assert '--force' in capsys.readouterr().err
    assert cli.main([src, '--backbone', 'nope', '-o', str(tmp_path / 'b.py')]) == 1
    assert 'unknown backbone' in capsys.readouterr().err and not (tmp_path / 'b.py').exists()
    # --smoke-data real: no silent synthetic fallback where the pipeline cannot run
    pan = 'mmdet::mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic.py'
    assert cli.main([pan, '--backbone', 'flatten-pvt-v2-b0', '-o', str(tmp_path / 'c.py'),
                     '--train-smoke', '--smoke-data', 'real', '--smoke-size', '64', '64']) == 1
    assert 'error: --smoke-data real: the train pipeline loads panoptic annotations' in \
        capsys.readouterr().err


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


@pytest.mark.parametrize('scope,backbone,strides,how', [
    # geometry exact from the config (no build): mmpretrain is not installed here
    ('mmseg', dict(type='mmpretrain.PoolFormer', arch='s12', out_indices=(0, 2, 4, 6)),
     (4, 8, 16, 32), 'config'),
    ('mmseg', dict(type='mmpretrain.PoolFormer', arch='s12', out_indices=(1, 6)), (8, 32),
     'config'),
    ('mmdet', dict(type='mmpretrain.ConvNeXt', arch='tiny'), (32, ), 'config'),
    ('mmseg', dict(type='ResNetV1c', depth=50, strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4)),
     (4, 8, 8, 8), 'config'),
    # measured by building the backbone and running a 128x160 image
    ('mmdet', dict(type='SwinTransformer', embed_dims=32, depths=(1, 1, 1, 1),
                   num_heads=(1, 1, 1, 1), out_indices=(1, 2, 3)), (8, 16, 32), None),
    ('mmseg', dict(type='MixVisionTransformer', embed_dims=16, num_layers=(1, 1, 1, 1),
                   num_heads=(1, 1, 1, 1)), (4, 8, 16, 32), None),
    ('mmdet', dict(type='CSPDarknet', deepen_factor=0.33, widen_factor=0.125), (8, 16, 32),
     None),
    ('mmdet', dict(type='CSPDarknet', deepen_factor=0.33, widen_factor=0.125,
                   out_indices=(1, 4)), (4, 32), None),
])
def test_source_strides_exact_or_measured(scope, backbone, strides, how):
    """Strides come from a family's exact geometry, or from a forward of the source
    backbone (channels then too); mmpretrain types are handled without mmpretrain."""
    from flatten_mm.swap.measure import measure_source_backbone
    geometry = measure_source_backbone(backbone, scope)
    assert geometry.strides == strides
    if how == 'config':
        assert geometry.how == 'config'
    else:
        assert geometry.how in ('meta', 'cpu') and len(geometry.channels) == len(strides)
    if backbone['type'] == 'CSPDarknet':  # widen 0.125: stages of 16, 32, 64, 128 channels
        assert geometry.channels == tuple((16, 32, 64, 128)[i - 1]
                                          for i in backbone.get('out_indices', (2, 3, 4)))


# one training iteration of the written config (CPU): real demo images through the
# config's train pipeline, or the synthetic batch where that pipeline cannot run here
TRAIN_SMOKE = [
    ('mmdet::mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic.py', 'flatten-pvt-v2-b0',
     ('loss_cls', 'loss_mask', 'loss_dice'),
     'synthetic: the train pipeline loads panoptic annotations (LoadPanopticAnnotations, '
     'CocoPanopticDataset not present); the demo data CocoDataset has instance annotations '
     'only'),
    ('mmseg::mask2former/mask2former_r50_8xb2-160k_ade20k-512x512.py', 'flatten-pvt-v2-b0',
     ('decode.loss_cls', 'decode.loss_mask', 'decode.loss_dice'),
     'demo: 2 images of demo data demo/data/ade_mini/ADEChallengeData2016 (ADE20KDataset '
     'not present)'),
    ('mmdet::mask2former_vis/mask2former_r50_8xb2-8e_youtubevis2019.py', 'flatten-pvt-v2-b0',
     ('loss_cls', 'loss_mask', 'loss_dice'),
     'synthetic: the model has 40 classes and the demo data (CocoDataset) labels 80; the '
     "config's dataset YouTubeVISDataset is not present"),
    ('mmdet::yolox/yolox_tiny_8xb8-300e_coco.py', 'sima-xcit-n12-p16',
     ('loss_cls', 'loss_bbox', 'loss_obj'),
     'demo: 2 images of demo data demo/data/coco_mini (CocoDataset not present)'),
    ('mmdet::convnext/mask-rcnn_convnext-t-p4-w7_fpn_amp-ms-crop-3x_coco.py', 'pvt-v2-b0',
     ('loss_rpn_cls', 'loss_cls', 'loss_mask'),
     'demo: 2 images of demo data demo/data/coco_mini (CocoDataset not present)'),
]


@pytest.mark.parametrize('src,name,loss_keys,batch', TRAIN_SMOKE,
                         ids=[osp.basename(s)[:-3] for s, _, _, _ in TRAIN_SMOKE])
def test_train_smoke(tmp_path, src, name, loss_keys, batch):
    """--train-smoke: one iteration of the written config gives finite losses of every
    head and a gradient to every trainable backbone parameter, and the config's optimizer
    steps; the report says which batch it used (demo images through the config's own
    pipeline, or synthetic and why)."""
    from flatten_mm.swap.smoke import train_smoke
    out = tmp_path / 'new.py'
    swap_backbone(src, name, str(out))
    report = train_smoke(str(out), input_hw=(128, 128), batch_size=2)
    assert report.batch.startswith(batch), report.batch
    assert f'batch: {report.batch}' in report.summary()
    for key in loss_keys:
        assert key in report.losses, (key, sorted(report.losses))
    assert all(torch.isfinite(torch.tensor(v)) for v in report.losses.values())
    assert report.backbone_params > 0 and report.no_grad == [] and report.nonfinite == []
    assert report.ok


def test_demo_batch_is_the_demo_data_through_the_config_pipeline():
    """The mmdet batch holds bundled COCO images with exactly their annotations (every
    non-crowd object, labels mapped like CocoDataset), resized by the config's own
    pipeline scaled to the smoke size; the mmseg batch holds ADE20K images cropped to it
    with labels in 0..149 / 255 (reduce_zero_label)."""
    import json
    from collections import Counter
    from flatten_mm.swap.demo import DEMO_ROOT, demo_batch
    cfg, _ = load_source_config('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py')
    batch, desc = demo_batch(cfg, (128, 128), batch_size=3, num_classes=80)
    assert desc.startswith('3 images of demo data demo/data/coco_mini (CocoDataset not '
                           "present) through the config's train pipeline (sizes x0.16")
    with open(osp.join(DEMO_ROOT, 'coco_mini', 'annotations', 'instances_train2017.json')) as f:
        coco = json.load(f)
    cat2label = {c['id']: i for i, c in enumerate(sorted(coco['categories'],
                                                         key=lambda c: c['id']))}
    for img, sample in zip(batch['inputs'], batch['data_samples']):
        assert sample.img_path.startswith(osp.join(DEMO_ROOT, 'coco_mini', 'train2017'))
        image = next(i for i in coco['images']
                     if i['file_name'] == osp.basename(sample.img_path))
        anns = [a for a in coco['annotations']
                if a['image_id'] == image['id'] and not a.get('iscrowd', 0)]
        assert len(anns) > 0
        assert Counter(sample.gt_instances.labels.tolist()) == Counter(
            cat2label[a['category_id']] for a in anns)
        assert len(sample.gt_instances.masks) == len(anns)
        # Resize (1333, 800) scaled by 128/800 to (213, 128), keep_ratio
        hw = tuple(img.shape[1:])
        assert img.dtype == torch.uint8 and max(hw) <= 213 and (max(hw) == 213 or min(hw) == 128)
        assert tuple(img.shape[1:]) == tuple(sample.img_shape)
    cfg, _ = load_source_config('mmseg::segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py')
    batch, desc = demo_batch(cfg, (128, 128), batch_size=2, num_classes=150)
    assert 'demo/data/ade_mini/ADEChallengeData2016 (ADE20KDataset not present)' in desc
    for img, sample in zip(batch['inputs'], batch['data_samples']):
        assert sample.img_path.startswith(osp.join(DEMO_ROOT, 'ade_mini'))
        # RandomResize (2048, 512) x [0.5, 2] and RandomCrop (512, 512), scaled by 1/4
        assert max(img.shape[1:]) <= 128 and min(img.shape[1:]) >= 64
        labels = set(sample.gt_sem_seg.data.unique().tolist())
        assert labels <= set(range(150)) | {255} and labels - {255}


def test_demo_batch_refuses_what_the_demo_data_cannot_feed():
    """The reasons the smoke falls back to a synthetic batch: fewer classes than the demo
    labels (Cityscapes' 19), panoptic annotations the demo data lacks."""
    from flatten_mm.swap.demo import DemoUnavailable, demo_batch
    cfg, _ = load_source_config('mmseg::ocrnet/ocrnet_hr18s_4xb2-40k_cityscapes-512x1024.py')
    with pytest.raises(DemoUnavailable, match=r"^the model has 19 classes and the demo data "
                       r"\(ADE20KDataset\) labels 150; the config's dataset CityscapesDataset "
                       'is not present$'):
        demo_batch(cfg, (128, 128), num_classes=19)
    cfg, _ = load_source_config('mmdet::mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic.py')
    with pytest.raises(DemoUnavailable, match='loads panoptic annotations'):
        demo_batch(cfg, (128, 128), num_classes=133)


def test_train_smoke_reports_backbone_parameters_without_gradient(tmp_path):
    """The check is not vacuous: RetinaNet's FPN (start_level=1) fed a SimA backbone's
    stride-4 map (what the swap wrote before it dropped unread maps) leaves that map's
    adapter without a gradient, and the report names it."""
    from flatten_mm.swap.smoke import train_smoke
    src = 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py'
    out = tmp_path / 'new.py'
    swap_backbone(src, 'sima-xcit-n12-p16', str(out))
    cfg = Config.fromfile(str(out))
    assert tuple(cfg.model.backbone.out_indices) == (1, 2, 3)
    cfg.model.backbone.out_indices = (0, 1, 2, 3)
    cfg.model.neck.in_channels = [128] * 4
    cfg.model.neck.start_level = 1
    report = train_smoke(cfg, input_hw=(128, 128))
    assert not report.ok and report.nonfinite == []
    assert report.no_grad and all(n.startswith('backbone.fpn1.') for n in report.no_grad)
    assert 'no gradient: backbone.fpn1.' in report.summary()
    ok = train_smoke(str(out), input_hw=(128, 128))  # as written: every parameter
    assert ok.ok and ok.no_grad == []


# families beyond the cases above: written config, one forward, one training iteration
# on real demo images through the config's own train pipeline (flatten-pvt-v2-b0, the
# smallest backbone, unless said; smoke size 128, SSDlite its 320 input_size; fewer
# RoIs). Options: size, backbone, train=False (forward only: DINO, whose training step
# at the 256 it needs costs ~90 s here; dev/swap_sweep.py trains it), batch
# (the expected batch: MaskFormer's panoptic pipeline cannot run on the demo data).
FAMILIES = [
    ('mmdet::fcos/fcos_r50-caffe_fpn_gn-head_1x_coco.py', 'loss_centerness', {}),
    ('mmdet::atss/atss_r50_fpn_1x_coco.py', 'loss_centerness', {}),
    ('mmdet::gfl/gfl_r50_fpn_1x_coco.py', 'loss_dfl', {}),
    ('mmdet::tood/tood_r50_fpn_1x_coco.py', 'loss_bbox', {}),  # reads the hub's epoch
    ('mmdet::solov2/solov2-light_r18_fpn_ms-3x_coco.py', 'loss_mask', {}),
    # 900 queries selected from the encoder's tokens: a 128x128 image has 340
    ('mmdet::dino/dino-4scale_r50_8xb2-12e_coco.py', None, dict(size=256, train=False)),
    ('mmdet::yolox/yolox_s_8xb8-300e_coco.py', 'loss_obj', {}),
    ('mmdet::rtmdet/rtmdet_s_8xb32-300e_coco.py', 'loss_bbox', {}),
    # CSPNeXtPAFPN GN(32) on half of each width: b0's 160 does not fit (refused above)
    ('mmdet::rtmdet/rtmdet_l_swin_b_4xb32-100e_coco.py', 'loss_bbox',
     dict(backbone='flatten-pvt-v2-b1')),
    ('mmdet::ssd/ssdlite_mobilenetv2-scratch_8xb24-600e_coco.py', 'loss_cls', {}),
    ('mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py', 'loss_mask', {}),
    ('mmdet::convnext/cascade-mask-rcnn_convnext-t-p4-w7_fpn_4conv1fc-giou_amp-ms-crop-3x_coco.py',
     's2.loss_mask', {}),
    ('mmdet::mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco.py', 'd0.loss_mask', {}),
    ('mmdet::maskformer/maskformer_swin-l-p4-w12_64xb1-ms-300e_coco.py', 'loss_dice',
     dict(batch='synthetic: the train pipeline loads panoptic annotations')),
    ('mmseg::segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py', 'decode.loss_ce', {}),
    ('mmseg::twins/twins_pcpvt-s_fpn_fpnhead_8xb4-80k_ade20k-512x512.py', 'decode.loss_ce', {}),
    ('mmseg::convnext/convnext-tiny_upernet_8xb2-amp-160k_ade20k-512x512.py', 'aux.loss_ce', {}),
    ('mmseg::mask2former/mask2former_swin-t_8xb2-160k_ade20k-512x512.py', 'decode.loss_mask',
     {}),
    ('mmseg::maskformer/maskformer_swin-t_upernet_8xb2-160k_ade20k-512x512.py',
     'decode.loss_dice', {}),
    ('mmseg::ocrnet/ocrnet_hr18s_4xb4-80k_ade20k-512x512.py', 'decode_1.loss_ce', {}),
    ('mmseg::segnext/segnext_mscan-t_1xb16-adamw-160k_ade20k-512x512.py', 'decode.loss_ce', {}),
]


@pytest.mark.parametrize('src,loss_key,opts', FAMILIES,
                         ids=[osp.basename(c[0])[:-3] for c in FAMILIES])
def test_family_forward_and_train_smoke(tmp_path, src, loss_key, opts):
    """The written config reads the new backbone's channels, runs one forward and one
    training iteration on the bundled demo images (its own pipeline): finite losses of
    its heads, a gradient for every trainable backbone parameter, an optimizer step."""
    from flatten_mm.swap.smoke import train_smoke
    name = opts.get('backbone', 'flatten-pvt-v2-b0')
    out = tmp_path / 'new.py'
    swap_backbone(src, name, str(out))
    cfg = Config.fromfile(str(out))
    spec = get_backbone_spec(name)
    model_backbone = spec.build(out_indices=cfg.model.backbone.out_indices)
    declared = list(model_backbone.out_channels)
    for key, read in _readers(cfg).items():
        if isinstance(read, list):
            assert read == declared, key
        else:
            chans, idx = read
            assert (chans == declared[idx] if isinstance(idx, int)
                    else list(chans) == [declared[i] for i in idx]), key
    size = cfg.get('input_size') or opts.get('size', 128)
    shapes = verify_config(cfg, input_hw=(size, size))
    assert [s[1] for s in shapes] == declared
    if not opts.get('train', True):
        return
    report = train_smoke(cfg, input_hw=(size, size), few_rois=True)
    expected = opts.get('batch', 'demo: 2 images of demo data demo/data/')
    assert report.batch.startswith(expected), report.batch
    assert loss_key in report.losses, sorted(report.losses)
    assert report.ok and report.no_grad == [] and report.nonfinite == [], report.summary()
    assert report.backbone_params == sum(1 for _ in model_backbone.parameters())


def test_sweep_representative_and_table(tmp_path):
    """dev/swap_sweep.py: the representative of a family is its first config
    in sorted file-name order with a model.backbone; wrappers are skipped with the
    reason; a refusal row carries the tool's reason; the CSV round-trips (a rerun replaces
    the family's row) and the Markdown counts the statuses."""
    from dev.sweeps.swap_sweep import (SweepRow, append_row, configs_root,
                                                read_rows, render_markdown,
                                                representative, sweep_one)
    root = configs_root('mmdet')
    first = sorted(f for f in os.listdir(osp.join(root, 'atss')) if f.endswith('.py'))[0]
    assert representative('mmdet', 'atss') == (f'mmdet::atss/{first}', '')
    src, why = representative('mmdet', 'qdtrack')
    assert src is None and 'QDTrack wraps a detector config under model.detector' in why
    row = sweep_one('mmseg', 'pspnet', 'flatten-pvt-v2-b0', str(tmp_path))
    assert row.status == 'refused' and 'Dilated' in row.reason and row.forward == ''
    csv_path = str(tmp_path / 'sweep.csv')
    append_row(csv_path, row)
    append_row(csv_path, SweepRow('mmdet', 'atss', 'atss/x.py', 'failed', 'forward: boom'))
    append_row(csv_path, SweepRow('mmdet', 'atss', 'atss/x.py', 'adapted', '', '128', 'ok',
                                  'ok', 'yes', '184/184', 'demo: 2 images'))
    rows = read_rows(csv_path)
    assert [(r.family, r.status) for r in rows] == [('pspnet', 'refused'), ('atss', 'adapted')]
    md = render_markdown(rows, 'flatten-pvt-v2-b0', 128)
    assert 'Status: 1 adapted, 1 refused (2 families).' in md
    assert '| mmdet | atss | `x.py` | adapted |  | 128 | ok | ok | yes | 184/184 | demo |' in md


def test_mmsyncbn_built_as_bn(tmp_path):
    """MMSyncBN (mmcv's, needs a process group to be built) becomes BN wherever it is in
    a model config, once noted; torch's SyncBN is left (reverted after the build). The
    swapped Simple Copy-Paste config (MMSyncBN heads) does not build as written on one
    CPU process and builds with the fallback, as verify_config / the sweep build it."""
    from flatten_mm.apis.forward import build_model
    from flatten_mm.swap.smoke import mmsyncbn_as_bn
    from dev.sweeps.swap_sweep_all import build_config
    model = dict(neck=dict(norm_cfg=dict(type='SyncBN')),
                 roi_head=dict(bbox_head=[dict(norm_cfg=dict(type='MMSyncBN', eps=1e-3)),
                                          dict(norm_cfg=dict(type='MMSyncBN'))]),
                 head=(dict(norm_cfg=dict(type='GN')), ))
    notes = []
    mmsyncbn_as_bn(model, notes)
    assert model == dict(neck=dict(norm_cfg=dict(type='SyncBN')),
                         roi_head=dict(bbox_head=[dict(norm_cfg=dict(type='BN', eps=1e-3)),
                                                  dict(norm_cfg=dict(type='BN'))]),
                         head=(dict(norm_cfg=dict(type='GN')), ))
    assert notes == ['MMSyncBN built as BN (no process group on one CPU)']
    notes = []
    mmsyncbn_as_bn(model, notes)
    assert notes == []  # nothing left to replace: no note
    cfg = _swapped(tmp_path, 'mmdet::simple_copy_paste/mask-rcnn_r50_fpn_rpn-2conv_'
                   '4conv1fc_syncbn-all_32xb2-ssj-270k_coco.py')
    assert cfg.model.roi_head.bbox_head.norm_cfg.type == 'MMSyncBN'
    with pytest.raises(ValueError, match='Default process group has not been initialized'):
        build_model(cfg)
    build_config(cfg)
    assert cfg.model.roi_head.bbox_head.norm_cfg.type == 'MMSyncBN'  # the input unchanged


def _swapped(tmp_path, src, backbone='flatten-pvt-v2-b0') -> Config:
    """``src`` swapped to ``backbone``, written under ``tmp_path`` and read back."""
    out = str(tmp_path / 'swapped.py')
    swap_backbone(src, backbone, out)
    return Config.fromfile(out)


class _Stop(Exception):
    pass


@pytest.mark.parametrize('src,head', [
    ('mmdet::htc/htc_r50_fpn_1x_coco.py', 'FusedSemanticHead'),
    ('mmdet::scnet/scnet_r50_fpn_1x_coco.py', 'SCNetSemanticHead'),
], ids=['htc', 'scnet'])
def test_train_smoke_semantic_head_batch(tmp_path, monkeypatch, src, head):
    """HTC / SCNet: the semantic head needs stuff label maps, which the demo data lacks:
    --smoke-data real refuses with that reason; auto goes to the synthetic batch without
    trying the demo pipeline."""
    from flatten_mm.swap import demo as swap_demo, smoke as swap_smoke
    cfg = _swapped(tmp_path, src)
    with pytest.raises(swap_demo.DemoUnavailable) as err:
        swap_smoke.train_smoke(cfg, input_hw=(64, 64), data='real')
    assert str(err.value) == (f'the RoI head has a semantic head ({head}), which needs stuff '
                              'label maps; the demo data has instance annotations only')

    def no_demo(*a, **k):
        raise AssertionError('the demo pipeline was tried')

    seen = []

    def synthetic(scope, model_cfg, input_hw, batch_size, seed=0):
        seen.append((scope, model_cfg.roi_head.semantic_head.type, tuple(input_hw)))
        raise _Stop

    monkeypatch.setattr(swap_smoke, 'demo_batch', no_demo)
    monkeypatch.setattr(swap_smoke, 'synthetic_batch', synthetic)
    with pytest.raises(_Stop):
        swap_smoke.train_smoke(cfg, input_hw=(64, 64), data='auto')
    assert seen == [('mmdet', head, (64, 64))]


def test_train_smoke_builds_the_optimizer_before_the_forward(tmp_path, monkeypatch):
    """DDQ-DETR registers bbox_head.aux_reg_branches under its decoder in its first
    training forward; an optimizer built after that sees those parameters twice and
    torch refuses. train_smoke builds it first, as mmengine's Runner does."""
    from flatten_mm.swap import smoke as swap_smoke
    from flatten_mm.apis.forward import build_model
    cfg = _swapped(tmp_path, 'mmdet::ddq/ddq-detr-4scale_r50_8xb2-12e_coco.py')
    model = build_model(cfg).train()
    notes = []
    wrapper = swap_smoke._build_optim_wrapper(model, cfg, notes)
    grouped = [p for g in wrapper.optimizer.param_groups for p in g['params']]
    assert len(grouped) == len({id(p) for p in grouped}) == \
        sum(1 for p in model.parameters())
    # what DDQDETR.pre_decoder does in training (mmdet 3.3 ddq_detr.py)
    model.decoder.aux_reg_branches = model.bbox_head.aux_reg_branches
    with pytest.raises(ValueError, match='some parameters appear in more than one parameter '
                       'group'):
        swap_smoke._build_optim_wrapper(model, cfg, notes)

    state = []
    real = swap_smoke._build_optim_wrapper

    def record(model, cfg, notes):
        state.append('aux_reg_branches' in model.decoder._modules)
        real(model, cfg, notes)
        raise _Stop

    monkeypatch.setattr(swap_smoke, '_build_optim_wrapper', record)
    with pytest.raises(_Stop):
        swap_smoke.train_smoke(cfg, input_hw=(128, 128), data='synthetic', few_rois=True)
    assert state == [False]  # built on the model before any forward


def test_train_smoke_amp_wrapper_on_cpu(tmp_path):
    """An AmpOptimWrapper config (CUDA-only) is stepped as OptimWrapper on CPU, without
    loss_scale / dtype, and says so."""
    from flatten_mm.swap.smoke import _build_optim_wrapper
    from flatten_mm.apis.forward import build_model
    from mmengine.optim import OptimWrapper
    cfg = _swapped(tmp_path, 'mmdet::atss/atss_r18_fpn_8xb8-amp-lsj-200e_coco.py')
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'
    notes = []
    wrapper = _build_optim_wrapper(build_model(cfg), cfg, notes)
    assert type(wrapper) is OptimWrapper
    assert notes == ['AmpOptimWrapper run as OptimWrapper (CPU)']
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'  # the config itself unchanged


def test_fcn_head_without_convs_reads_the_new_width(tmp_path):
    """Segmenter's linear head (FCNHead, num_convs=0: the classifier reads the backbone
    map itself, channels == in_channels asserted) takes the new backbone's width for
    both; found by dev/swap_sweep.py --all-configs (the build failed)."""
    from dev.sweeps.swap_sweep_all import build_config
    cfg = _swapped(tmp_path, 'mmseg::segmenter/segmenter_vit-s_fcn_8xb1-160k_ade20k-512x512.py')
    head = cfg.model.decode_head
    assert (head.type, head.num_convs) == ('FCNHead', 0)
    # the ViT's one map is at stride 16: b0's stride-16 map
    width = dict(zip(get_backbone_spec('flatten-pvt-v2-b0').out_strides,
                     get_backbone_spec('flatten-pvt-v2-b0').out_channels))[16]
    assert head.in_channels == head.channels == width
    build_config(cfg)


def test_smoke_models_are_initialised_without_reading_checkpoints(tmp_path):
    """train_smoke / verify_config build with init_weights=True: parameters that only
    init_weights sets (SSD's L2Norm scale, created as uninitialised memory) get their
    value, every Pretrained init_cfg (here a checkpoint path that does not exist) is
    removed instead of read, and two builds under one seed are identical (before,
    the L2Norm weight held whatever was in memory: losses of 1e26 or NaN that changed
    from one build to the next)."""
    from flatten_mm.apis.forward import build_model, strip_pretrained
    cfg_dict = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint='x.pth')),
                    neck=dict(init_cfg=[dict(type='Xavier'),
                                        dict(type='Pretrained', checkpoint='y.pth')]),
                    heads=[dict(pretrained='z.pth', init_cfg=dict(type='Normal'))])
    strip_pretrained(cfg_dict)
    assert cfg_dict == dict(backbone=dict(init_cfg=None), neck=dict(init_cfg=[dict(
        type='Xavier')]), heads=[dict(pretrained=None, init_cfg=dict(type='Normal'))])
    out = tmp_path / 'ssd.py'
    swap_backbone('mmdet::ssd/ssd300_coco.py', 'flatten-pvt-v2-b0', str(out),
                  checkpoint=str(tmp_path / 'missing.pth'))
    cfg = Config.fromfile(str(out))
    assert cfg.model.backbone.init_cfg.type == 'Pretrained'
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        states.append(build_model(cfg, init_weights=True).state_dict())
    scale = cfg.model.neck.l2_norm_scale
    assert torch.equal(states[0]['neck.l2_norm.weight'],
                       torch.full_like(states[0]['neck.l2_norm.weight'], scale))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
