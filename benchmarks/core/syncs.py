"""Host-device synchronisations in a forward / backward, found on any device.

On a GPU the host queues kernels ahead of the device; an op that needs a value or a copy
on the host waits until the device has drained its queue, after which the device waits
for the host to launch the next kernels: in a backbone of small kernels that turns the
step launch-bound. ``host_syncs`` runs a function under a ``TorchDispatchMode`` and
reports the aten ops that synchronise a CUDA stream with the host whatever the device
they run on here (so a CPU run finds them):

* ``_local_scalar_dense`` -- ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``if t:``;
* ``lift_fresh`` / ``lift_fresh_copy`` -- a tensor made from Python data
  (``torch.tensor([...], device=...)``): built on the host, then copied to the device by
  a synchronous copy (``c10::cuda::memcpy_and_sync``);
* ``nonzero``, ``masked_select``, ``unique`` variants, ``repeat_interleave``, indexing with
  a boolean mask (``index`` / ``index_put_``) -- output sizes that depend on values, read
  back to the host;
* ``_to_copy`` / ``copy_`` between the host and another device (only visible when
  running on one).

``torch.cuda.set_sync_debug_mode`` reports the same on a real GPU; this works without one.
Each finding is attributed to the innermost frame in ``flatten_mm`` (else the innermost
frame outside torch).
"""
import os.path as osp
import traceback
from typing import Any, Callable, Dict, List, Union

import torch

import flatten_mm

#: aten ops (overload packet names) that synchronise with the host on CUDA
SYNC_OPS = frozenset(('_local_scalar_dense', 'lift_fresh', 'lift_fresh_copy', 'nonzero',
                      'nonzero_static', 'masked_select', 'unique_dim', '_unique',
                      '_unique2', 'unique_consecutive', 'unique_dim_consecutive',
                      'repeat_interleave'))
_COPY_OPS = frozenset(('_to_copy', 'copy_', 'copy'))
_PACKAGE = osp.dirname(osp.abspath(flatten_mm.__file__))
_TORCH = osp.dirname(osp.abspath(torch.__file__))


def _devices(obj: Any) -> set:
    if isinstance(obj, torch.Tensor):
        return {obj.device.type}
    if isinstance(obj, (list, tuple)):
        return set().union(*(_devices(o) for o in obj)) if obj else set()
    if isinstance(obj, dict):
        return _devices(list(obj.values()))
    return set()


def _is_mask_index(name: str, args) -> bool:
    if name not in ('index', 'index_put', 'index_put_', '_index_put_impl_') or len(args) < 2:
        return False
    indices = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices)


def _is_host_copy(name: str, args, kwargs, out) -> bool:
    if name not in _COPY_OPS:
        return False
    devices = _devices(args) | _devices(kwargs) | _devices(out)
    target = kwargs.get('device') if kwargs else None
    if target is not None:
        devices.add(torch.device(target).type)
    return 'cpu' in devices and len(devices - {'meta'}) > 1


def _where() -> str:
    here = osp.abspath(__file__)
    frames = [f for f in traceback.extract_stack() if osp.abspath(f.filename) != here]
    ours = [f for f in frames if f.filename.startswith(_PACKAGE)]
    outside = [f for f in frames if not f.filename.startswith(_TORCH)]
    frame = (ours or outside or frames)[-1]
    return f'{osp.relpath(frame.filename, osp.dirname(_PACKAGE))}:{frame.lineno}'


def host_syncs(fn: Callable[[], Any]) -> List[Dict[str, Any]]:
    """Run ``fn()`` and return the ops in it that synchronise a CUDA stream with the host
    (see the module doc): ``dict(op, where, calls)`` per op and source line, in order of
    first occurrence; empty when there are none. What ``fn`` returns is dropped."""
    from torch.utils._python_dispatch import TorchDispatchMode
    found: Dict[tuple, int] = {}

    class Mode(TorchDispatchMode):

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in SYNC_OPS or _is_mask_index(name, args) or _is_host_copy(
                    name, args, kwargs, out):
                key = (name, _where())
                found[key] = found.get(key, 0) + 1
            return out

    with Mode():
        fn()
    return [dict(op=op, where=where, calls=n) for (op, where), n in found.items()]


def training_step_syncs(model: torch.nn.Module, x: torch.Tensor, warmup: bool = True,
                        train: bool = True) -> List[Dict[str, Any]]:
    """``host_syncs`` of one training forward + backward of ``model`` on ``x`` (a loss
    over every output tensor; the model is put in train mode), or with ``train=False`` of
    one inference forward (eval mode, no grad). With ``warmup`` an unrecorded step runs
    first: what happens once per input shape (e.g. a shifted-window mask built on the
    host and cached on the device) is not a cost of every step."""
    from .train import output_loss
    model.train(train)

    def step():
        if train:
            output_loss(model(x)).backward()
        else:
            with torch.no_grad():
                model(x)

    try:
        if warmup:
            step()
        return host_syncs(step)
    finally:
        model.zero_grad(set_to_none=True)


def backbone_host_syncs(device: Union[str, torch.device] = 'cpu') -> Dict[str, List[str]]:
    """``training_step_syncs`` of a training step and of an inference forward of one small
    model of every backbone family (``cases.tiny_backbones``) on ``device``: family ->
    ``'train: <op> at <file:line> x<calls>'`` / ``'inference: ...'`` lines (empty: no
    sync). What ``benchmark --check`` reports as ``host_syncs``."""
    from .cases import tiny_backbones
    out = {}
    for name, (model, hw) in tiny_backbones().items():
        x = torch.randn(2, 3, *hw, device=device)
        model.to(device)
        out[name] = [f"{kind}: {f['op']} at {f['where']} x{f['calls']}"
                     for kind, train in (('train', True), ('inference', False))
                     for f in training_step_syncs(model, x, train=train)]
    return out
