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
(``flatten_mm.checkpoints.download``: resumable, one download at a time per name under an
inter-process lock, SHA-256 checked), converted, and the converted file cached as
``<home>/<name>_in1k.pth`` (ImageNet), ``<home>/<name>_in1k-classifier.pth`` (the
classifier) or ``<home>/<name>.pth`` (whole models); later uses read the cache. The cached
file records the version of the converter that wrote it (``CONVERTER_VERSIONS``) and is
converted again when that changes. ``<home>`` is ``$FLATTEN_MM_HOME``, by default
``flatten_mm`` in torch's hub directory (``$TORCH_HOME/hub``, ``~/.cache/torch/hub``).
Without network, put the official file (downloaded by hand) at
``<home>/official/<name>.pth``: it is picked up from there. In distributed runs one
process per node prepares the file while the others wait, and an error of a preparer is
raised on every rank (``prepare_distributed``).

Importing ``flatten_mm.models`` registers the scheme (``install``).
"""
import os
import os.path as osp
import pickle
import warnings
from typing import Callable, Optional, Tuple

import torch
from mmengine.dist import all_gather_object, get_dist_info
from mmengine.runner.checkpoint import CheckpointLoader

from ..checkpoints.download import (DownloadError, check_sum, fetch, file_lock, forget,
                                    log_message, record_sum, recorded_sum, sha256_of)
from ..checkpoints.io import CheckpointError, load_foreign_checkpoint, save_checkpoint_file
from ..checkpoints.official import convert_official_file
from . import zoo
from .classification import classifier_state_dict

SCHEME = zoo.SCHEME
HOME_ENV = 'FLATTEN_MM_HOME'

#: version of what each converter writes: the family converters of
#: ``flatten_mm.checkpoints.converters``, and the whole-model / classifier steps on top
#: of them. Bump an entry with any change of that converter's output: cached files
#: record the versions that made them (``meta['converter']``) and are converted again
#: from the official file when they differ.
CONVERTER_VERSIONS = {
    'flatten_pvt': 1, 'flatten_pvt_v2': 1, 'flatten_swin': 1, 'flatten_cswin': 1,
    'quadtree': 1, 'sima_xcit': 1, 'whole_model': 1, 'classifier': 1,
}


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


def converter_version(weights: zoo.OfficialWeights, target: str = 'backbone') -> str:
    """The converters ``weights`` goes through to ``target``, with their versions
    (``'quadtree-1+whole_model-1'``): what a cached file records in ``meta['converter']``."""
    steps = [weights.family]
    if weights.is_whole_model:
        steps.append('whole_model')
    elif target == 'classifier':
        steps.append('classifier')
    return '+'.join(f'{step}-{CONVERTER_VERSIONS[step]}' for step in steps)


def cached_converter(path: str) -> Optional[str]:
    """``meta['converter']`` of the converted file ``path``; ``None`` when the file is
    missing, unreadable or older than the record."""
    if not osp.isfile(path):
        return None
    for mmap in (True, False):  # (memory-mapped: only the small meta is read)
        try:
            meta = torch.load(path, map_location='cpu', weights_only=True, mmap=mmap)['meta']
            return meta.get('converter') if isinstance(meta, dict) else None
        except Exception:  # noqa: BLE001 (any unreadable file is simply converted again)
            continue
    return None


def prepare(name: str, root: Optional[str] = None, force: bool = False,
            trust: bool = False, official_file: Optional[str] = None,
            log: Callable[[str], None] = log_message, target: str = 'backbone') -> str:
    """The converted file of the official checkpoint ``name`` under ``root`` (default
    ``home()``), downloaded and converted unless already there and written by today's
    converter (``converter_version``).

    Safe to call from many processes at once: the work is done under the lock
    ``<root>/official/<name>.lock`` by one of them, the others wait and then read the
    result.

    Args:
        name: an entry of ``flatten_mm.models.zoo``.
        root: the cache folder (default ``home()``).
        force: download and convert again, first dropping the official file, its partial
            downloads and its recorded SHA-256 (with ``official_file``: only the record).
        trust: full unpickling of the official file (only for a source you trust).
        official_file: convert this file instead of downloading; its SHA-256 is held to
            the published / recorded sum like a download's.
        log: where the download's messages go (default mmengine's current logger).
        target: ImageNet weights as the dense backbone (``'backbone'``, what the configs'
            ``init_cfg`` loads) or as the whole mmpretrain classifier (``'classifier'``,
            what the ``configs/mmpretrain`` configs evaluate).

    Raises:
        ValueError: ``name`` has no official checkpoint (the message says whether it is a
            variant without released weights and how to go on).
        DownloadError: no network and no file in ``official_dir`` (the message names the
            URL and that path), or a SHA-256 mismatch (the message names the record).
        ConversionError / CheckpointError: the official file does not convert.
    """
    weights = zoo.get_official_weights(name)
    if target == 'classifier' and weights.is_whole_model:
        raise ValueError(f'{name} is a whole {weights.kind} model: only ImageNet weights convert '
                         'to a classifier')
    dst = converted_path(weights, root, target)
    version = converter_version(weights, target)
    if not force and cached_converter(dst) == version:
        return dst
    folder = official_dir(root)
    with file_lock(osp.join(folder, f'{weights.name}.lock'), log=log):
        found = cached_converter(dst)
        if not force and found == version:  # made by another process while we waited
            return dst
        stale = osp.isfile(dst) and not force
        if stale:
            log(f'{dst} was written by converter {found or "(unrecorded)"}; converting it '
                f'again with {version}')
        try:
            _convert(weights, dst, version, folder, force, trust, official_file, log, target)
        except DownloadError as err:
            if not stale:
                raise
            # the official file to convert again is out of reach (offline, say): the file
            # converted earlier is still a converted official file -- use it, loudly
            message = (f'using {dst}, converted by {found or "an unrecorded converter"} '
                       f'(today: {version}), because the official file could not be '
                       f'fetched to convert it again: {err}')
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            log(message)
    return dst


def _convert(weights: zoo.OfficialWeights, dst: str, version: str, folder: str, force: bool,
             trust: bool, official_file: Optional[str], log: Callable[[str], None],
             target: str) -> None:
    """``prepare``'s work, under the lock of ``weights.name``: fetch (or check
    ``official_file``), load, convert, write ``dst``, then record the SHA-256."""
    if official_file is None:
        got = fetch(weights.name, weights.urls, folder, sha256=weights.sha256,
                    manual_urls=weights.manual_urls, force=force, log=log)
        raw, digest, source, downloaded = got.path, got.sha256, got.source, got.downloaded
    else:
        if force:
            forget(folder, weights.name, log)
        raw = source = official_file
        digest, downloaded = sha256_of(raw), False
        check_sum(raw, weights.name, folder, digest, weights.sha256)
    try:
        ckpt = load_foreign_checkpoint(raw, trust=trust)
    except CheckpointError as err:
        if downloaded and 'allow-list' not in str(err):  # a bad transfer: not kept
            os.remove(raw)
            raise CheckpointError(f'{err} (the downloaded file was removed: run again to '
                                  'download it afresh)') from None
        raise
    out = convert_official_file(ckpt, weights.family, weights.arch, weights.is_whole_model,
                                source=source, target=target,
                                expected_classifier=classifier_state_dict)
    out['meta'].update(name=weights.name, sha256=digest, converter=version)
    save_checkpoint_file(out, dst, force=True)
    if weights.sha256:
        log(f'SHA-256 {digest} ok (published)')
    elif recorded_sum(folder, weights.name) is None:  # (a record there matched: check_sum)
        record_sum(folder, weights.name, digest, source, osp.getsize(raw), log)
    else:
        log(f'SHA-256 {digest} ok (recorded)')


def _local_rank() -> Optional[int]:
    """This process's rank on its node: ``$LOCAL_RANK`` (set by torchrun, slurm and the
    OpenMMLab launchers; ``mmengine.dist.get_local_rank`` raises unless
    ``init_local_group`` ran, so the variable is read here); without it 0 on global rank 0
    and ``None`` (unknown) elsewhere."""
    if os.environ.get('LOCAL_RANK', '').isdigit():
        return int(os.environ['LOCAL_RANK'])
    return 0 if get_dist_info()[0] == 0 else None


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling as itself, else a ``RuntimeError`` with its text."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 (an exception class that does not pickle)
        pass
    return RuntimeError(f'{type(error).__name__}: {error}')


def _fail_together(error: Optional[BaseException], what: str) -> None:
    """A collective: every rank hands in its error (or ``None``); if any rank failed,
    every rank raises the error of the lowest failing rank (the same type and message),
    at once instead of at a barrier's timeout."""
    rank = get_dist_info()[0]
    payload = None if error is None else (rank, _portable(error))
    failed = [p for p in all_gather_object(payload) if p is not None]
    if not failed:
        return
    first, exc = min(failed, key=lambda p: p[0])
    if error is not None and first == rank:
        raise error
    if hasattr(exc, 'add_note'):
        exc.add_note(f'(raised on rank {first} while preparing {what}; every rank raises it)')
    raise exc


def prepare_distributed(name: str, target: str = 'backbone') -> str:
    """``prepare(name, target=target)`` in a distributed run (a plain call otherwise).

    One process per node (local rank 0) prepares, under the file lock (so nodes with and
    without a shared file system both work); then the other ranks read the file (they
    prepare it too if their node had no preparer, e.g. without ``$LOCAL_RANK``). After
    each step every rank learns whether a rank failed, and all raise the same error.
    """
    world_size = get_dist_info()[1]
    if world_size == 1:
        return prepare(name, target=target)
    path = None
    preparer = _local_rank() == 0
    for step_is_preparer in (True, False):
        error = None
        if preparer == step_is_preparer:
            try:
                path = prepare(name, target=target)
            except Exception as err:  # noqa: BLE001 (handed to every rank, then raised)
                error = err
        _fail_together(error, f'{SCHEME}{name}')
    return path


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
    path = prepare_distributed(name, target=target)
    return CheckpointLoader.load_checkpoint(path, map_location=map_location)


_installed = False


def install() -> None:
    """Register ``flatten_mm://`` with mmengine's ``CheckpointLoader`` (idempotent)."""
    global _installed
    if not _installed:
        CheckpointLoader.register_scheme(prefixes=SCHEME, loader=load_from_flatten_mm,
                                         force=True)
        _installed = True
