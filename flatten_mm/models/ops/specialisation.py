"""What selects a compiled Triton specialisation of a kernel call, and first-use check
inputs that select the same one.

Triton compiles one variant of a kernel per *specialisation* of its launch arguments: an
integer argument equal to 1 becomes a constant, one divisible by 16 is marked so (vector
loads, no tail masks), one of 2^31 or more is typed int64, and a pointer aligned to 16
bytes is marked aligned. A kernel's sizes and strides are integers of this kind, and a view
such as ``qkv.chunk(3, -1)`` or ``x[:, 1:]`` passes an unaligned pointer or odd strides. So
a first-use check (``ops.dispatch``) proves only the variant its own inputs select: the
dispatch keys a verdict by the ``layout`` of every input, and the check builds its inputs
with ``like``, which reproduces that layout on a tiny size.

Sizes are compared by ``size_class``: ``gcd(size, 16)`` (and whether it is 1 or needs
int64), not only divisibility by 16, because the launchers pass products of sizes (the
strides of the fresh buffers they allocate): the powers of two dividing a product are
those of its factors, so inputs of the same classes give every product the same class too.
"""
import math
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

#: the first integer Triton types as int64
_INT64 = 1 << 31

SizeClass = Union[str, int]


def size_class(value: int) -> SizeClass:
    """``'one'`` (Triton makes it a constant), ``'zero'`` (a broadcast stride; Triton
    counts it divisible by 16), ``'i64'`` (beyond int32), else ``gcd(value, 16)`` (1, 2,
    4, 8 or 16)."""
    value = int(value)
    if value == 1:
        return 'one'
    if value == 0:
        return 'zero'
    if not -_INT64 <= value < _INT64:
        return 'i64'
    return math.gcd(value, 16)


def sized_like(cls: SizeClass, at_least: int) -> int:
    """The smallest size of class ``cls`` that is at least ``at_least`` (and at least 2
    unless the class is ``'one'``)."""
    if cls in ('one', 'zero'):
        return 1 if cls == 'one' else 0
    if cls == 'i64':
        raise ValueError('a size beyond int32 cannot be reproduced in a first-use check')
    value = max(2, int(at_least))
    while size_class(value) != cls:
        value += 1
    return value


def _stride_like(cls: SizeClass, at_least: int) -> int:
    if cls in ('one', 'zero'):
        return 1 if cls == 'one' else 0  # (a broadcast dimension stays a broadcast)
    if cls == 'i64':
        value = max(_INT64, at_least)
        while size_class(value) != 'i64' or math.gcd(value, 16) != 16:
            value += 1
        return value
    return sized_like(cls, max(at_least, 1))


def _aligned(t: torch.Tensor) -> Optional[bool]:
    """Whether ``t``'s first element is 16-byte aligned; ``None`` (unknown) under
    ``torch.compile``, where traced tensors have no address and the compiler lays out the
    buffers, and for a tensor without storage: the first-use check then proves both
    variants (``resolved``)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return t.data_ptr() % 16 == 0
    except RuntimeError:  # (no storage: a torch.func transform's wrapper)
        return None


class Layout(NamedTuple):
    """What of a tensor selects a specialisation (see ``layout``)."""
    dtype: str
    aligned: Optional[bool]
    sizes: Tuple[SizeClass, ...]
    strides: Tuple[SizeClass, ...]
    order: Tuple[int, ...]


def unknown_alignment(key: Any) -> bool:
    """Whether a first-use key holds a ``Layout`` of unknown alignment."""
    if isinstance(key, Layout):
        return key.aligned is None
    return isinstance(key, tuple) and any(unknown_alignment(k) for k in key)


def resolved(key: Any, aligned: bool) -> Any:
    """``key`` with every unknown alignment set to ``aligned``."""
    if isinstance(key, Layout):
        return key._replace(aligned=aligned) if key.aligned is None else key
    if isinstance(key, tuple):
        return tuple(resolved(k, aligned) for k in key)
    return key


def layout(t: Optional[torch.Tensor],
           dtype: Optional[torch.dtype] = None) -> Optional[Layout]:
    """What of ``t`` selects a specialisation (a ``Layout``): dtype, 16-byte alignment, the
    class of every size and stride, and the dimensions' order in memory (``None`` for
    ``None``). With
    ``dtype`` other than ``t``'s: the layout of ``t.to(dtype)``, a fresh contiguous
    tensor."""
    if t is None:
        return None
    if dtype is not None and dtype != t.dtype:
        return contiguous_layout(t.shape, dtype)
    return _layout(t.dtype, t.shape, tuple(t.stride()), _aligned(t))


def contiguous_layout(shape: Sequence[int], dtype: torch.dtype) -> Optional[Layout]:
    """The ``layout`` of a fresh contiguous tensor of ``shape`` and ``dtype``."""
    return _layout(dtype, shape, _contiguous_strides(shape), True)


def _layout(dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int],
            aligned: Optional[bool]) -> Layout:
    # (the memory order of the dimensions that have one: a size-1 dimension's stride is
    # any number, which places it nowhere)
    order = tuple(sorted((i for i in range(len(shape)) if shape[i] != 1),
                         key=lambda i: (strides[i], -i)))
    return Layout(str(dtype).replace('torch.', ''), aligned,
                  tuple(size_class(s) for s in shape), tuple(size_class(s) for s in strides),
                  order)


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(int(s), 1)
    return tuple(reversed(strides))


def ints(*values: int) -> Tuple[SizeClass, ...]:
    """``size_class`` of integer launch arguments that are not sizes of an input."""
    return tuple(size_class(v) for v in values)


def like(spec: Layout, shape: Sequence[int], device: torch.device,
         gen: torch.Generator, scale: float = 1.0, positive: bool = False,
         integers: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A tensor of ``shape`` laid out as ``spec`` (a ``layout``) describes: the same dtype,
    alignment, stride classes and memory order (the caller picks ``shape`` with
    ``sized_like``). Filled with normal values times ``scale`` (``positive``: their
    magnitudes plus 0.1), or uniform integers below ``integers``. Returns ``(view,
    storage)``: the view is an ``as_strided`` window into ``storage`` (which may overlap
    where the spec's strides do, e.g. a broadcast dimension), so gradients are taken with
    respect to ``storage``."""
    dtype_name, aligned, _, stride_classes, order = spec
    dtype = getattr(torch, dtype_name)
    strides = [_stride_like(stride_classes[i], 0) for i in range(len(shape))]
    extent = 1  # elements spanned by the dimensions placed so far
    for i in order:
        strides[i] = _stride_like(stride_classes[i], extent)
        extent = max(extent, strides[i] * (shape[i] - 1) + extent)
    offset = 0 if aligned else 1  # one element: 2, 4 or 8 bytes off a 16-byte boundary
    numel = offset + extent
    if integers is not None:
        data = torch.randint(0, integers, (numel, ), generator=gen)
    else:
        data = torch.randn(numel, generator=gen) * scale
        if positive:
            data = data.abs() + 0.1
    storage = data.to(device=device, dtype=dtype)
    return storage.as_strided(tuple(shape), tuple(strides), offset), storage


def check_leaves(layouts: Sequence[Optional[Layout]], shapes: Sequence[Sequence[int]],
                 device: torch.device, gen: torch.Generator,
                 scales: Optional[Sequence[float]] = None,
                 positive: Optional[Sequence[bool]] = None
                 ) -> Tuple[List[Optional[torch.Tensor]], List[torch.Tensor]]:
    """A first-use check's inputs: ``like`` for each layout (``None`` stays ``None``), the
    storages made leaves that require a gradient. Returns ``(views, storages)``; take the
    views again with ``views_of`` for each path, so that each path's graph reaches the
    storages."""
    views, storages = [], []
    for i, (spec, shape) in enumerate(zip(layouts, shapes)):
        if spec is None:
            views.append(None)
            continue
        view, storage = like(spec, shape, device, gen, scale=scales[i] if scales else 1.0,
                             positive=bool(positive and positive[i]))
        storages.append(storage.requires_grad_())
        views.append(view.detach())
    return views, storages


def views_of(views: Sequence[Optional[torch.Tensor]],
             storages: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """``views`` (of ``check_leaves``) taken again from their storages: the same sizes,
    strides and offsets, in a graph of their own."""
    out, it = [], iter(storages)
    for v in views:
        out.append(None if v is None else next(it).as_strided(v.shape, v.stride(),
                                                               v.storage_offset()))
    return out


def kernel_grad(grad: torch.Tensor) -> torch.Tensor:
    """An output gradient as the kernels' backward launches take it: contiguous and
    aligned (a copy only otherwise, e.g. the expanded gradient of ``out.sum()``), the
    layout the first-use check's backward ran with."""
    if grad.is_contiguous() and _aligned(grad):
        return grad
    return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device).copy_(grad)
