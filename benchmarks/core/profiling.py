"""Profile of one forward + backward of a backbone: top kernels, launches, bytes moved.

What decides a GPU backbone's speed at detection sizes is often not arithmetic but the
number of kernels it launches and how many times its activations go through memory. One
training forward + backward (after one untimed warm-up step) is recorded twice (the
second pass also sums what the forward saves for the backward, 3. below):

1. under ``torch.profiler`` (CPU activity, plus CUDA on CUDA devices), forward and
   backward in two separate sessions (the training suite's loss and its own backward are
   computed between them, outside both: the backward session is
   ``torch.autograd.backward(outputs, d loss / d outputs)``, the backbone's alone):

   * **launches** -- CUDA: the device kernels (and memcpy / memset) of the session;
     CPU: the *top-level* ``aten::`` ops (those with no ``aten::`` op above them), the
     count that stands for kernel launches on a GPU (issue #13);
   * **top kernels** -- the ``n`` names with the largest self time (CUDA: device self
     time; CPU: CPU self time) over forward + backward, with calls and share of total;

2. under a ``TorchDispatchMode`` that sees every aten op below autograd (forward and
   backward), to estimate the **bytes moved**: every op that is not a view reads its
   tensor inputs and writes its tensor outputs once, so

   ``moved = sum over non-view aten ops of (bytes of tensor inputs + bytes of outputs)``

   (an unfused kernel's traffic, no reuse through caches), split into the whole step and
   the part run inside attention modules' forward. The **ideal** of the attention is what
   one fused kernel per attention layer would move:

   ``ideal = sum over attention layers of (bytes of its input activations + bytes of
   its output)``

   (the module's tensor arguments and results, parameters excluded), and
   ``attn_bytes_ratio = attention moved / ideal`` (forward only: backward ops are not
   attributed to modules).

3. **saved for backward** (``saved_mb``): the bytes of the tensors the training forward
   saves for the backward pass (``torch.autograd.graph.saved_tensors_hooks``; each
   storage once, the model's parameters and buffers left out), the activation memory a
   training step holds at its peak, on any device (the peak adds parameters, gradients,
   optimizer state and transient buffers).

**Kernels on, without a GPU** (``interpret_kernels=True``, CPU only): every operator with
a ``use_triton`` switch is forced onto its Triton kernels, which run under Triton's
interpreter (the kernel modules must have been imported with ``TRITON_INTERPRET=1``).
Each kernel launch is recorded as a ``triton::<kernel>`` event and counts as one
launch; the aten ops the interpreter runs inside a launch are not counted, the ops our
fused operators run around their kernels (partial sums, zero fills) are. The counts
are then those of the CUDA dispatch path (on a GPU each top-level aten op is about one
kernel, a fused operator's launches are its Triton kernels), and the bytes moved count
a fused operator as one op (its inputs + outputs). Times are the interpreter's and are
not reported (``None``); the kernel table lists launches by calls instead (views left
out: they launch nothing on a GPU).

``blocks`` counts the outermost modules whose class name ends with ``Block`` or
``EncoderLayer`` (ours: ``PVTBlock``, ``PreNormBlock``, ``XCiTBlock``; timm ``Block``,
``SwinTransformerBlock``, ``XCABlock``; mmdet ``PVTEncoderLayer``, ``SwinBlock``) that
ran; attention layers are the outermost modules whose class name contains ``Attention``
or ends with ``MSA`` / ``XCA`` / ``QKV`` and that ran. ``*_per_block`` = launches /
blocks.
"""
import contextlib
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from flatten_mm.models.ops.autograd_paths import observes_saved

from .train import _autocast, make_optimizer, output_loss, output_tensors

_BLOCK = re.compile(r'(Block|EncoderLayer)$')
_ATTN = re.compile(r'Attention|MSA$|^XCA$|QKV$')
#: aten ops that move no data (views, metadata)
_VIEW_OPS = frozenset((
    'view', '_unsafe_view', 'reshape', 'transpose', 't', 'permute', 'expand', 'as_strided',
    'slice', 'select', 'unsqueeze', 'squeeze', 'split', 'split_with_sizes', 'unbind',
    'chunk', 'alias', 'detach', 'narrow', 'view_as', 'expand_as', 'unflatten', 'flatten',
    'diagonal', 'lift_fresh', 'empty', 'empty_strided', 'empty_like', 'new_empty',
    'new_empty_strided', 'sym_size', 'sym_stride', 'sym_numel', 'sym_storage_offset',
    'is_same_size', 'set_', 'resize_', 'conj', '_reshape_alias', 'contiguous',
    'size', 'stride', 'dim', 'numel', 'is_contiguous'))



@contextlib.contextmanager
def saved_for_backward(exclude: Sequence[torch.Tensor] = ()) -> Iterator[Dict[int, int]]:
    """Inside the block, the storages autograd saves for the backward pass, each once
    (data pointer -> bytes; a view counts its whole storage), those of ``exclude`` (e.g.
    the parameters) left out: the yielded dict fills as the forward runs."""
    resident = {t.untyped_storage().data_ptr() for t in exclude}
    saved: Dict[int, int] = {}

    @observes_saved  # (our layers' recomputed tensors are not shown: they are not kept)
    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in resident:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved

def _outermost(model: nn.Module, pattern) -> List[nn.Module]:
    found: List[nn.Module] = []

    def visit(m: nn.Module):
        if pattern.search(type(m).__name__):
            found.append(m)
            return
        for c in m.children():
            visit(c)
    visit(model)
    return found


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


class _BytesCounter:
    """Dispatch mode counting non-view aten ops and their input + output bytes, split into
    'inside an attention forward' and everything."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if not _is_view(name):
                    moved = (_tensor_bytes(args) + _tensor_bytes(kwargs or {})
                             + _tensor_bytes(out))
                    counter.ops += 1
                    counter.bytes += moved
                    if counter.depth > 0:
                        counter.attn_ops += 1
                        counter.attn_bytes += moved
                return out

        self.mode = Mode()
        self.reset()

    def reset(self):
        self.ops = self.bytes = self.attn_ops = self.attn_bytes = 0
        self.depth = 0


def profile_backbone(model: nn.Module, run: Callable[[torch.Tensor], Any], x: torch.Tensor,
                     amp: Optional[torch.dtype] = None, top: int = 15,
                     interpret_kernels: bool = False
                     ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Profile one training forward + backward of ``model`` on ``x`` (see module doc).

    Args:
        model: the backbone (put in train mode).
        run: ``x -> outputs`` (e.g. ``model``, or timm's ``forward_intermediates``).
        x: input ``(B, 3, H, W)`` on the device to profile.
        amp: autocast dtype or ``None``.
        top: how many kernels to list.
        interpret_kernels: force our operators onto their Triton kernels, run under
            Triton's interpreter (CPU ``x`` only; ``TRITON_INTERPRET=1`` must be set):
            launches as on the CUDA dispatch path, no times (see module doc). The summary
            then has ``forced_operators`` (how many modules were switched; a model with
            none, e.g. a baseline, is profiled as without the flag).

    Returns:
        ``(summary, kernels)``: summary has ``infer_launches`` (an eval-mode forward
        under ``no_grad``), ``fwd_launches``, ``bwd_launches`` (training),
        ``blocks``, ``attention_layers``, ``fwd_per_block``, ``bwd_per_block``,
        ``fwd_ms`` / ``bwd_ms`` (profiled self time, device time on CUDA),
        ``dispatch_ops_fwd`` / ``_bwd`` (non-view aten ops seen by the dispatch mode),
        ``moved_mb_fwd`` / ``_bwd``, ``saved_mb``, ``attn_moved_mb``, ``attn_ideal_mb``,
        ``attn_bytes_ratio``, ``launch_unit``; kernels is a list of ``dict(kernel,
        calls, self_ms, share)``.
    """
    if not interpret_kernels:
        return _profile_backbone(model, run, x, amp, top, interpreted=False)
    if x.device.type != 'cpu':
        raise ValueError(f'interpret_kernels runs the Triton kernels under the interpreter, '
                         f'on CPU tensors; got an input on {x.device}')
    with forced_kernels(model) as forced:
        if not forced:  # (a baseline: nothing to interpret, profiled as it is)
            summary, kernels = _profile_backbone(model, run, x, amp, top, interpreted=False)
        else:
            with interpreted_launches():
                summary, kernels = _profile_backbone(model, run, x, amp, top,
                                                     interpreted=True)
    summary['forced_operators'] = forced
    return summary, kernels


def _profile_backbone(model: nn.Module, run: Callable[[torch.Tensor], Any], x: torch.Tensor,
                      amp: Optional[torch.dtype], top: int, interpreted: bool
                      ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    from torch.profiler import ProfilerActivity, profile

    device = x.device
    cuda = device.type == 'cuda'
    model.train()
    opt = make_optimizer(model)

    def forward():
        with _autocast(device, amp):
            return run(x)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    # warm-up: one whole step (allocator, cuDNN / Triton autotuning, lazy inits)
    opt.zero_grad(set_to_none=True)
    output_loss(forward()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()

    def loss_grads(out):
        """(outputs, d loss / d output): the backward of the loss itself stays outside the
        recorded sessions, only the backbone's backward is recorded."""
        outs = [t for t in output_tensors(out) if t.requires_grad]
        copies = [t.detach().requires_grad_(True) for t in outs]
        grads = torch.autograd.grad(output_loss(copies), copies)
        return outs, [g.to(t.dtype).contiguous() for g, t in zip(grads, outs)]

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    model.eval()  # inference forward (what the forward suite times), for comparison
    with torch.no_grad(), profile(activities=activities) as prof_i:
        forward()
        sync()
    model.train()
    with profile(activities=activities) as prof_f:
        out = forward()
        sync()
    outs, grads = loss_grads(out)
    sync()
    with profile(activities=activities) as prof_b:
        torch.autograd.backward(outs, grads)
        sync()
    opt.zero_grad(set_to_none=True)
    del out, outs, grads

    # bytes moved, and which blocks / attention layers ran
    counter = _BytesCounter()
    ideal = [0]
    ran_blocks, ran_attn = set(), set()
    hooks = []
    for blk in _outermost(model, _BLOCK):
        hooks.append(blk.register_forward_hook(
            lambda m, a, o: ran_blocks.add(id(m))))
    for att in _outermost(model, _ATTN):

        def pre(m, args, kwargs):
            counter.depth += 1

        def post(m, args, kwargs, out):
            counter.depth -= 1
            ran_attn.add(id(m))
            ideal[0] += _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)

        hooks.append(att.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(att.register_forward_hook(post, with_kwargs=True))
    # activations saved for the backward pass (unique storages, parameters and buffers
    # excluded): the device-independent part of a training step's peak memory
    try:
        with saved_for_backward(list(model.parameters()) + list(model.buffers())) as saved, \
                counter.mode:
            out = forward()
        ops_f, bytes_f, attn_bytes = counter.ops, counter.bytes, counter.attn_bytes
        outs, grads = loss_grads(out)
        counter.reset()
        with counter.mode:
            torch.autograd.backward(outs, grads)
        ops_b, bytes_b = counter.ops, counter.bytes
        del out, outs, grads
    finally:
        for h in hooks:
            h.remove()
    opt.zero_grad(set_to_none=True)

    blocks, attn = len(ran_blocks), len(ran_attn)
    inf_l, _ = _launches(prof_i, cuda)
    fwd_l, fwd_ms = _launches(prof_f, cuda)
    bwd_l, bwd_ms = _launches(prof_b, cuda)
    summary = dict(
        infer_launches=inf_l, fwd_launches=fwd_l, bwd_launches=bwd_l,
        total_launches=fwd_l + bwd_l,
        blocks=blocks, attention_layers=attn,
        fwd_per_block=fwd_l / blocks if blocks else None,
        bwd_per_block=bwd_l / blocks if blocks else None,
        fwd_ms=None if interpreted else fwd_ms, bwd_ms=None if interpreted else bwd_ms,
        dispatch_ops_fwd=ops_f, dispatch_ops_bwd=ops_b,
        moved_mb_fwd=bytes_f / 2**20, moved_mb_bwd=bytes_b / 2**20,
        saved_mb=sum(saved.values()) / 2**20,
        attn_moved_mb=attn_bytes / 2**20, attn_ideal_mb=ideal[0] / 2**20,
        attn_bytes_ratio=attn_bytes / ideal[0] if ideal[0] else None,
        launch_unit='device kernels' if cuda else
        'top-level aten ops + interpreted Triton launches' if interpreted else
        'top-level aten ops')
    if interpreted:
        return summary, _top_launches([prof_f, prof_b], top)
    return summary, _top_kernels([prof_f, prof_b], cuda, top)


@contextlib.contextmanager
def forced_kernels(model: nn.Module) -> Iterator[int]:
    """Inside the block every module of ``model`` with a ``use_triton`` switch (FLA,
    QuadTree) has it set to ``True``; yields how many; the settings are restored after."""
    switched = [(m, m.use_triton) for m in model.modules() if hasattr(m, 'use_triton')]
    try:
        for m, _ in switched:
            m.use_triton = True
        yield len(switched)
    finally:
        for m, previous in switched:
            m.use_triton = previous


#: one kernel of each module of Triton kernels (checked to be interpreted)
_KERNEL_MODULES = (('flatten_mm.models.ops.fla_triton', '_fla_kv_fwd'),
                   ('flatten_mm.models.ops.quadtree_triton',
                    '_qt_gathered_kernel'))


@contextlib.contextmanager
def interpreted_launches() -> Iterator[None]:
    """Inside the block every launch of an interpreted Triton kernel is recorded as a
    ``triton::<kernel name>`` profiler event (the launch unit of ``interpret_kernels``).

    Raises ``RuntimeError`` unless ``TRITON_INTERPRET=1`` is set and our kernel modules
    were imported under it (Triton decides at import whether a kernel is interpreted).
    """
    import importlib
    import os
    if os.environ.get('TRITON_INTERPRET') != '1':
        raise RuntimeError('interpreted kernels need TRITON_INTERPRET=1 in the environment '
                           'before Triton kernels are imported (benchmarks/benchmark.py '
                           '--interpret-kernels sets it)')
    from triton.runtime.interpreter import InterpretedFunction
    for module, kernel in _KERNEL_MODULES:
        if not isinstance(getattr(importlib.import_module(module), kernel),
                          InterpretedFunction):
            raise RuntimeError(f'{module} was imported without TRITON_INTERPRET=1: its '
                               f'kernels need a GPU; set the variable before it is imported')
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        with torch.profiler.record_function(f'triton::{self.fn.__name__}'):
            return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


def _is_device_event(evt) -> bool:
    return getattr(evt, 'device_type', None) == torch.autograd.DeviceType.CUDA


def _launches(prof, cuda: bool) -> Tuple[int, float]:
    """(launches, self milliseconds) of one profiler session (see module doc)."""
    events = prof.events()
    if cuda:
        dev = [e for e in events if _is_device_event(e)]
        return len(dev), sum(e.device_time_total for e in dev) / 1e3

    return len(_top_level(events)), sum(e.self_cpu_time_total for e in events
                                        if not _is_device_event(e)) / 1e3


_LAUNCH_PREFIXES = ('aten::', 'triton::')


def _top_level(events) -> list:
    """CPU launches: ``aten::`` ops and (interpreted) ``triton::`` launches with no such
    event above them (what runs inside an op or a launch is part of it)."""

    def has_launch_ancestor(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith(_LAUNCH_PREFIXES):
                return True
            p = p.cpu_parent
        return False

    return [e for e in events if e.name.startswith(_LAUNCH_PREFIXES)
            and not _is_device_event(e) and not has_launch_ancestor(e)]


def _is_view(name: str) -> bool:
    op = name.split('::', 1)[-1]
    return op in _VIEW_OPS or op.rstrip('_') in _VIEW_OPS


def _top_launches(profs: Sequence[Any], top: int) -> List[Dict[str, Any]]:
    """The ``top`` most frequent launches (``_top_level``) over the sessions, by calls;
    views and other metadata ops (``_VIEW_OPS``: no kernel on a GPU) are left out, and
    ``share`` is of the launches that remain."""
    calls: Dict[str, int] = {}
    for prof in profs:
        for e in _top_level(prof.events()):
            if not _is_view(e.name):
                calls[e.name] = calls.get(e.name, 0) + 1
    whole = sum(calls.values()) or 1
    ranked = sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return [dict(kernel=name, calls=n, self_ms=None, share=n / whole) for name, n in ranked]


def _top_kernels(profs: Sequence[Any], cuda: bool, top: int) -> List[Dict[str, Any]]:
    totals: Dict[str, List[float]] = {}
    for prof in profs:
        for e in prof.events():
            if cuda:
                if not _is_device_event(e):
                    continue
                t = e.device_time_total
            else:
                if _is_device_event(e) or not e.name.startswith('aten::'):
                    continue
                t = e.self_cpu_time_total
            entry = totals.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += t
    whole = sum(v[1] for v in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(kernel=name, calls=calls, self_ms=us / 1e3, share=us / whole)
            for name, (calls, us) in ranked]


def run_profile(pairs: Dict[str, Sequence[str]], hw: Tuple[int, int] = (512, 512),
                batch: int = 2, device: str = 'cpu', amp: Optional[torch.dtype] = None,
                top: int = 15, quick: bool = False,
                log: Optional[Callable[[str], None]] = None,
                interpret_kernels: bool = False
                ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``profile_backbone`` for ours and the baselines of every family in ``pairs``
    (with ``interpret_kernels``: ours on their interpreted Triton kernels, see the module
    doc; the baselines as they are).

    Returns:
        ``(summary rows, kernel rows)``, both with ``suite`` (``'profile'`` /
        ``'profile_kernel'``), ``name``, ``device``, ``amp``, ``batch``, ``height``,
        ``width``, ``kernels`` (``'interpreted'`` for a model whose operators were forced
        onto interpreted kernels, else the ``FLATTEN_MM_TRITON`` setting); a model that
        fails gets a summary row with ``note``.
    """
    from .cases import backbone_cases
    from .train import amp_label, kernels_setting
    device_ = torch.device(device)
    available = backbone_cases(quick)
    amp_name = amp_label(amp)
    names: List[str] = []
    for ours, baselines in pairs.items():
        for n in (ours, *baselines):
            if n in available and n not in names:
                names.append(n)
    summaries, kernels = [], []
    for name in names:
        base = dict(name=name, device=str(device_), amp=amp_name, batch=batch,
                    height=hw[0], width=hw[1], kernels=kernels_setting(),
                    source=available[name].source)
        try:
            torch.manual_seed(0)
            model = available[name].build(tuple(hw)).to(device_)
            x = torch.randn(batch, 3, *hw, device=device_)
            summary, top_k = profile_backbone(
                model, lambda t, m=model, c=available[name]: c.run(m, t), x, amp, top,
                interpret_kernels)
            if summary.get('forced_operators'):
                base['kernels'] = 'interpreted'
            summary.pop('forced_operators', None)
        except Exception as err:  # noqa: BLE001 - reported in the table
            summaries.append(dict(base, suite='profile',
                                  note=f'error: {type(err).__name__}: {str(err)[:200]}'))
            continue
        finally:
            if device_.type == 'cuda':
                torch.cuda.empty_cache()
        summaries.append(dict(base, suite='profile', **summary))
        kernels += [dict(base, suite='profile_kernel', rank=i + 1, **k)
                    for i, k in enumerate(top_k)]
        if log is not None:
            log(f'profile {name}: {summary["fwd_launches"]} / {summary["bwd_launches"]} '
                f'launches (fwd / bwd), {summary["blocks"]} blocks')
    return summaries, kernels


PROFILE_COLUMNS = (('name', 'backbone'), ('amp', 'amp'), ('kernels', 'kernels'),
                   ('infer_launches', 'launches inference fwd'),
                   ('fwd_launches', 'launches fwd'),
                   ('bwd_launches', 'launches bwd'), ('blocks', 'blocks'),
                   ('fwd_per_block', 'fwd / block'), ('bwd_per_block', 'bwd / block'),
                   ('dispatch_ops_fwd', 'aten ops fwd'), ('dispatch_ops_bwd', 'aten ops bwd'),
                   ('fwd_ms', 'fwd ms'), ('bwd_ms', 'bwd ms'),
                   ('moved_mb_fwd', 'moved MiB fwd'), ('moved_mb_bwd', 'moved MiB bwd'),
                   ('saved_mb', 'saved for bwd MiB'),
                   ('attn_moved_mb', 'attn moved MiB'), ('attn_ideal_mb', 'attn ideal MiB'),
                   ('attn_bytes_ratio', 'attn moved / ideal'), ('note', 'note'))
KERNEL_COLUMNS = (('name', 'backbone'), ('rank', '#'), ('kernel', 'kernel / op'),
                  ('calls', 'calls'), ('self_ms', 'self ms'), ('share', 'share'))
