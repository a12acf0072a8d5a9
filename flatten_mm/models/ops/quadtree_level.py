"""The contract every way of computing a QuadTree finer level shares.

A finer level ``i`` (``hi x wi``, twice its coarser level) receives, for each parent query
of the coarser grid, the ``Kp`` cells that parent selected (``prev_idx``; variant A also
their weights ``prev_score``), and returns for its ``M = hi * wi`` queries the messages
``m_i`` and, unless it is the final level, the ``topk`` candidates each query passes on.
Each path module (``quadtree_rows``, ``quadtree_cpu_infer``, ``quadtree_cpu_train``,
``quadtree_tiles``, ``quadtree_graph_op``, ``quadtree_batched``, ``quadtree_fused``) has
one entry point ``finer_level(lv: Level) -> LevelOutput`` (``quadtree_fused``: or ``None``
when its kernel declines); ``quadtree_paths.choose_level_path`` picks the path.
"""
from typing import Callable, NamedTuple, Optional, Tuple

import torch


class Projections(NamedTuple):
    """The finest level's maps as projections of one input ``x`` ``(B, N, C_in)``: the query
    map is ``tokens_as_map(F.linear(x, *query), hw)``, the key map likewise with ``key``
    and, if ``value`` is given, the value map with ``value`` (``(weight, bias)`` pairs,
    ``bias`` optional; ``x`` and the weights in the dtype the projections ran in).

    With autograd, the fused final level (Triton kernels) then keeps ``x`` and the weights
    for its backward, which recomputes the maps (one GEMM each), instead of keeping its
    float32 grouped queries and the key (and value) maps: ``x`` is kept anyway, by the
    projections themselves. Variant B's value map is kept by its value branch and LePE
    conv, so B passes ``value=None``."""
    x: torch.Tensor
    query: Tuple[torch.Tensor, Optional[torch.Tensor]]
    key: Tuple[torch.Tensor, Optional[torch.Tensor]]
    value: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None


class Level(NamedTuple):
    """The inputs of one finer level.

    Attributes:
        index: the level ``i`` (0 is the coarsest, never a finer level).
        query: the level's query map ``(B, C, hi, wi)`` (not scaled, any float dtype).
        key, value: its keys and values in heads ``(B, h, hi*wi, d)``, raster order
            (float32, or bf16 / fp16 for the Triton paths, which upcast in registers).
        prev_idx: ``(B, h, hi*wi/4, Kp)`` cells of the coarser grid each parent selected.
        prev_score: A: ``(B, h, hi*wi/4, Kp)`` their weights; B: ``None``.
        num_heads, temp: heads ``h`` and the score scale ``1 / sqrt(d)``.
        attn_type: ``'A'`` or ``'B'``.
        topk: candidates each query passes on; ``None`` at the final level.
        lepe: B with LePE: ``lepe(scale=None)`` returns the level's LePE map in heads
            ``(B, h, hi*wi, d)`` (times ``scale`` if given); ``None`` otherwise.
        level_weight: B: the level's weight (a 0-d tensor) or ``None`` (all ones).
        record_margin: ``record_margin(weights, k)`` for each top-k (debugging), or ``None``.
        chunk_elements: bound on gathered elements held at once (autograd gathers).
        use_triton: what the Triton paths pass to the gathered / fused kernels (``None``
            auto, ``True`` forced).
        inference: no input of the attention records a gradient.
        projections: the finest maps as projections (``Projections``) or ``None``.
        queries: the level's grouped, scaled queries ``(B, h, L, 4, d)`` if already
            made (by the kernel check), else ``None``.
    """
    index: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    prev_idx: torch.Tensor
    prev_score: Optional[torch.Tensor]
    num_heads: int
    temp: float
    attn_type: str
    topk: Optional[int]
    lepe: Optional[Callable[..., torch.Tensor]] = None
    level_weight: Optional[torch.Tensor] = None
    record_margin: Optional[Callable[[torch.Tensor, int], None]] = None
    chunk_elements: int = 1 << 25
    use_triton: Optional[bool] = None
    inference: bool = True
    projections: Optional[Projections] = None
    queries: Optional[torch.Tensor] = None

    @property
    def final(self) -> bool:
        return self.topk is None

    @property
    def hw(self) -> Tuple[int, int]:
        return tuple(self.query.shape[-2:])


class LevelOutput(NamedTuple):
    """What a finer level returns.

    Attributes:
        msg: messages ``(B, h, hi*wi, d)`` float32 in raster order.
        next_idx: ``(B, h, hi*wi, topk)`` raster indices of this level's selected keys
            (``None`` at the final level).
        next_score: A: their weights (``None`` for B and at the final level).
        lepe_added: ``msg`` already holds the level's LePE map.
        weighted: ``msg`` already holds the level weight.
    """
    msg: torch.Tensor
    next_idx: Optional[torch.Tensor]
    next_score: Optional[torch.Tensor]
    lepe_added: bool = False
    weighted: bool = False


def lepe_buffer(lv: Level) -> Optional[torch.Tensor]:
    """B with LePE: the level's LePE map (contiguous), the buffer the inference paths sum
    the messages into; else ``None``."""
    if lv.attn_type == 'B' and lv.lepe is not None:
        return lv.lepe().contiguous()
    return None


def run_raw_level(raw: Callable, lv: Level) -> LevelOutput:
    """``lv`` through a path written on plain tensors, ``raw(query, key, value, prev_idx,
    prev_score, num_heads, temp, attn_type, topk, init) -> (msg, next_idx, next_score)``
    (the inference forms: compiled kernel, tiles, graph operator), with B's LePE map as
    ``init``, the buffer the messages are summed into."""
    init = lepe_buffer(lv)
    msg, next_idx, next_score = raw(
        lv.query.float(), lv.key, lv.value, lv.prev_idx, lv.prev_score, lv.num_heads,
        lv.temp, lv.attn_type, lv.topk, init)
    return LevelOutput(msg, next_idx, next_score, lepe_added=init is not None)


def margin_hook(lv: Level) -> Optional[Callable[[int, torch.Tensor, int], None]]:
    """``record_margin`` in the ``(level, weights, k)`` form of the inference paths."""
    if lv.record_margin is None:
        return None
    return lambda level, probs, k: lv.record_margin(probs, k)
