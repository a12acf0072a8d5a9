"""The ``flatten_mm://`` checkpoint scheme: official weights by name, the OpenMMLab way.

``flatten_mm://<name>`` names an official file of ``flatten_mm.models.zoo``: a backbone
with official ImageNet weights (``flatten_mm://flatten-swin-t``) or a whole detector /
segmentor (``flatten_mm://mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco``). Like mmengine's
``open-mmlab://`` and ``torchvision://``, it works wherever mmengine reads a checkpoint::

    backbone = dict(..., init_cfg=dict(type='Pretrained',
                                       checkpoint='flatten_mm://flatten-pvt-v2-b0'))
    load_from = 'flatten_mm://mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco'
    # python tools/test.py CONFIG flatten_mm://mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco
    # ImageNet weights with their head, for a configs/mmpretrain classifier:
    load_from = 'flatten_mm://flatten-swin-b/classifier'

On first use the official file is downloaded to ``<home>/official/<name>.pth``
(resumable, SHA-256 checked: ``flatten_mm.checkpoints.download``), converted, and the
converted file cached as ``<home>/<name>_in1k.pth`` (ImageNet), ``<home>/<name>_in1k-
classifier.pth`` (the classifier) or ``<home>/<name>.pth`` (whole models); later uses read
the cache. ``<home>`` is ``$FLATTEN_MM_HOME``, by default
``flatten_mm`` in torch's hub directory (``$TORCH_HOME/hub``, ``~/.cache/torch/hub``).
Without network, put the official file (downloaded by hand) at
``<home>/official/<name>.pth``: it is picked up from there. In distributed runs rank 0
prepares the file while the others wait (as mmengine does for URLs).

Importing ``flatten_mm.models`` registers the scheme (``install``).
"""
import os
import os.path as osp
from typing import Callable, Optional, Tuple

import torch
from mmengine.dist import barrier, get_dist_info
from mmengine.runner.checkpoint import CheckpointLoader

from ..checkpoints.download import fetch, log_message, sha256_of
from ..checkpoints.io import load_foreign_checkpoint, save_checkpoint_file
from ..checkpoints.official import convert_official_file
from . import zoo
from .classification import classifier_state_dict

SCHEME = zoo.SCHEME
HOME_ENV = 'FLATTEN_MM_HOME'


def home() -> str:
    """Where the scheme keeps its files: ``$FLATTEN_MM_HOME``, else
    ``<torch hub dir>/flatten_mm``."""
    return osp.expanduser(os.environ.get(HOME_ENV) or osp.join(torch.hub.get_dir(),
                                                               'flatten_mm'))


def official_dir(root: Optional[str] = None) -> str:
    """Where official files are downloaded to, and picked up from when put there by hand."""
    return osp.join(root or home(), 'official')


def converted_path(weights: zoo.OfficialWeights, root: Optional[str] = None,
                   target: str = 'backbone') -> str:
    """The converted file of ``weights``: ``<root>/<name>_in1k.pth`` or ``<root>/<name>.pth``;
    the classifier of ImageNet weights (``target='classifier'``) is
    ``<root>/<name>_in1k-classifier.pth``."""
    path = osp.join(root or home(), osp.basename(weights.target))
    return path[:-len('.pth')] + '-classifier.pth' if target == 'classifier' else path


def prepare(name: str, root: Optional[str] = None, force: bool = False,
            trust: bool = False, official_file: Optional[str] = None,
            log: Callable[[str], None] = log_message, target: str = 'backbone') -> str:
    """The converted file of the official checkpoint ``name`` under ``root`` (default
    ``home()``), downloaded and converted unless already there (``force``: download and
    convert again). ``official_file``: convert this file instead of downloading;
    ``trust``: full unpickling of the official file (only for a source you trust);
    ``log``: where the download's messages go (default mmengine's current logger);
    ``target``: ImageNet weights as the dense backbone (``'backbone'``, what the configs'
    ``init_cfg`` loads) or as the whole mmpretrain classifier (``'classifier'``, what the
    ``configs/mmpretrain`` configs evaluate).

    Raises:
        ValueError: ``name`` has no official checkpoint (the message says whether it is a
            variant without released weights and how to go on).
        DownloadError: no network and no file in ``official_dir`` (the message names the
            URL and that path), or a SHA-256 mismatch.
        ConversionError / CheckpointError: the official file does not convert.
    """
    weights = zoo.get_official_weights(name)
    if target == 'classifier' and weights.is_whole_model:
        raise ValueError(f'{name} is a whole {weights.kind} model: only ImageNet weights convert '
                         'to a classifier')
    dst = converted_path(weights, root, target)
    if osp.isfile(dst) and not force:
        return dst
    if official_file is None:
        raw = fetch(weights.name, weights.urls, official_dir(root), sha256=weights.sha256,
                    manual_urls=weights.manual_urls, force=force, log=log)
        source = weights.urls[0]
    else:
        raw = source = official_file
    ckpt = load_foreign_checkpoint(raw, trust=trust)
    out = convert_official_file(ckpt, weights.family, weights.arch, weights.is_whole_model,
                                source=source, target=target,
                                expected_classifier=classifier_state_dict)
    out['meta'].update(name=weights.name, sha256=sha256_of(raw))
    save_checkpoint_file(out, dst, force=True)
    return dst


def parse_uri(filename: str) -> Tuple[str, str]:
    """``flatten_mm://<name>`` -> ``(name, 'backbone')``; ``flatten_mm://<name>/classifier``
    (ImageNet weights as the whole mmpretrain classifier) -> ``(name, 'classifier')``.

    Raises:
        ValueError: another suffix.
    """
    name, _, target = filename[len(SCHEME):].strip('/').partition('/')
    if target not in ('', 'classifier'):
        raise ValueError(f'{filename}: unknown target {target!r}; write {SCHEME}{name} (the '
                         f'backbone) or {SCHEME}{name}/classifier (the whole classifier)')
    return name, target or 'backbone'


def load_from_flatten_mm(filename: str, map_location=None):
    """mmengine ``CheckpointLoader`` entry of ``flatten_mm://<name>`` (the converted
    backbone, or the whole model of a detection / segmentation name) and
    ``flatten_mm://<name>/classifier`` (ImageNet weights with their head, for the
    ``configs/mmpretrain`` classifiers)."""
    name, target = parse_uri(filename)
    rank, world_size = get_dist_info()
    if rank == 0:
        path = prepare(name, target=target)
    if world_size > 1:
        barrier()
    if rank > 0:
        path = prepare(name, target=target)
    return CheckpointLoader.load_checkpoint(path, map_location=map_location)


_installed = False


def install() -> None:
    """Register ``flatten_mm://`` with mmengine's ``CheckpointLoader`` (idempotent)."""
    global _installed
    if not _installed:
        CheckpointLoader.register_scheme(prefixes=SCHEME, loader=load_from_flatten_mm,
                                         force=True)
        _installed = True
