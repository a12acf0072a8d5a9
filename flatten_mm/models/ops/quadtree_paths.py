"""Which way a QuadTree finer level is computed, and why.

``level_facts`` collects what the choice depends on (device, grad mode, graph capture,
whether the Triton kernels may run the level and passed their first-use check, whether
the compiled CPU kernel is built); ``choose_level_path`` reads ``LEVEL_PATHS``, a table
whose first matching row names the path (a module with ``finer_level(lv)``, see
``quadtree_level``) and the reason. This module is the only QuadTree code that reads the
switches (``use_triton``, ``FLATTEN_MM_TRITON`` through ``dispatch``,
``FLATTEN_MM_CPU_KERNELS`` through ``quadtree_cpu``).

Every level reports the path it took (``report_path``): a debug line on the
``flatten_mm.quadtree`` logger, and an entry in each active ``record_paths()`` list.
"""
import contextlib
import logging
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch

from . import dispatch
from . import quadtree_cpu as cpu_kernels
from . import specialisation as spec
from .capture import custom_ops_requested, graph_capture
from .quadtree_layout import level_queries
from .quadtree_level import Level

logger = logging.getLogger('flatten_mm.quadtree')

#: key / value dtypes the Triton kernels read as they are (an exact upcast in registers)
HALF = (torch.bfloat16, torch.float16)


class LevelFacts(NamedTuple):
    """What the path of a finer level depends on."""
    device: str  # the tensors' device type
    inference: bool  # no input records a gradient
    capture: bool  # a graph is captured for another runtime (ops.capture)
    custom_ops: bool  # ... inside ``capture.runtime_custom_ops()``
    margins: bool  # a margin recorder is set (the compiled kernels do not report margins)
    triton: bool  # the Triton kernels may run the level (gates, tile size, first-use check)
    cpu_kernel: bool  # the compiled CPU kernel is built, enabled and usable here
    final: bool  # the finest level (no top-k passed on)
    attn_type: str  # 'A' or 'B'


#: (path, when, why): the first row whose condition holds is the level's path
LEVEL_PATHS = (
    ('graph_op', lambda f: f.inference and not f.triton and f.capture and f.custom_ops
     and not f.margins,
     'graph capture for a runtime with flatten_mm operators: one QuadTreeLevel node'),
    ('tiles', lambda f: f.inference and not f.triton and f.capture and not f.margins,
     'graph capture: dense batched ops in one piece (no chunk loop, no embedding_bag)'),
    ('cpu_kernel', lambda f: f.inference and not f.triton and f.cpu_kernel,
     'CPU inference: the compiled kernel'),
    ('rows', lambda f: f.inference and not f.triton,
     'inference without kernels: chunks of parent rows, no (N, 4K) tensor'),
    ('cpu_train', lambda f: not f.triton and f.cpu_kernel,
     'CPU autograd: the compiled kernels, the backward rebuilds the weights'),
    ('triton_fused', lambda f: f.triton and (f.final or f.attn_type == 'B' and not f.inference),
     'Triton, final level (B: also training): scores, softmax and messages in one kernel'),
    ('triton_gathers', lambda f: f.triton,
     'Triton: gathered-score and gathered-message kernels'),
    ('gathers', lambda f: True,
     'autograd without kernels: gathers in chunks, re-gathered in the backward'),
)

#: the path and reason when the fused kernel declines a configuration at run time
FUSED_DECLINED = ('triton_gathers',
                  'the fused kernel declined this configuration (dispatch) or raised')


def choose_level_path(facts: LevelFacts) -> Tuple[str, str]:
    """``(path, reason)`` of the first ``LEVEL_PATHS`` row that holds for ``facts``."""
    for path, when, why in LEVEL_PATHS:
        if when(facts):
            return path, why
    raise AssertionError('the last row of LEVEL_PATHS always holds')


def level_facts(lv: Level) -> Tuple[LevelFacts, Optional[torch.Tensor]]:
    """The facts of level ``lv`` and, if the kernel check made them, its grouped queries.

    In auto mode, inference runs a kernel configuration only after it passed its first-use
    check (``level_kernels_checked``, run now if not yet); a level whose check failed takes
    the chunked PyTorch path, not the batched gathers whose ``(B, h, L, 4, 4K)`` weights
    the kernels exist to avoid."""
    k, v = lv.key, lv.value
    triton = level_uses_triton(lv.use_triton, k, 4 * lv.prev_idx.shape[-1], not lv.inference)
    queries = None
    if triton and lv.inference and lv.use_triton is None:
        queries = level_queries(lv.query, lv.num_heads, lv.temp)
        kv = (k, v) if k.dtype in HALF and v.dtype in HALF else (k.float(), v.float())
        extra = lv.prev_score if lv.attn_type == 'A' else lv.level_weight
        triton = level_kernels_checked(lv.attn_type, extra, lv.final, queries, *kv,
                                       lv.prev_idx.int(), lv.hw[1] // 2)
    inference, margins = lv.inference, lv.record_margin is not None
    capture = graph_capture()
    # (asked only where a row reads it: the kernel is built on the first ask)
    cpu_kernel = (k.device.type == 'cpu' and not margins and not triton
                  and not (inference and capture)
                  and cpu_kernels.quadtree_level_kernel() is not None)
    facts = LevelFacts(k.device.type, inference, capture, capture and custom_ops_requested(),
                       margins, triton, cpu_kernel, lv.final, lv.attn_type)
    return facts, queries


# ---------------------------------------------------------------------------- the hook
_recorders: List[list] = []


class PathTaken(NamedTuple):
    level: int
    path: str
    reason: str


@contextlib.contextmanager
def record_paths() -> Iterator[List[PathTaken]]:
    """Inside the block, every finer level appends the ``PathTaken`` it ran to the list
    yielded (eager calls; under ``torch.compile`` / export nothing is recorded)."""
    taken: List[PathTaken] = []
    _recorders.append(taken)
    try:
        yield taken
    finally:
        _recorders.remove(taken)


def report_path(level: int, path: str, reason: str) -> None:
    """Report that finer level ``level`` ran ``path`` (debug log, ``record_paths`` lists)."""
    if torch.compiler.is_compiling():
        return
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug('level %d: %s (%s)', level, path, reason)
    for taken in _recorders:
        taken.append(PathTaken(level, path, reason))


# ---------------------------------------------------------------------------- predicates
def kernels():
    """The Triton kernel module (imported only once ``ops.dispatch`` said it imports; a
    plain import, which ``torch.compile`` traces without a graph break)."""
    from . import quadtree_triton  # late: imports triton, only after the dispatch said it imports
    return quadtree_triton


def records_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def is_inference(*tensors) -> bool:
    """No tensor among ``tensors`` requires a gradient (or grad mode is off)."""
    return not (torch.is_grad_enabled() and any(
        t.requires_grad for t in tensors if isinstance(t, torch.Tensor)))


def _dt(t: Optional[torch.Tensor]) -> Optional[str]:
    return None if t is None else str(t.dtype).replace('torch.', '')


def gathered_key(a: torch.Tensor, src: torch.Tensor, index: torch.Tensor, scores: bool,
                 parent_width: int, a_layout: Optional[tuple] = None) -> tuple:
    """The first-use key of a gathered-scores / -messages kernel call (``ops.dispatch``):
    the op, ``a``'s dtype, children per parent, candidates, head dim, index kind and the
    ``specialisation.layout`` of every input (``a_layout``: ``a``'s, given instead of
    ``a`` itself, which may then be any tensor of ``a``'s dtype and device)."""
    K = index.shape[-1] * (4 if parent_width else 1)
    return ('qt_scores' if scores else 'qt_messages', _dt(a), int(a.shape[3]), int(K),
            int(src.shape[-1]), parent_width > 0, a_layout or spec.layout(a),
            spec.layout(src), spec.layout(index), spec.size_class(parent_width))


def final_key(attn_type: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              index: torch.Tensor, extra: Optional[torch.Tensor], parent_width: int) -> tuple:
    """The first-use key of a fused final-level kernel call (see ``gathered_key``)."""
    K = index.shape[-1] * (4 if parent_width else 1)
    return (f'qt_final_{attn_type.lower()}', _dt(q), int(K), int(q.shape[-1]),
            parent_width > 0, spec.layout(q), spec.layout(k), spec.layout(v),
            spec.layout(index), spec.layout(extra), spec.size_class(parent_width))


def gathered_uses_triton(use_triton: Optional[bool], a: torch.Tensor, src: torch.Tensor,
                         index: torch.Tensor, scores: bool, parent_width: int = 0) -> bool:
    """Whether ``gathered_scores`` / ``gathered_messages`` run the Triton kernel
    (``ops.dispatch``: the gates, the kernel's input check -- ``use_triton=True``:
    ``ValueError`` saying why not -- and in auto mode the first-use check)."""
    return dispatch.use_kernels(
        use_triton, 'quadtree', a,
        lambda: kernels().check_inputs(a, src, index, scores, parent_width),
        lambda: gathered_key(a, src, index, scores, parent_width), records_grad(a, src))


def final_uses_kernel(use_triton: Optional[bool], attn_type: str, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                      extra: Optional[torch.Tensor], parent_width: int,
                      records_grad: bool) -> bool:
    """Whether a level runs the fused final-level kernel (as ``gathered_uses_triton``)."""
    def why_not():
        qt = kernels()
        problem = qt.final_b_problem if attn_type == 'B' else qt.final_a_problem
        return problem(q, k, v, index, extra, parent_width)

    return dispatch.use_kernels(
        use_triton, 'quadtree', q, why_not,
        lambda: final_key(attn_type, q, k, v, index, extra, parent_width), records_grad)


def level_uses_triton(use_triton: Optional[bool], k: torch.Tensor, num_candidates: int,
                      records_grad: bool) -> bool:
    """Whether a finer level (keys ``k`` ``(B, h, M, d)``, ``num_candidates`` per parent)
    may run the Triton kernels (the gates and the tile size; in auto mode inference then
    also asks ``level_kernels_checked``)."""
    if not dispatch.wanted(use_triton, 'quadtree', k, records_grad):
        return False
    if use_triton:
        return True  # (gathered_scores raises if the kernels cannot take the level)
    return kernels().tile_fits(num_candidates, k.shape[-1])


def level_kernels_checked(attn_type: str, extra: Optional[torch.Tensor], final: bool,
                          q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          index: torch.Tensor, iw: int) -> bool:
    """Auto mode, inference: whether the kernel configurations the level would run passed
    their first-use checks (run now if not yet): the fused final level, or the gathered
    scores and messages."""
    if final and final_uses_kernel(None, attn_type, q, k, v, index, extra, iw, False):
        return True
    if not gathered_uses_triton(None, q, k, index, True, iw):
        return False
    # the messages' weights: a fresh float32 (B, h, L, 4, K) tensor, described, not made
    # (q stands in for it where only its dtype, device and children count are read)
    shape = (*q.shape[:4], index.shape[-1] * (4 if iw else 1))
    weights = spec.contiguous_layout(shape, torch.float32)
    return dispatch.use_kernels(
        None, 'quadtree', q,
        lambda: kernels().check_inputs(q.new_empty(()).expand(shape), v, index, False, iw),
        lambda: gathered_key(q, v, index, False, iw, a_layout=weights))
