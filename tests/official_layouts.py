"""Writers of checkpoints in the official layouts (for tests that must not download):
official backbone key names, mmdet 2.x / mmseg 0.x whole-model files with their meta."""
import re

import torch


def to_official_pvt_keys(state_dict):
    """flatten_mm PVT-family backbone keys -> the official ``patch_embed{i}`` /
    ``block{i}.{j}`` / ``norm{i}`` layout (inverse of ``convert_pvt_family``)."""
    out = {}
    for key, value in state_dict.items():
        m = re.fullmatch(r'stages\.(\d)\.(.*)', key)
        assert m, key
        i, rest = int(m.group(1)) + 1, m.group(2)
        if rest.startswith('patch_embed.'):
            new = f'patch_embed{i}.{rest[len("patch_embed."):]}'
        elif rest == 'pos_embed':
            new = f'pos_embed{i}'
        elif rest.startswith('norm.'):
            new = f'norm{i}.{rest[len("norm."):]}'
        else:
            mb = re.fullmatch(r'blocks\.(\d+)\.(.*)', rest)
            assert mb, key
            tail = mb.group(2)
            if tail.startswith('mlp.dwconv.'):
                tail = 'mlp.dwconv.dwconv.' + tail[len('mlp.dwconv.'):]
            new = f'block{i}.{mb.group(1)}.{tail}'
        out[new] = value
    return out


def official_meta(kind, model):
    if kind == 'sem_fpn':
        from mmseg.datasets import ADE20KDataset
        info = ADE20KDataset.METAINFO
        return dict(mmseg_version='0.20.2', mmcv_version='1.3.13', CLASSES=info['classes'],
                    PALETTE=[list(c) for c in info['palette']], iter=160000,
                    time='Sat Nov 27 10:00:00 2021', config='model = dict(...)',
                    env_info='sys.platform: linux', seed=0, exp_name='fpn_pvt_v2_b0_quadtree.py')
    from mmdet.datasets import CocoDataset
    return dict(mmdet_version='2.11.0', mmcv_version='1.3.8',
                CLASSES=CocoDataset.METAINFO['classes'], epoch=12, iter=87960,
                time='Fri Nov 26 10:00:00 2021', config='model = dict(...)',
                env_info='sys.platform: linux', seed=0, exp_name='quadtree_b0_fpn_1x_coco.py')


def write_official(model, kind, path):
    """The model's weights as an official mmdet 2.x / mmseg 0.x checkpoint file."""
    sd = model.state_dict()
    backbone = {k[len('backbone.'):]: v for k, v in sd.items() if k.startswith('backbone.')}
    official = {f'backbone.{k}': v.clone() for k, v in to_official_pvt_keys(backbone).items()}
    official.update({k: v.clone() for k, v in sd.items() if not k.startswith('backbone.')})
    params = list(range(len(official)))
    torch.save(dict(meta=official_meta(kind, model), state_dict=official,
                    optimizer=dict(state={}, param_groups=[dict(lr=1e-4, params=params)])),
               path)
    return official
