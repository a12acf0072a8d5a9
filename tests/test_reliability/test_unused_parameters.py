"""Every shipped recipe trains under DDP without ``find_unused_parameters``.

torch's DDP (as wrapped by mmengine, and mmdet/mmseg's ``tools/train.py`` leave
``find_unused_parameters=False``) expects a gradient for every parameter with
``requires_grad`` in every iteration; a parameter that gets none (e.g. a backbone adapter
whose map the neck never reads) makes the second iteration fail with "Expected to have
finished reduction in the prior iteration before starting a new one".

For EVERY config under ``configs/`` (globbed, ``configs/_base_`` excluded) this builds
the whole model from the config (its registry / default scope), runs one training step
(the config's own ``data_preprocessor`` on a synthetic batch of 2 images with random boxes,
labels and masks, or a random segmentation map; ``mode='loss'``, ``parse_losses``,
backward) and asserts that every parameter with ``requires_grad`` received a gradient.

To keep CPU time low the backbone gets a tiny custom arch of its own class (SimA keeps its
depth so the config's ``block_indices`` stay valid), and the channels that read the
backbone (neck ``in_channels``, or the heads' for mmseg without a neck) follow the tiny
widths; the config's ``out_indices`` / ``block_indices``, number of maps read, neck and
heads are kept as written. Images are 96x128, or the smallest multiple of 32 the backbone
accepts (``min_input_size``, QuadTree's top-k); the mmseg pad size follows. Two-stage
detectors sample fewer proposals / RoIs (``train_cfg`` numbers only, the same parameters
are used). SyncBN is reverted to BN as mmengine's runner does in a single process.
"""
import copy
import glob
import os
import os.path as osp

import pytest
import torch

from conftest import REPO_ROOT

pytest.importorskip('mmdet')
pytest.importorskip('mmseg')

from flatten_mm.swap.smoke import synthetic_batch  # noqa: E402

CONFIG_ROOT = osp.join(REPO_ROOT, 'configs')
# detection / segmentation configs; every parameter of the ImageNet classifiers
# (configs/mmpretrain) is checked in tests/test_pretrain_configs.py
CONFIGS = sorted(p for p in glob.glob(osp.join(CONFIG_ROOT, '**', '*.py'), recursive=True)
                 if osp.relpath(p, CONFIG_ROOT).split(os.sep)[0] not in ('_base_', 'mmpretrain')
                 and '_base_' not in p.split(os.sep))
HW = (96, 128)  # smallest synthetic image size (multiple of 32: no padding in mmdet)


def test_configs_are_found():
    assert len(CONFIGS) >= 20, CONFIGS
    assert any('sima' in p for p in CONFIGS) and any('mmseg' in p for p in CONFIGS)


def tiny_backbone(backbone: dict) -> dict:
    """The config's backbone with a tiny arch of the same class (other keys unchanged)."""
    from backbone_specs import TINY_ARCHS

    import flatten_mm.models  # noqa: F401
    from flatten_mm.registry import MODELS
    backbone = copy.deepcopy(backbone)
    name = str(backbone['type']).rsplit('.', 1)[-1]
    assert name in TINY_ARCHS, f'backbone {name}: add a tiny arch to backbone_specs.py'
    if name == 'SimAXCiT':
        cls = MODELS.get(name)
        arch, patch = cls._split_patch_suffix(backbone.get('arch', 's12'),
                                              backbone.get('patch_size'))
        depth = arch['depth'] if isinstance(arch, dict) else cls.arch_zoo[arch]['depth']
        backbone.update(arch=dict(embed_dims=32, depth=depth, num_heads=2), patch_size=patch)
    else:
        backbone['arch'] = copy.deepcopy(TINY_ARCHS[name]['kwargs']['arch'])
    backbone['init_cfg'] = None
    return backbone


def shrink(model_cfg, out_channels) -> None:
    """Make the readers of the backbone maps read the tiny widths (same number of maps)."""
    neck = model_cfg.get('neck')
    if neck is not None:
        first = neck[0] if isinstance(neck, (list, tuple)) else neck
        assert len(first['in_channels']) == len(out_channels), (
            f'the neck reads {len(first["in_channels"])} maps, the backbone returns '
            f'{len(out_channels)}')
        first['in_channels'] = list(out_channels)
        return
    for key in ('decode_head', 'auxiliary_head'):
        heads = model_cfg.get(key)
        for head in heads if isinstance(heads, (list, tuple)) else [heads] if heads else []:
            idx = head.get('in_index', -1)
            head['in_channels'] = (out_channels[idx] if isinstance(idx, int) else
                                   [out_channels[i] for i in idx])


def fewer_samples(train_cfg) -> None:
    """Fewer RPN proposals and sampled RoIs (CPU time; every head still trains)."""
    if not train_cfg:
        return
    if train_cfg.get('rpn_proposal'):
        train_cfg.rpn_proposal.update(nms_pre=200, max_per_img=64)
    rcnn = train_cfg.get('rcnn')
    for stage in rcnn if isinstance(rcnn, (list, tuple)) else [rcnn] if rcnn else []:
        if stage.get('sampler'):
            stage.sampler.num = 32


def build_tiny(path):
    """``(cfg, model, image size)`` for the config at ``path`` (see the module doc)."""
    from mmengine.config import Config
    from mmengine.model import revert_sync_batchnorm

    from flatten_mm.apis.forward import build_model
    from flatten_mm.registry import MODELS
    cfg = Config.fromfile(path)
    cfg.model.backbone = tiny_backbone(cfg.model.backbone)
    backbone = MODELS.build(copy.deepcopy(cfg.model.backbone))
    shrink(cfg.model, list(backbone.out_channels))
    hw = tuple(max(a, -(-b // 32) * 32) for a, b in zip(HW, backbone.min_input_size()))
    if cfg.default_scope == 'mmseg':
        cfg.model.data_preprocessor.size = hw
    fewer_samples(cfg.model.get('train_cfg'))
    return cfg, revert_sync_batchnorm(build_model(cfg)).train(), hw


@pytest.mark.parametrize('path', CONFIGS, ids=[osp.relpath(p, CONFIG_ROOT) for p in CONFIGS])
def test_every_trainable_parameter_gets_a_gradient(path):
    """One training step of the recipe: a trainable parameter without gradient is what
    makes DDP (``find_unused_parameters=False``) fail at the second iteration."""
    cfg, model, hw = build_tiny(path)
    # the batch --train-smoke of tools/swap_backbone.py uses: boxes, masks, labels from
    # the config's class counts, through the model's own data preprocessor
    batch = synthetic_batch(cfg.default_scope, cfg.model, hw)
    data = model.data_preprocessor(batch, True)
    losses = model(**data, mode='loss')
    loss, _ = model.parse_losses(losses)
    assert torch.isfinite(loss)
    loss.backward()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert trainable and not no_grad, (
        f'{osp.relpath(path, REPO_ROOT)}: {len(no_grad)} of {len(trainable)} trainable '
        f'parameters got no gradient (DDP without find_unused_parameters fails on them): '
        f'{no_grad[:12]}')
