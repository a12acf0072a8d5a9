"""Every config in configs/ parses, builds its model on CPU and runs one forward of the
backbone (+ neck) at a small size; the neck / decode head reads exactly the channels the
backbone declares."""
import glob
import os.path as osp

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope

from conftest import REPO_ROOT

# detection / segmentation configs (_base_/: fragments, not models); the ImageNet classifiers
# of configs/mmpretrain have their own tests (test_pretrain_configs.py)
CONFIGS = sorted(p for p in glob.glob(osp.join(REPO_ROOT, 'configs', '**', '*.py'), recursive=True)
                 if '_base_' not in p.split(osp.sep) and 'mmpretrain' not in p.split(osp.sep))


def test_configs_exist():
    assert len(CONFIGS) >= 9


@pytest.mark.parametrize('path', CONFIGS, ids=[osp.relpath(p, osp.join(REPO_ROOT, 'configs'))
                                              for p in CONFIGS])
def test_config_builds_and_runs(path):
    cfg = Config.fromfile(path)
    scope = cfg.get('default_scope')
    assert scope in ('mmdet', 'mmseg'), f'{path}: default_scope {scope!r}'
    pytest.importorskip(scope)
    assert 'flatten_mm.models' in cfg.custom_imports['imports']
    assert cfg.model.backbone.type.startswith('flatten_mm.')
    init_default_scope(scope)
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    model = MODELS.build(cfg.model).eval()
    backbone = model.backbone
    declared = list(backbone.out_channels)
    if getattr(model, 'with_neck', False) or getattr(model, 'neck', None) is not None:
        assert list(cfg.model.neck.in_channels) == declared
    else:  # e.g. UperNet reads the backbone maps directly
        head = cfg.model.decode_head
        in_index = head.get('in_index', list(range(len(declared))))
        in_index = in_index if isinstance(in_index, (list, tuple)) else [in_index]
        assert list(head.in_channels) == [declared[i] for i in in_index]
    if 'auxiliary_head' in cfg.model and cfg.model.auxiliary_head is not None:
        aux = cfg.model.auxiliary_head
        for a in (aux if isinstance(aux, list) else [aux]):
            assert a.in_channels == declared[a.in_index]
    x = torch.randn(1, 3, 224, 256)
    with torch.no_grad():
        feats = backbone(x)
        assert [f.shape[1] for f in feats] == declared
        for f, s in zip(feats, backbone.out_strides):
            assert tuple(f.shape[-2:]) == (-(-224 // s), -(-256 // s))
        if getattr(model, 'neck', None) is not None:
            model.neck(feats)


# ---------------------------------------------------------------------------------------
# Declared recipes. Each row is the training recipe a config claims to follow, taken from
# shared/spec/results.md (section in the comment) -- what the config must say, not a
# measured result. Keys: drop_path = backbone drop_path_rate; lr / wd = AdamW learning rate
# / weight decay; epochs (mmdet, MultiStepLR steps at 2/3 and 11/12) or iters (mmseg);
# batch = images per GPU; train = 'ms-crop' (Swin/XCiT multi-scale + crop AutoAugment) or
# 'ss' (single scale 1333x800); test = 'align32' (keep-ratio 2048x512 + AlignResize 32).
def _rows(template, names, **recipe):
    return {template.format(n): dict(recipe) for n in names}


RECIPES = {
    # 1.4 Mask R-CNN 1x FLatten-PVT-T, PVT protocol; lr: the PVT repository's Mask R-CNN
    # configs (2e-4), RetinaNet 1e-4 -- the one rule for the whole PVT family
    **_rows('mmdet/flatten_pvt/mask-rcnn_flatten-pvt-{}_fpn_1x_coco.py', 'ts',
            drop_path=0.1, lr=2e-4, wd=1e-4, epochs=12, batch=2, train='ss'),
    **_rows('mmdet/flatten_pvt/retinanet_flatten-pvt-{}_fpn_1x_coco.py', 'ts',
            drop_path=0.1, lr=1e-4, wd=1e-4, epochs=12, batch=2, train='ss'),
    **_rows('mmdet/flatten_pvt_v2/mask-rcnn_flatten-pvt-v2-{}_fpn_1x_coco.py', ('b0', 'b1', 'b2'),
            drop_path=0.1, lr=2e-4, wd=1e-4, epochs=12, batch=2, train='ss'),
    **_rows('mmdet/flatten_pvt_v2/retinanet_flatten-pvt-v2-{}_fpn_1x_coco.py', ('b0', 'b1', 'b2'),
            drop_path=0.1, lr=1e-4, wd=1e-4, epochs=12, batch=2, train='ss'),
    # 1.4 Swin protocol (corrected): 1x and 3x both multi-scale + crop; drop path Mask R-CNN
    # T 1x 0.1, T 3x 0.2, Cascade T 3x 0.2, Cascade S 3x 0.2
    'mmdet/flatten_swin/mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py':
        dict(drop_path=0.1, lr=1e-4, wd=0.05, epochs=12, batch=2, train='ms-crop'),
    'mmdet/flatten_swin/mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-3x_coco.py':
        dict(drop_path=0.2, lr=1e-4, wd=0.05, epochs=36, batch=2, train='ms-crop'),
    **_rows('mmdet/flatten_swin/cascade-mask-rcnn_flatten-swin-{}-p4-w7_fpn_4conv1fc-giou_'
            'ms-crop-3x_coco.py', 'ts',
            drop_path=0.2, lr=1e-4, wd=0.05, epochs=36, batch=2, train='ms-crop'),
    # 1.4 Semantic FPN FLatten-PVT-T, PVT paper protocol (the FLatten-PVTv2 and hybrid PVT
    # configs declare the same protocol); test keep-ratio + AlignResize to multiples of 32
    'mmseg/flatten_pvt/fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py':
        dict(drop_path=0.1, lr=1e-4, wd=1e-4, iters=80000, batch=4, test='align32'),
    **_rows('mmseg/flatten_pvt_v2/fpn_flatten-pvt-v2-{}_4xb4-80k_ade20k-512x512.py',
            ('b0', 'b1', 'b2'), drop_path=0.1, lr=1e-4, wd=1e-4, iters=80000, batch=4,
            test='align32'),
    'mmseg/hybrid/fpn_pvt-v2-b1-fla12-sima34_4xb4-80k_ade20k-512x512.py':
        dict(drop_path=0.1, lr=1e-4, wd=1e-4, iters=80000, batch=4, test='align32'),
    # 1.4 UperNet FLatten-Swin-T/S (Swin protocol) and CSwin-T: drop path 0.3
    **_rows('mmseg/flatten_swin/upernet_flatten-swin-{}_8xb2-160k_ade20k-512x512.py', 'ts',
            drop_path=0.3, lr=6e-5, wd=0.01, iters=160000, batch=2),
    'mmseg/flatten_cswin/upernet_flatten-cswin-t_8xb2-160k_ade20k-512x512.py':
        dict(drop_path=0.3, lr=6e-5, wd=0.01, iters=160000, batch=2),
    # 2.1 / 2.2 / 2.3 / 2.4 QuadTree (official configs)
    **_rows('mmdet/quadtree_pvt_v2/retinanet_quadtree-b-pvt-v2-{}_fpn_1x_coco.py',
            ('b0', 'b1', 'b2', 'b3', 'b4'),
            drop_path=0.1, lr=1e-4, wd=1e-4, epochs=12, batch=2, train='ss'),
    **_rows('mmdet/quadtree_pvt_v2/mask-rcnn_quadtree-b-pvt-v2-{}_fpn_1x_coco.py',
            ('b0', 'b1', 'b2', 'b3', 'b4'),
            drop_path=0.1, lr=2e-4, wd=1e-4, epochs=12, batch=2, train='ss'),
    **_rows('mmdet/quadtree_pvt_v2/mask-rcnn_quadtree-b-pvt-v2-{}_fpn_ms-crop-3x_coco.py',
            ('b0', 'b1', 'b2', 'b3', 'b4'),
            drop_path=0.1, lr=1e-4, wd=0.05, epochs=36, batch=2, train='ms-crop'),
    **_rows('mmseg/quadtree_pvt_v2/fpn_quadtree-b-pvt-v2-{}_8xb2-160k_ade20k-512x512.py',
            ('b0', 'b1', 'b2', 'b3', 'b4'),
            drop_path=0.1, lr=6e-5, wd=0.01, iters=160000, batch=2, test='align32'),
    # 3 XCiT dense protocol (SimA's own is unverified); drop path per size: backbones.md
    **_rows('mmdet/sima_xcit/mask-rcnn_sima-xcit-{}_fpn_ms-crop-3x_coco.py',
            ('t12-p16', 's12-p16', 's12-p8', 's24-p16', 'm24-p16'),
            lr=1e-4, wd=0.05, epochs=36, batch=2, train='ms-crop'),
    **_rows('mmseg/sima_xcit/fpn_sima-xcit-{}_8xb2-80k_ade20k-512x512.py',
            ('t12-p16', 's12-p16', 's24-p16', 'm24-p16'), lr=6e-5, wd=0.01, iters=80000, batch=2),
    **_rows('mmseg/sima_xcit/upernet_sima-xcit-{}_8xb2-160k_ade20k-512x512.py',
            ('t12-p16', 's12-p16', 's24-p16', 'm24-p16'),
            lr=6e-5, wd=0.01, iters=160000, batch=2),
}

# PVT-protocol Semantic FPN configs: test pipeline = keep-ratio resize + AlignResize 32
PVT_PROTOCOL_FPN = sorted(k for k, v in RECIPES.items() if v.get('test') == 'align32')


def _rel(path):
    return osp.relpath(path, osp.join(REPO_ROOT, 'configs')).replace(osp.sep, '/')


_LOADED = {}


def _load(path):
    """``Config.fromfile`` once per file (the tests below only read the configs)."""
    if path not in _LOADED:
        _LOADED[path] = Config.fromfile(path)
    return _LOADED[path]


def _cfg(rel):
    return _load(osp.join(REPO_ROOT, 'configs', rel))


def _mmdet_config(rel):
    """A config shipped inside the installed mmdet package (``.mim/configs``)."""
    import importlib.util
    root = importlib.util.find_spec('mmdet').submodule_search_locations[0]
    return Config.fromfile(osp.join(root, '.mim', 'configs', rel))


def _types(pipeline):
    return [t['type'] for t in pipeline]


def test_recipe_table_names_existing_configs():
    rels = {_rel(p) for p in CONFIGS}
    assert sorted(set(RECIPES) - rels) == []


@pytest.mark.parametrize('rel', sorted(RECIPES))
def test_config_follows_declared_recipe(rel):
    recipe, cfg = RECIPES[rel], _cfg(rel)
    if 'drop_path' in recipe:
        assert cfg.model.backbone.drop_path_rate == recipe['drop_path']
    opt = cfg.optim_wrapper.optimizer
    assert (opt.type, opt.lr, opt.weight_decay) == ('AdamW', recipe['lr'], recipe['wd'])
    assert cfg.train_dataloader.batch_size == recipe['batch']
    if 'epochs' in recipe:
        n = recipe['epochs']
        assert cfg.train_cfg.max_epochs == n
        steps = [s for s in cfg.param_scheduler if s.type == 'MultiStepLR']
        assert len(steps) == 1 and steps[0].milestones == {12: [8, 11], 36: [27, 33]}[n]
        assert steps[0].end == n
    else:
        n = recipe['iters']
        assert cfg.train_cfg.max_iters == n
        assert cfg.param_scheduler[-1].type == 'PolyLR' and cfg.param_scheduler[-1].end == n
    train = cfg.train_dataloader.dataset.pipeline
    if recipe.get('train') == 'ms-crop':
        # the Swin / XCiT multi-scale + crop AutoAugment pipeline, exactly as mmdet ships it
        ref = _mmdet_config('swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py')
        assert train == ref.train_dataloader.dataset.pipeline
        assert cfg.train_pipeline == train  # the dumped `train_pipeline` is the one used
    elif recipe.get('train') == 'ss':
        assert 'RandomChoice' not in _types(train)
        resize = [t for t in train if t.type == 'Resize']
        assert len(resize) == 1 and tuple(resize[0].scale) == (1333, 800)
        assert resize[0].keep_ratio


def test_flatten_swin_t_mask_rcnn_1x_is_the_multiscale_crop_recipe():
    """results.md 1.4: the published Swin-T 1x baseline (43.7 / 39.8) and the FLatten row
    compared with it are the Swin repository's mstrain 480-800 + crop 1x recipe."""
    cfg = _cfg('mmdet/flatten_swin/mask-rcnn_flatten-swin-t-p4-w7_fpn_ms-crop-1x_coco.py')
    pipeline = cfg.train_dataloader.dataset.pipeline
    choice = [t for t in pipeline if t.type == 'RandomChoice']
    assert len(choice) == 1
    short_sides = {s[0] for s in choice[0].transforms[0][0].scales}
    assert short_sides == set(range(480, 801, 32))
    crop = choice[0].transforms[1][1]
    assert (crop.type, crop.crop_type, tuple(crop.crop_size)) == (
        'RandomCrop', 'absolute_range', (384, 600))
    assert cfg.train_cfg.max_epochs == 12
    assert cfg.model.backbone.drop_path_rate == 0.1


@pytest.mark.parametrize('rel', PVT_PROTOCOL_FPN)
def test_pvt_protocol_fpn_tests_with_align_resize(rel):
    cfg = _cfg(rel)
    assert 'flatten_mm.datasets' in cfg.custom_imports['imports']
    for loader in ('val_dataloader', 'test_dataloader'):
        pipeline = cfg[loader].dataset.pipeline
        resizes = [t for t in pipeline if 'Resize' in t.type]
        assert len(resizes) == 1, (loader, _types(pipeline))
        r = resizes[0]
        assert (r.type, tuple(r.scale), r.keep_ratio, r.size_divisor) == (
            'flatten_mm.AlignResize', (2048, 512), True, 32)
        # annotations are loaded after the resize (the metric runs at the original size)
        assert _types(pipeline).index('LoadAnnotations') > _types(pipeline).index(r.type)
    assert cfg.test_pipeline == cfg.val_dataloader.dataset.pipeline


@pytest.mark.parametrize('path', CONFIGS, ids=[_rel(p) for p in CONFIGS])
def test_config_has_auto_scale_lr(path):
    # as mmdet's schedules: the lr is for batch 16; enable with --auto-scale-lr
    assert _load(path).auto_scale_lr == dict(enable=False, base_batch_size=16)


def test_config_names_follow_their_schedule_and_pipeline():
    """`ms-crop` in a detection config's name iff it trains with the multi-scale + crop
    pipeline; `3x` iff 36 epochs; no legacy `_fpn_3x_` names."""
    for path in CONFIGS:
        name = osp.basename(path)
        assert '_fpn_3x_' not in name, name
        if not _rel(path).startswith('mmdet/'):
            continue
        cfg = _load(path)
        ms_crop = 'RandomChoice' in _types(cfg.train_dataloader.dataset.pipeline)
        assert ('_ms-crop-' in name) == ms_crop, name
        assert ('3x' in name) == (cfg.train_cfg.max_epochs == 36), name


def _references():
    """(file, config path) for every config a metafile, README or doc points to."""
    import re
    refs = []
    for pattern in ('configs/**/metafile.yml', 'configs/**/README.md', 'README.md',
                    'docs/**/*.md', 'tools/**/*.py'):
        for f in glob.glob(osp.join(REPO_ROOT, pattern), recursive=True):
            text = open(f, encoding='utf-8').read()
            pattern = r'(?<![\w/.-])configs/(?:mmdet|mmseg|quickstart|_base_)/[\w./-]+?\.py'
            for m in re.finditer(pattern, text):
                refs.append((f, m.group(0)))
            if f.endswith('README.md') and 'configs' + osp.sep in f:  # relative links
                for m in re.finditer(r'\]\(([\w.-]+\.py)\)', text):
                    refs.append((f, _rel(osp.join(osp.dirname(f), m.group(1)))))
    return refs


def test_referenced_configs_exist():
    refs = _references()
    assert len(refs) > 50
    # docs may name a family of sizes with a `bN` placeholder
    missing = [(osp.relpath(f, REPO_ROOT), r) for f, r in refs
               if not glob.glob(osp.join(REPO_ROOT, r if r.startswith('configs/')
                                         else osp.join('configs', r)).replace('-bN_', '-b?_'))]
    assert missing == []


def test_sima_configs_use_syncbn_and_block_indices():
    sima = [p for p in CONFIGS if 'sima_xcit' in _rel(p)]
    assert len(sima) >= 14
    for path in sima:
        backbone = _load(path).model.backbone
        assert backbone.norm_cfg == dict(type='SyncBN', requires_grad=True), path
        assert 'block_indices' in backbone, path
        assert all(0 <= i <= 3 for i in backbone.get('out_indices', (0, 1, 2, 3))), path


def test_sima_retinanet_reads_three_maps():
    cfg = _cfg('mmdet/sima_xcit/retinanet_sima-xcit-s12-p16_fpn_1x_coco.py')
    assert tuple(cfg.model.backbone.out_indices) == (1, 2, 3)
    assert cfg.model.neck.in_channels == [384, 384, 384]
    assert cfg.model.neck.start_level == 0
    init_default_scope('mmdet')
    from mmdet.registry import MODELS
    model = MODELS.build(cfg.model)
    assert not hasattr(model.backbone, 'fpn1')  # nothing left without a gradient under DDP
    x = torch.randn(1, 3, 128, 160)
    loss = sum(f.sum() for f in model.neck(model.backbone(x)))
    loss.backward()
    no_grad = [n for n, p in model.backbone.named_parameters()
               if p.requires_grad and p.grad is None]
    no_grad += [n for n, p in model.neck.named_parameters() if p.grad is None]
    assert no_grad == []


# Top-level keys of a resolved config that mean something to mmengine's runner or are the
# usual variables of the mmdet / mmseg base configs (`train_pipeline` ...). Anything else
# is a helper that leaked out of a fragment.
STANDARD_KEYS = {
    # mmengine Runner.from_cfg
    'model', 'work_dir', 'train_dataloader', 'val_dataloader', 'test_dataloader',
    'train_cfg', 'val_cfg', 'test_cfg', 'auto_scale_lr', 'optim_wrapper', 'param_scheduler',
    'val_evaluator', 'test_evaluator', 'default_hooks', 'custom_hooks', 'data_preprocessor',
    'load_from', 'resume', 'launcher', 'env_cfg', 'log_processor', 'log_level',
    'visualizer', 'default_scope', 'randomness', 'experiment_name', 'custom_imports',
    # variables of mmdet's / mmseg's _base_ configs and their TTA settings
    'dataset_type', 'data_root', 'backend_args', 'train_pipeline', 'test_pipeline',
    'vis_backends', 'tta_model', 'tta_pipeline', 'img_ratios', 'crop_size', 'norm_cfg',
    # mmseg's schedule bases define `optimizer` and build `optim_wrapper` from it; our
    # configs replace `optim_wrapper` (with `_delete_`), so this one is upstream's SGD
    'optimizer',
}


@pytest.mark.parametrize('path', CONFIGS, ids=[_rel(p) for p in CONFIGS])
def test_config_has_no_leaked_helper_variables(path):
    keys = set(_load(path).to_dict())
    assert sorted(keys - STANDARD_KEYS) == []
