"""A training batch of real images for ``--train-smoke``, built by the config's own
train pipeline.

When the dataset a config trains on is present (its ``data_root`` / annotation file
exist), the batch comes from it; otherwise the bundled demo data stands in
(``demo/data/coco_mini``: 6 COCO train2017 images with instance boxes and masks, for
mmdet; ``demo/data/ade_mini``: 3 ADE20K images with label maps, for mmseg). The dataset
leaf of ``train_dataloader.dataset`` (inside ``RepeatDataset`` /
``MultiImageMixDataset`` / ... wrappers, the first of a ``ConcatDataset``) is pointed at
the demo data (as ``CocoDataset`` / ``ADE20KDataset`` when the config trains on another
dataset) and the config's pipelines run unchanged except for their sizes: every
``scale`` / ``img_scale`` / ``crop_size`` / ``size`` / ``scales`` / ``border`` is
multiplied by one factor so that the training size (the largest ``crop_size``, else the
largest short side) becomes the smoke size (a 1333x800 resize becomes 213x128 at smoke
size 128; an ADE20K 2048x512 resize + 512x512 crop becomes 512x128 + 128x128).

``DemoUnavailable`` says why the pipeline cannot run on the demo data (the model has
fewer classes than the demo labels, panoptic annotations are absent, ...); the caller
then falls back to the synthetic batch.
"""
import contextlib
import copy
import io
import os.path as osp
import random
from typing import Any, List, Optional, Tuple

import numpy as np
from mmengine.config import Config
from mmengine.dataset import pseudo_collate
from mmengine.registry import init_default_scope

#: the repository's bundled data (demo/data), next to the package
DEMO_ROOT = osp.join(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))),
                     'demo', 'data')

#: scope -> (dataset type, number of classes, dataset fields pointing at the demo data)
DEMO_DATASETS = {
    'mmdet': ('CocoDataset', 80,
              dict(data_root=osp.join(DEMO_ROOT, 'coco_mini') + osp.sep,
                   ann_file='annotations/instances_train2017.json',
                   data_prefix=dict(img='train2017/'))),
    'mmseg': ('ADE20KDataset', 150,
              dict(data_root=osp.join(DEMO_ROOT, 'ade_mini', 'ADEChallengeData2016'),
                   data_prefix=dict(img_path='images/validation',
                                    seg_map_path='annotations/validation'))),
}

#: pipeline keys holding image sizes (ints or (w, h) / (h, w) pairs, or lists of them)
SIZE_KEYS = ('scale', 'img_scale', 'crop_size', 'size', 'scales', 'img_scales', 'border')


class DemoUnavailable(RuntimeError):
    """The config's train pipeline cannot build a batch from the demo data (message: why)."""


def _type_name(t: Any) -> str:
    return t.rsplit('.', 1)[-1] if isinstance(t, str) else getattr(t, '__name__', str(t))


def _leaf_datasets(ds: dict) -> List[dict]:
    """The dataset dicts that read files (wrappers followed; a ConcatDataset is reduced
    to its first member)."""
    if isinstance(ds.get('dataset'), dict):
        return _leaf_datasets(ds['dataset'])
    if isinstance(ds.get('datasets'), (list, tuple)) and ds['datasets']:
        first = ds['datasets'][0]
        ds['datasets'] = [first]
        return _leaf_datasets(first)
    return [ds]


def _walk_types(obj: Any, found: set) -> None:
    if isinstance(obj, dict):
        if isinstance(obj.get('type'), str):
            found.add(_type_name(obj['type']))
        for v in obj.values():
            _walk_types(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk_types(v, found)


def dataset_present(leaf: dict) -> bool:
    """Whether the files a dataset config reads exist here."""
    root = leaf.get('data_root') or ''
    ann = leaf.get('ann_file')
    if ann:
        return osp.isfile(osp.join(root, ann))
    prefix = leaf.get('data_prefix') or {}
    img = prefix.get('img_path') or prefix.get('img') or ''
    return bool(root or img) and osp.isdir(osp.join(root, img))


def _sizes(obj: Any) -> List[int]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int):
        return [abs(obj)]
    if isinstance(obj, (list, tuple)):
        return [v for o in obj for v in _sizes(o)]
    return []


def _short_sides(obj: Any) -> List[int]:
    """The shorter side of each size pair in ``obj`` (ints count as themselves)."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int):
        return [abs(obj)]
    if isinstance(obj, (list, tuple)):
        if len(obj) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in obj):
            return [min(abs(v) for v in obj)]
        return [v for o in obj for v in _short_sides(o)]
    return []


def _walk_sizes(pipeline: Any, fn) -> None:
    """Call ``fn(transform, key)`` for every size key of every transform (nested
    ``transforms`` of RandomChoice / RandomApply included)."""
    if isinstance(pipeline, (list, tuple)):
        for t in pipeline:
            _walk_sizes(t, fn)
    elif isinstance(pipeline, dict):
        for key in SIZE_KEYS:
            if key in pipeline and _sizes(pipeline[key]):
                fn(pipeline, key)
        if 'transforms' in pipeline:
            _walk_sizes(pipeline['transforms'], fn)


def _scaled(obj: Any, f: float) -> Any:
    if isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return int(round(obj * f)) if obj else 0
    if isinstance(obj, tuple):
        return tuple(_scaled(o, f) for o in obj)
    if isinstance(obj, list):
        return [_scaled(o, f) for o in obj]
    return obj


def scale_pipelines(ds: dict, target: int) -> float:
    """Multiply every size in the pipelines of ``ds`` (and its wrapped datasets) by one
    factor so that the training size becomes ``target``: the largest ``crop_size`` (what
    the model is trained on), else the largest short side of the sizes (800 of a
    ``(1333, 800)`` resize). Returns the factor (1.0 if none)."""
    pipelines = []

    def collect(d):
        if isinstance(d, dict):
            if d.get('pipeline') is not None:
                pipelines.append(d['pipeline'])
            if isinstance(d.get('dataset'), dict):
                collect(d['dataset'])
            for sub in d.get('datasets') or []:
                collect(sub)

    collect(ds)
    found: List[int] = []
    crops: List[int] = []

    def gather(t, k):
        found.extend(_short_sides(t[k]))
        if k == 'crop_size':
            crops.extend(_sizes(t[k]))

    for p in pipelines:
        _walk_sizes(p, gather)
    ref = max(crops or found or [0])
    if ref <= 0:
        return 1.0
    f = target / ref

    def apply(t, k):
        t[k] = _scaled(t[k], f)

    for p in pipelines:
        _walk_sizes(p, apply)
    return f


def demo_batch(cfg: Config, input_hw: Tuple[int, int], batch_size: int = 2,
               num_classes: Optional[int] = None, seed: int = 0) -> Tuple[dict, str]:
    """``batch_size`` samples of the config's train pipeline on its dataset if present,
    else on the demo data, collated as a dataloader would.

    Args:
        cfg: the (merged) config with ``train_dataloader``.
        input_hw: the smoke size ``(H, W)``; the pipelines' sizes are scaled so that the
            largest becomes ``max(input_hw)``.
        num_classes: classes of the model's heads (the demo labels must fit).
        seed: seeds ``random`` / ``numpy`` for the pipeline's random transforms.

    Returns:
        ``(batch, description)``: ``batch`` is ``dict(inputs=[uint8 (3, h, w)...],
        data_samples=[...])``; ``description`` says which data and pipeline were used.

    Raises:
        DemoUnavailable: the pipeline cannot run here (the message says why).
    """
    scope = cfg.get('default_scope')
    loader = cfg.get('train_dataloader')
    if scope not in DEMO_DATASETS:
        raise DemoUnavailable(f'no demo data for scope {scope!r}')
    if not isinstance(loader, dict) or not isinstance(loader.get('dataset'), dict):
        raise DemoUnavailable('the config has no train_dataloader.dataset')
    ds = copy.deepcopy(loader['dataset'])
    ds = ds.to_dict() if hasattr(ds, 'to_dict') else ds
    leaves = _leaf_datasets(ds)
    leaf = leaves[0]
    src_type = _type_name(leaf.get('type'))
    if dataset_present(leaf):
        where = f'{src_type} at {leaf.get("data_root")}'
    else:
        demo_type, demo_classes, fields = DEMO_DATASETS[scope]
        if num_classes is not None and num_classes < demo_classes:
            raise DemoUnavailable(
                f'the model has {num_classes} classes and the demo data '
                f'({demo_type}) labels {demo_classes}; the config\'s dataset {src_type} is '
                'not present')
        pipeline_types = set()
        _walk_types(ds, pipeline_types)
        if 'LoadPanopticAnnotations' in pipeline_types:
            raise DemoUnavailable(
                f'the train pipeline loads panoptic annotations (LoadPanopticAnnotations, '
                f'{src_type} not present); the demo data {demo_type} has instance '
                'annotations only')
        for key in ('ann_file', 'data_prefix', 'metainfo', 'indices', 'seg_map_path'):
            leaf.pop(key, None)
        leaf.update(copy.deepcopy(fields))
        if src_type != demo_type:
            leaf['type'] = demo_type
        leaf['serialize_data'] = False
        where = (f'demo data {osp.relpath(fields["data_root"], osp.dirname(osp.dirname(DEMO_ROOT)))}'
                 + (f' as {demo_type} (the config trains on {src_type}, not present)'
                    if src_type != demo_type else f' ({src_type} not present)'))
    f = scale_pipelines(ds, max(input_hw))
    try:
        init_default_scope(scope)
        if scope == 'mmdet':
            import mmdet.datasets  # noqa: F401  (registration)
            from mmdet.registry import DATASETS
        else:
            import mmseg.datasets  # noqa: F401
            from mmseg.registry import DATASETS
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools' progress lines
            dataset = DATASETS.build(ds)
        if len(dataset) == 0:
            raise DemoUnavailable(f'{where}: the dataset is empty after its filters')

        random.seed(seed)  # the pipeline's random transforms: one batch per seed
        np.random.seed(seed)
        samples = [dataset[i % len(dataset)] for i in range(batch_size)]
    except DemoUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 -- the reason for the synthetic fallback
        msg = str(exc).splitlines()[0][:300] if str(exc) else ''
        raise DemoUnavailable(f'the train pipeline does not run on {where}: '
                              f'{type(exc).__name__}' + (f': {msg}' if msg else '')) from exc
    if any(s is None for s in samples):
        raise DemoUnavailable(f'the train pipeline dropped every sample of {where}')
    batch = pseudo_collate(samples)
    shapes = ', '.join('x'.join(map(str, x.shape[1:])) for x in batch['inputs'])
    desc = (f'{len(samples)} images of {where} through the config\'s train pipeline '
            f'(sizes x{f:.3g}; images {shapes})')
    return batch, desc
