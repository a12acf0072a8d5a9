"""Make mmengine 0.10.7 read its own checkpoints under torch >= 2.6.

mmengine 0.10.7's local checkpoint loader calls ``torch.load`` without
``weights_only``; since torch 2.6 that means ``weights_only=True``, and the runner's
own checkpoints (message hub ``HistoryBuffer`` objects holding numpy arrays) are then
refused, so ``resume`` and ``load_from`` fail (mmengine#1655, fixed upstream only on an
unreleased branch).

Instead of falling back to full unpickling, the local scheme is re-registered with a
loader that keeps ``weights_only=True`` and allow-lists exactly the classes mmengine
writes into a checkpoint (``HistoryBuffer``, numpy arrays/dtypes/scalars). Foreign
files keep the safe default. For a trusted file that needs more, set
``FLATTEN_MM_TRUST_CHECKPOINTS=1`` (full unpickling, arbitrary code execution risk).
The same loaders (local files and URLs) hand an official mmdet 2.x / mmseg 0.x whole
model of our families over converted (``load_from`` / ``tools/test.py`` take the
official files as they are). Importing ``flatten_mm.models`` (what configs'
``custom_imports`` do) installs them.
"""
import datetime
import importlib
import os
import pickle
from typing import Any, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from mmengine.logging.history_buffer import HistoryBuffer
from mmengine.model import MMDistributedDataParallel, revert_sync_batchnorm
from mmengine.registry import MODEL_WRAPPERS
from mmengine.runner.checkpoint import CheckpointLoader, load_from_http

from .checkpoints.io import CFGNODE_SUBSTITUTE
from .checkpoints.official import whole_model_as_ours

_installed = False

#: names of globals an mmengine runner checkpoint may contain besides tensors
SAFE_GLOBAL_NAMES = {
    'mmengine.logging.history_buffer.HistoryBuffer',
    'numpy.core.multiarray._reconstruct',
    'numpy._core.multiarray._reconstruct',
    'numpy.core.multiarray.scalar',
    'numpy._core.multiarray.scalar',
    'numpy.ndarray',
    'numpy.dtype',
    # configs the official FLatten / SimA / QuadTree scripts pickle beside the weights (plain
    # data), so an unconverted official file given as init_cfg / load_from gets the
    # key-mismatch error that says to convert it, not a pickling error
    'argparse.Namespace',
    'yacs.config.CfgNode',
}
SAFE_GLOBAL_PREFIXES = ('numpy.dtypes.', )


def history_buffer_getattr(obj: Any, name: str) -> Any:
    """Stand-in for ``builtins.getattr`` while unpickling a runner checkpoint.

    ``HistoryBuffer`` pickles its statistics table as ``getattr(HistoryBuffer, 'mean')``
    etc.; only those look-ups are allowed, so the unpickler does not gain a general
    ``getattr``.
    """
    if obj is HistoryBuffer and (name in HistoryBuffer._statistics_methods
                                 or name in ('min', 'max', 'current', 'mean')):
        return getattr(obj, name)
    raise pickle.UnpicklingError(
        f'refusing getattr({getattr(obj, "__name__", type(obj).__name__)}, {name!r}) while '
        'loading a checkpoint with weights_only=True')


def _resolve(name: str) -> Optional[Any]:
    module, _, attr = name.rpartition('.')
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def allowed_globals_for(filename: str) -> List[Any]:
    """The allow-listed globals that ``filename`` needs (raises if it needs others)."""
    needed = torch.serialization.get_unsafe_globals_in_checkpoint(filename)
    refused = sorted(n for n in needed if n != 'builtins.getattr' and n not in SAFE_GLOBAL_NAMES
                     and not n.startswith(SAFE_GLOBAL_PREFIXES))
    if refused:
        raise pickle.UnpicklingError(
            f'{filename} contains pickled objects outside the allow-list of mmengine '
            f'checkpoints: {refused}. If you trust this file, set '
            'FLATTEN_MM_TRUST_CHECKPOINTS=1 to load it with full unpickling.')
    allowed: List[Any] = [obj for obj in (_resolve(n) for n in needed if n != 'builtins.getattr')
                          if obj is not None]
    if 'builtins.getattr' in needed:
        allowed.append((history_buffer_getattr, 'builtins.getattr'))
    if 'yacs.config.CfgNode' in needed:  # loaded as an OrderedDict (see checkpoint_io)
        allowed = [a for a in allowed if getattr(a, '__name__', None) != 'CfgNode']
        allowed.append(CFGNODE_SUBSTITUTE)
    if any(n.startswith('numpy') for n in needed):
        # numpy dtype objects are rebuilt (BUILD) as instances of their dtype classes
        allowed += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith('DType')]
    return allowed


def load_local_checkpoint(filename: str, map_location=None) -> Any:
    """Replacement of mmengine's local loader (see the module docstring); an official
    whole-model file of our families is converted in memory
    (``flatten_mm.checkpoints.official.whole_model_as_ours``)."""
    return whole_model_as_ours(read_local_checkpoint(filename, map_location), filename)


def load_url_checkpoint(filename: str, map_location=None) -> Any:
    """mmengine's URL loader (download to torch's hub cache), then the same in-memory
    conversion of official whole-model files as for local files."""
    return whole_model_as_ours(load_from_http(filename, map_location=map_location), filename)


def read_local_checkpoint(filename: str, map_location=None) -> Any:
    """``torch.load`` of a local file with the allow-list of mmengine checkpoints."""
    filename = os.path.expanduser(filename)
    if not os.path.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    if os.environ.get('FLATTEN_MM_TRUST_CHECKPOINTS', '0') == '1':
        return torch.load(filename, map_location=map_location, weights_only=False)
    try:
        try:
            return torch.load(filename, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            if 'GLOBAL' not in str(err) and 'Unsupported global' not in str(err):
                detail = [ln.strip() for ln in str(err).split('\n') if ln.startswith('Unsupported')]
                raise RuntimeError(detail[0] if detail else str(err).split('\n')[0]) from None
            extra = allowed_globals_for(filename)
            with torch.serialization.safe_globals(extra):
                return torch.load(filename, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:  # refused by the allow-list: the message says why
        raise
    except Exception as err:  # noqa: BLE001 truncated / corrupt (raises anything): name the file
        raise RuntimeError(f'{filename} is not a readable PyTorch checkpoint (truncated or '
                           f'corrupt?): {type(err).__name__}: {err}') from None


def install() -> None:
    """Register ``load_local_checkpoint`` for plain paths and ``load_url_checkpoint`` for
    URLs (idempotent)."""
    global _installed
    if _installed:
        return
    CheckpointLoader.register_scheme(prefixes='', loader=load_local_checkpoint, force=True)
    CheckpointLoader.register_scheme(prefixes=('http://', 'https://'), loader=load_url_checkpoint,
                                     force=True)
    _installed = True


# ---------------------------------------------------------------------------------------
# Distributed runs on machines without CUDA (torchrun + gloo)
# ---------------------------------------------------------------------------------------
#: norm types that need CUDA in a multi-process run and their single-device replacement
SYNC_NORM_TYPES = {'SyncBN': 'BN', 'MMSyncBN': 'BN', 'nn.SyncBatchNorm': 'BN'}
CPU_DDP_NAME = 'CPUDistributedDataParallel'


def _register_cpu_ddp() -> str:
    """Register (once) a ``MMDistributedDataParallel`` that drops ``device_ids`` for a CPU
    module: mmengine always passes ``device_ids=[LOCAL_RANK]``, which torch's DDP rejects
    for CPU modules."""
    if CPU_DDP_NAME in MODEL_WRAPPERS.module_dict:
        return CPU_DDP_NAME

    class CPUDistributedDataParallel(MMDistributedDataParallel):
        """``MMDistributedDataParallel`` for CPU modules (gloo): ignores ``device_ids`` and
        turns remaining ``SyncBatchNorm`` layers (e.g. a backbone's SyncBN default that no
        config ``norm_cfg`` names) into per-process BN, as torch's cannot run on CPU."""

        def __init__(self, module, device_ids=None, **kwargs) -> None:
            params = list(module.parameters())
            if params and params[0].device.type == 'cpu':
                device_ids = None
                module = revert_sync_batchnorm(module)
            super().__init__(module=module, device_ids=device_ids, **kwargs)

    MODEL_WRAPPERS.register_module(name=CPU_DDP_NAME, module=CPUDistributedDataParallel)
    return CPU_DDP_NAME


def replace_sync_norms(cfg: Any) -> List[str]:
    """Replace SyncBN-type ``norm_cfg`` entries of a (nested) config by plain BN, in
    place. Returns the config paths that were changed."""
    changed: List[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if node.get('type') in SYNC_NORM_TYPES:
                node['type'] = SYNC_NORM_TYPES[node['type']]
                changed.append(path)
            for key, val in node.items():
                walk(val, f'{path}.{key}' if path else str(key))
        elif isinstance(node, (list, tuple)):
            for i, val in enumerate(node):
                walk(val, f'{path}[{i}]')

    walk(cfg, '')
    return changed


def setup_cpu_distributed(cfg: Any) -> List[str]:
    """Make ``--launcher pytorch`` (torchrun) work on a machine without CUDA.

    mmengine 0.10.7 calls ``torch.cuda.set_device(LOCAL_RANK)`` when it initialises the
    process group and wraps the model with ``device_ids=[LOCAL_RANK]``; both fail
    without CUDA. When ``cfg.launcher == 'pytorch'`` and CUDA is unavailable this
    initialises the process group itself (gloo, from the torchrun environment; mmengine
    then skips its own initialisation), selects a DDP wrapper without ``device_ids``, and
    replaces SyncBN norms (CUDA-only in a multi-process run) by per-process BN. Does
    nothing otherwise. Returns human-readable notes on what was changed (for the log).
    """
    if cfg.get('launcher', 'none') != 'pytorch' or torch.cuda.is_available():
        return []
    notes = []
    dist_cfg = dict(cfg.get('env_cfg', {}).get('dist_cfg', {}) or {})
    backend = dist_cfg.pop('backend', 'gloo')
    if backend != 'gloo':
        notes.append(f'no CUDA: distributed backend {backend!r} replaced by gloo')
        backend = 'gloo'
    if not dist.is_initialized():
        timeout = dist_cfg.get('timeout', None)
        kwargs = {} if timeout is None else dict(timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend=backend, **kwargs)
    wrapper = cfg.get('model_wrapper_cfg', None)
    if wrapper is None:
        cfg.model_wrapper_cfg = dict(type=_register_cpu_ddp(), broadcast_buffers=False,
                                     find_unused_parameters=cfg.get('find_unused_parameters',
                                                                    False))
    changed = replace_sync_norms(cfg.model)
    if changed:
        notes.append('no CUDA: SyncBN (CUDA-only across processes) replaced by per-process BN '
                     f'at {", ".join(changed)}')
    return notes
