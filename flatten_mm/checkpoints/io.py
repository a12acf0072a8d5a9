"""Reading foreign checkpoints safely, writing converted ones without overwriting.

Foreign (official) checkpoints are read with ``torch.load(weights_only=True)``. The
official training scripts pickle ``argparse.Namespace`` (SimA, QuadTree) or a yacs
``CfgNode`` (FLatten) beside the weights; exactly those classes are allow-listed (the
``CfgNode`` is loaded as an ``OrderedDict`` of its contents). Any
other pickled object is refused with an error that names it and the
``trust=True`` / ``--trust-checkpoint`` escape hatch (full unpickling: only for files
from a source you trust).
"""
import argparse
import collections
import os
import os.path as osp
import pickle
from typing import Any, List

import torch


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read or does not fit."""


#: yacs ``CfgNode`` (FLatten's pickled config) is rebuilt as an ``OrderedDict``: torch's
#: weights-only unpickler only fills plain dict types (SETITEM), so allow-listing the class
#: itself fails; the substitute keeps the data, needs no yacs and runs no yacs code.
CFGNODE_SUBSTITUTE = (collections.OrderedDict, 'yacs.config.CfgNode')


def _safe_globals() -> List[Any]:
    return [argparse.Namespace, CFGNODE_SUBSTITUTE]


def load_foreign_checkpoint(path: str, trust: bool = False) -> Any:
    """Load a checkpoint file on CPU.

    Args:
        path: file path.
        trust: allow full unpickling (arbitrary code execution for malicious files).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: truncated/corrupt file, or pickled objects outside the allow-list.
    """
    if not osp.isfile(path):
        raise FileNotFoundError(f'checkpoint not found: {path}')
    if osp.getsize(path) == 0:
        raise CheckpointError(f'checkpoint {path} is empty (0 bytes)')
    try:
        if trust:
            return torch.load(path, map_location='cpu', weights_only=False)
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as err:
        if 'Unsupported global' in str(err) or 'GLOBAL' in str(err):
            first = str(err).split('\n')
            detail = next((line.strip() for line in first if 'GLOBAL' in line or 'global' in line),
                          first[0])
            raise CheckpointError(
                f'{path} contains pickled Python objects that are not on the allow-list '
                f'({detail}). Only load it with trust=True / --trust-checkpoint if you trust '
                'its source: full unpickling can execute arbitrary code.') from None
        detail = next((line.strip() for line in str(err).split('\n')
                       if line.strip().startswith('Unsupported')), str(err).split('\n')[0])
        raise CheckpointError(f'{path} is not a readable PyTorch checkpoint '
                              f'(corrupt or truncated?): {detail}') from None
    except Exception as err:  # noqa: BLE001 (a corrupt pickle raises anything)
        raise CheckpointError(f'{path} is not a readable PyTorch checkpoint '
                              f'(corrupt or truncated?): {type(err).__name__}: {err}') from None


def save_checkpoint_file(obj: Any, path: str, force: bool = False) -> None:
    """Save ``obj`` with ``torch.save``; refuse to overwrite an existing file unless ``force``.

    The file is written to a temporary name first and moved into place, so an
    interrupted write never leaves a half-written checkpoint under ``path``.
    """
    if osp.exists(path) and not force:
        raise FileExistsError(f'{path} exists; pass force=True / --force to overwrite it')
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    tmp = f'{path}.tmp-{os.getpid()}'
    torch.save(obj, tmp)
    os.replace(tmp, path)
