"""Helpers of the layers' own autograd paths (custom ``autograd.Function``s, recomputation):
when they apply, and the autocast casts of the fused paths that run outside autocast."""
import contextlib
import threading
from typing import Any, Callable, Iterator, Optional, Tuple

import torch


def autocast_operands(*tensors: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """The tensors cast as autocast casts a matmul's operands on the first one's device:
    inside an autocast region, floating tensors other than float64 to its dtype; outside,
    unchanged (``None`` stays ``None``). A fused path that casts once with this and then
    runs with autocast off computes what the autocast-dispatched ops would (the same
    cast, made once and shared, e.g. kept once for the backward)."""
    dev = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if t is not None and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


def recorded_eagerly(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` (one of them requires a gradient, in
    grad mode) outside tracing, scripting and ONNX export: where the memory-saving
    autograd paths (custom functions, checkpoints) apply."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and not (torch.jit.is_scripting() or torch.jit.is_tracing()
                     or torch.onnx.is_in_onnx_export()))


class _Entry:
    """A tensor not kept for the backward inside ``recomputed_when_saved``: its storage's
    address (only compared while the tensor is alive), and how to get it again (once)."""
    __slots__ = ('ptr', 'dtype', 'device', 'recompute', 'value')

    def __init__(self, value: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> None:
        self.ptr = value.untyped_storage().data_ptr()
        self.dtype, self.device = value.dtype, value.device
        self.recompute, self.value = recompute, None

    def get(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.recompute()
        return self.value


class _Recomputed:
    """What a saved view of a recomputed tensor is packed as: its entry and geometry."""
    __slots__ = ('entry', 'size', 'stride', 'offset')

    def __init__(self, entry: _Entry, t: torch.Tensor) -> None:
        self.entry = entry
        self.size, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()


#: the entries of the open ``recomputed_when_saved`` blocks of this thread
_ACTIVE = threading.local()


def observes_saved(pack: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Mark ``pack``, a saved-tensor pack hook that only looks (it returns its argument;
    the unpack hook is the identity), e.g. one that sums the bytes kept for the backward:
    ``recomputed_when_saved`` then applies under it and shows it only what is kept."""
    pack.observes_saved = True
    return pack


def _pack(t: torch.Tensor):
    for entry in reversed(_ACTIVE.entries):
        if (t.dtype == entry.dtype and t.device == entry.device
                and t.untyped_storage().data_ptr() == entry.ptr):
            return _Recomputed(entry, t)
    return t if _ACTIVE.observer is None else _ACTIVE.observer(t)


def _unpack(p):
    if not isinstance(p, _Recomputed):
        return p
    return p.entry.get().as_strided(p.size, p.stride, p.offset)


def _top_hooks():
    """The innermost saved-tensor hooks (``None``: none), or ``False`` where torch cannot
    tell (the private query is missing) or ``torch.compile`` is tracing."""
    top = getattr(torch._C._autograd, '_top_saved_tensors_default_hooks', None)
    compiler = getattr(torch, 'compiler', None)
    if top is None or (compiler is not None and compiler.is_compiling()):
        return False
    return top(False)


@contextlib.contextmanager
def recomputed_when_saved(value: torch.Tensor, recompute: Callable[..., torch.Tensor],
                          *inputs: Any) -> Iterator[None]:
    """Inside the block, autograd does not keep ``value`` (or a view of it) for the
    backward pass: it keeps how to get it, and the backward calls ``recompute(*inputs)``
    (once, shared by all the views saved) when it first needs it. The other saved tensors
    are kept as usual. Blocks nest (each inner one adds its tensor); ``inputs`` that an
    enclosing block recomputes are held as that block's recipe, not kept. Under other
    saved-tensor hooks (non-reentrant gradient checkpointing, offloading, a user's own),
    which would not see what this block saves, and under ``torch.compile``, nothing
    changes; hooks marked by ``observes_saved`` see what the block keeps.

    ``recompute(*inputs)`` must return a contiguous tensor equal to ``value``; it is called
    under the autocast state of the block's start and in the backward's grad mode (a graph
    is recorded only for a ``create_graph`` backward, as torch's non-reentrant
    checkpointing does). ``value`` must be a contiguous tensor
    that owns its storage (else nothing changes) and must stay alive for the whole block
    (the caller holds it), so that no other tensor can take its storage's address there.
    """
    storage = value.untyped_storage()
    top = _top_hooks()
    ours = bool(top) and top[0] is _pack
    observer = top[0] if top and getattr(top[0], 'observes_saved', False) else None
    if (top is not None and not ours and observer is None) or not (
            value.is_contiguous() and value.storage_offset() == 0
            and storage.nbytes() == value.numel() * value.element_size()):
        yield
        return
    if not ours:
        _ACTIVE.entries, _ACTIVE.observer = [], observer
    packed = [_pack(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    dev = value.device.type
    amp = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)

    def again() -> torch.Tensor:  # (under the forward's autocast state)
        with torch.autocast(dev, dtype=amp[1], enabled=amp[0]):
            return recompute(*map(_unpack, packed))
    _ACTIVE.entries.append(_Entry(value, again))
    try:
        if ours:
            yield
        else:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                yield
    finally:
        _ACTIVE.entries.pop()
