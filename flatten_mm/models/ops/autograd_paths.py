"""Helpers of the layers' own autograd paths (custom ``autograd.Function``s, recomputation):
when they apply, and the autocast casts of the fused paths that run outside autocast."""
import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

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


#: name -> reference formula of a fast path's custom autograd function, registered by the
#: operator module that owns it (the fast paths here cannot import ``models/layers``)
_REFERENCES: Dict[str, Callable[..., Any]] = {}


def register_reference(name: str, fn: Callable[..., Any]) -> None:
    """Set the plain-PyTorch formula of the custom function ``name``: what
    ``differentiate_reference(name, ...)`` differentiates in a double backward."""
    _REFERENCES[name] = fn


def reference(name: str) -> Callable[..., Any]:
    """The formula registered as ``name`` (``register_reference``)."""
    return _REFERENCES[name]


def records_backward_graph() -> bool:
    """Whether a custom function's backward runs under ``create_graph=True`` (autograd then
    records the backward: gradient penalties, double backward), outside tracing."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def differentiate_reference(formula: Union[str, Callable[..., Any]], inputs: Sequence[Any],
                            needs_input_grad: Sequence[bool],
                            grad_outputs: Sequence[Optional[torch.Tensor]]) -> list:
    """The input gradients of a custom autograd function whose backward records a graph
    (``records_backward_graph``): its reference ``formula`` (a registered name, or a function)
    re-run with autograd on the saved inputs -- which carry the forward's graph -- and
    differentiated with ``create_graph=True``. So the memory-lean and fused backwards,
    written for one differentiation, give exact higher derivatives where they are asked
    for, at the cost of the op-by-op formula. Returns one entry per input (``None`` where
    no gradient is needed)."""
    fn = _REFERENCES[formula] if isinstance(formula, str) else formula
    wrt = [i for i, (t, need) in enumerate(zip(inputs, needs_input_grad))
           if need and isinstance(t, torch.Tensor) and t.requires_grad]
    result = [None] * len(inputs)
    with torch.enable_grad():
        # each input through a view of its own: the formula's partial derivatives, even
        # where one input depends on another (q = x W^T beside x): the gradient with
        # respect to x itself would also run through q, which the caller's graph does
        aliased = list(inputs)
        for i in wrt:
            aliased[i] = inputs[i].view_as(inputs[i])
        outs = fn(*aliased)
    outs = outs if isinstance(outs, (tuple, list)) else (outs, )
    pairs = [(o, g) for o, g in zip(outs, grad_outputs)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if not pairs or not wrt:
        return result
    grads = torch.autograd.grad([o for o, _ in pairs], [aliased[i] for i in wrt],
                                [g for _, g in pairs], create_graph=True, allow_unused=True)
    for i, g in zip(wrt, grads):
        result[i] = torch.zeros_like(inputs[i]) if g is None else g
    return result
