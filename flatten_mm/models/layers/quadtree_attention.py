"""QuadTree attention (variants A and B).

Paper: Tang et al., "QuadTree Attention for Vision Transformers", ICLR 2022,
https://arxiv.org/abs/2201.02767.
Upstream: https://github.com/Tangshitao/QuadTreeAttention @ 549a1ef (Apache-2.0); this is
an independent re-implementation of ``QuadtreeAttention`` with ``QTAttA`` / ``QTAttB`` and
of the two CUDA kernels, following ``shared/spec/attention.md`` §3.

The maths. Queries, keys and values form a pyramid of ``S = num_levels`` maps (2x2
average pooling; B builds the value pyramid with the learned ``value_branchs``), level 0
the coarsest. With ``d`` the head dim and ``tau = 1 / sqrt(d)``:

* **Coarsest level**: full attention ``A_0 = softmax(tau Q_0 K_0^T)``; each query keeps
  the ``K_0 = topk[0]`` keys of largest weight. Message ``m_0 = A_0 V_0`` (B) or
  ``m_0 = (A_0 with the selected keys zeroed) V_0`` (A: their mass is refined below).
* **Finer level i** (twice the height and width): the 4 child queries of a parent attend
  only to the ``4 K_{i-1}`` children of the cells their parent selected:
  ``s = tau q k_c^T`` over those candidates ``c``;
  B: ``A_i = softmax(s)`` over all ``4 K_{i-1}`` candidates;
  A (score redistribution): ``A_i = softmax(s)`` within each selected cell's 4 children,
  times that cell's weight at level ``i - 1``.
  Each query keeps the ``K_i`` candidates of largest weight for level ``i + 1``;
  ``m_i = A_i V_c`` (A, non-final levels: the kept candidates zeroed).
* **Merge**, coarse to fine, each level upsampled (nearest) onto the next:
  A: ``out = sum_i m_i`` (the weights of each query sum to 1);
  B: ``out = sum_i w_i (m_i + LePE_i(V_i))`` with ``w = softmax(py_att.weight)`` and
  ``LePE_i`` a depth-wise 3x3 conv of level ``i``'s value map.

``finer_level_reference`` states a finer level in plain PyTorch in these steps. Where it
runs, a finer level is computed by one of the paths of ``ops/quadtree_*.py`` (the chunked
and batched PyTorch forms, the compiled CPU kernels, the Triton kernels, the exported
forms); ``ops.quadtree_paths.choose_level_path`` picks it from a table (device, grad mode,
graph capture, kernels available and checked), see docs/advanced/kernels.md.

Conventions and limits:

* The attention core runs in float32 (the official module casts with ``.float()``), also
  under fp16 / bf16 autocast; projections and value branches follow the ambient dtype.
* Maps whose sides are not multiples of ``2**(num_levels - 1)`` are zero-padded at the
  bottom / right (the padded tokens take part as keys) and the output is cropped back;
  the official code requires inputs that are multiples of 32.
* The coarsest level must hold at least ``topk`` tokens whenever its top-k is used (``S >
  1``, or variant A, whose single-level stages drop the selected keys from the message
  as the official code does), else ``ValueError`` names the minimum map size. A
  single-level B stage is plain softmax attention plus LePE, any size.
"""
import dataclasses
import functools
import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..ops import dispatch
from ..ops import (quadtree_batched, quadtree_cpu_infer, quadtree_cpu_train,  # noqa: F401
                   quadtree_first_use, quadtree_fused, quadtree_graph_op, quadtree_rows,
                   quadtree_tiles)
from ..ops.autograd_paths import autocast_operands, recorded_eagerly, register_reference
from ..ops.layout import tokens_as_map
from ..ops.quadtree_gather import (DEFAULT_CHUNK_ELEMENTS, gathered_messages,  # noqa: F401
                                   gathered_reference, gathered_scores)
from ..ops.quadtree_layout import (child_candidates, children_to_raster,  # noqa: F401
                                   group_children, level_queries, to_heads, upsample_tokens)
from ..ops.quadtree_level import Level, Projections
from ..ops.quadtree_paths import (FUSED_DECLINED, HALF, choose_level_path, is_inference,
                                  level_facts, report_path)

#: a callback ``(level, min_relative_margin)`` receiving top-k margins (debugging/parity)
MarginRecorder = Callable[[int, float], None]

#: the module computing each path of ``ops.quadtree_paths.LEVEL_PATHS`` (``finer_level``)
LEVEL_PATH_MODULES = {
    'graph_op': quadtree_graph_op, 'tiles': quadtree_tiles, 'cpu_kernel': quadtree_cpu_infer,
    'rows': quadtree_rows, 'cpu_train': quadtree_cpu_train, 'triton_fused': quadtree_fused,
    'triton_gathers': quadtree_batched, 'gathers': quadtree_batched,
}


# --------------------------------------------------------------------------- reference
def finer_level_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          prev_idx: torch.Tensor, prev_score: Optional[torch.Tensor],
                          width: int, temp: float, topk: int = 0,
                          selected: Optional[torch.Tensor] = None):
    """One finer level, step by step as in the paper (§3.3), in plain PyTorch.

    Args:
        q, k, v: ``(BH, M, d)`` queries, keys and values of the level in raster order of
            an ``(M / width, width)`` map with even sides (batch and heads flattened).
        prev_idx: ``(BH, M / 4, Kp)`` the coarser cells each parent query selected.
        prev_score: A: ``(BH, M / 4, Kp)`` their weights; B: ``None``.
        width: the level's width; temp: ``1 / sqrt(d)``.
        topk: candidates each query passes on (0: the final level).
        selected: ``(BH, M, topk)`` candidates to pass on, instead of the top-k of the
            weights (what a double backward differentiates: the forward's selection).

    Returns:
        ``msg (BH, M, d)``, ``next_idx (BH, M, topk)`` (``None`` when ``selected`` is
        given or at the final level) and A's ``next_score (BH, M, topk)`` (else ``None``).
    """
    BH, M, d = q.shape
    hw = (M // width, width)
    Kp = prev_idx.shape[-1]
    # queries grouped by parent: the 4 children of each coarser cell, (BH, 1, L, 4, d)
    query = group_children(q.transpose(1, 2).reshape(BH, d, *hw), 1) * temp
    # candidate keys: the 4 children of each of the Kp cells the parent selected
    cand = child_candidates(prev_idx.unsqueeze(1), width // 2)  # (BH, 1, L, 4Kp)
    scores = gathered_reference(query, k.unsqueeze(1), cand, 0, True)
    if prev_score is None:  # B: attention over all candidates
        attn = torch.softmax(scores, dim=-1)
    else:  # A, score redistribution: each cell's weight split among its 4 children
        attn = torch.softmax(scores.unflatten(-1, (Kp, 4)), dim=-1)
        attn = (attn * prev_score.unsqueeze(1)[:, :, :, None, :, None]).flatten(-2)
    weights, next_idx, next_score = attn, None, None
    if selected is None and topk:  # the candidates passed on to the next level
        kept, sel = attn.topk(topk, dim=-1, sorted=False)  # (BH, 1, L, 4, topk)
        chosen = cand.unsqueeze(3).expand_as(attn).gather(-1, sel)
        next_idx = children_to_raster(chosen, hw).squeeze(1)
        if prev_score is not None:  # A: their mass is refined there, not attended here
            next_score = children_to_raster(kept, hw).squeeze(1)
            weights = attn.scatter(-1, sel, 0.)
    elif selected is not None and selected.shape[-1] and prev_score is not None:
        chosen = group_children(selected.transpose(1, 2).reshape(BH, -1, *hw), 1)
        hit = cand[:, :, :, None, :, None] == chosen.unsqueeze(-2)  # (.., 4, 4Kp, topk)
        next_score = children_to_raster((attn.unsqueeze(-1) * hit).sum(-2), hw).squeeze(1)
        weights = attn.masked_fill(hit.any(-1), 0.)
    msg = gathered_reference(weights, v.unsqueeze(1), cand, 0, False)
    return children_to_raster(msg, hw).squeeze(1), next_idx, next_score


def _level_reference(q, k, v, prev_idx, prev_score, next_idx, width, temp):
    """``quadtree_cpu.level`` op by op for its selected ``next_idx``: ``(msg, next_score)``
    (what the double backward of the CPU training kernel differentiates)."""
    msg, _, next_score = finer_level_reference(q, k, v, prev_idx, prev_score, width, temp,
                                               selected=next_idx)
    return msg, next_score


register_reference('quadtree_level', _level_reference)


# --------------------------------------------------------------------------- core
def _record_margin(recorder: Optional[MarginRecorder], level: int, probs: torch.Tensor,
                   k: int) -> None:
    """Report the smallest relative gap between the k-th and (k+1)-th largest weight."""
    if recorder is None or probs.shape[-1] <= k:
        return
    top = probs.detach().topk(k + 1, dim=-1).values
    margin = (top[..., k - 1] - top[..., k]) / top[..., k - 1].clamp_min(1e-30)
    recorder(level, float(margin.min()))


def quadtree_attention_core(queries: Sequence[torch.Tensor],
                            keys: Sequence[torch.Tensor],
                            values: Sequence[torch.Tensor],
                            num_heads: int,
                            topks: Sequence[int],
                            attn_type: str = 'B',
                            level_weights: Optional[torch.Tensor] = None,
                            lepes: Optional[Sequence[torch.Tensor]] = None,
                            margin_recorder: Optional[MarginRecorder] = None,
                            chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                            use_triton: Optional[bool] = None,
                            projections: Optional[Projections] = None) -> torch.Tensor:
    """Multi-level QuadTree attention on given pyramids (float32 math).

    Level 0 is the coarsest; level ``i + 1`` has twice the height and width of level ``i``.

    Args:
        queries: per level, ``(B, C, h_i, w_i)`` maps.
        keys: per level, ``(B, C, h_i, w_i)``.
        values: per level, ``(B, C, h_i, w_i)``.
        num_heads: heads ``h`` (head-major channel split, ``d = C / h``).
        topks: ``topks[i]`` keys each query of level ``i`` passes on for refinement
            (needed for ``i < S - 1``; variant A also uses ``topks[0]`` when ``S == 1``).
        attn_type: ``'A'`` (score redistribution, masked messages, plain sum) or ``'B'``
            (all candidates attended at every level, weighted merge).
        level_weights: B only, ``(S,)`` weights of the level messages (the official
            ``softmax(py_att.weight)``); ``None`` means all ones.
        lepes: B only, optional per-level ``(B, C, h_i, w_i)`` maps added to the level
            messages before weighting (LePE), or zero-argument callables returning them
            (evaluated when the level is merged; ``LePEConv`` ones also take the level
            weight, folded into their conv, where the fused kernel applies the weight).
        margin_recorder: optional callback ``(level, margin)`` receiving, for every used
            top-k, the smallest ``(k-th - (k+1)-th) / k-th`` weight gap (parity checks).
        chunk_elements: bound on the gathered elements held at once.
        use_triton: Triton kernels for the finer levels' gathered scores and messages
            (and the fused final level): ``None`` auto (on CUDA), ``True`` force,
            ``False`` the PyTorch path (``FLATTEN_MM_TRITON=0`` turns them off everywhere).
        projections: optional, the finest level's query / key (/ value) maps as
            projections of one input (``Projections``; the caller's promise, not checked
            beyond shapes): a training forward's fused final level then recomputes them
            in its backward instead of keeping them (same values and gradients).

    Returns:
        ``(B, h, h_{S-1} * w_{S-1}, d)`` float32 messages in raster order of the finest level.

    The coarsest level is full softmax attention (``_coarsest_level``); each finer level
    runs the path ``ops.quadtree_paths.choose_level_path`` picks (``_finer_level``);
    ``_merge_levels`` then adds the levels coarse to fine (in place without autograd).
    """
    S = len(queries)
    _check_pyramids(S, keys, values, topks, attn_type)
    run = _CoreRun(num_heads, 1.0 / (queries[0].shape[1] // num_heads)**0.5, attn_type,
                   topks, level_weights, lepes, margin_recorder, chunk_elements, use_triton,
                   projections, is_inference(*queries, *keys, *values, *(lepes or ()),
                                             level_weights),
                   grid=tuple(queries[0].shape[-2:]))
    q0, k0, v0 = (to_heads(t.float(), num_heads) for t in (queries[0], keys[0], values[0]))
    if S == 1 and attn_type == 'B':
        # plain softmax attention (no top-k): fused kernel, no L0 x L0 weights in memory
        msg = F.scaled_dot_product_attention(q0, k0, v0, scale=run.temp)
        if lepes is not None:
            msg = msg + run.lepe(0)
        return msg if level_weights is None else msg * level_weights[0]
    messages = [_coarsest_level(run, q0, k0, v0, more_levels=S > 1)]
    for i in range(1, S):
        messages.append(_finer_level(run, i, queries[i], keys[i], values[i], i == S - 1))
    return _merge_levels(run, messages, tuple(queries[0].shape[-2:]))


def _check_pyramids(S: int, keys, values, topks, attn_type: str) -> None:
    if attn_type not in ('A', 'B'):
        raise ValueError(f"attn_type must be 'A' or 'B', got {attn_type!r}")
    if not len(keys) == len(values) == S:
        raise ValueError('queries, keys and values need the same number of levels')
    if len(topks) < max(1, S - 1):
        raise ValueError(f'{S} levels need {max(1, S - 1)} top-k values, got {tuple(topks)}')


@dataclasses.dataclass
class _CoreRun:
    """What one call of ``quadtree_attention_core`` carries from level to level: its
    arguments, the coarser level's top-k (``prev_idx`` / ``prev_score``, raster order) and
    grid, and which levels' messages already hold their LePE / level weight."""
    h: int
    temp: float
    attn_type: str
    topks: Sequence[int]
    level_weights: Optional[torch.Tensor]
    lepes: Optional[Sequence]
    margin_recorder: Optional[MarginRecorder]
    chunk_elements: int
    use_triton: Optional[bool]
    projections: Optional[Projections]
    inference: bool
    grid: Tuple[int, int]
    prev_idx: Optional[torch.Tensor] = None
    prev_score: Optional[torch.Tensor] = None
    lepe_added: set = dataclasses.field(default_factory=set)
    weighted: set = dataclasses.field(default_factory=set)

    def lepe(self, i: int, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Level ``i``'s LePE map in heads, times ``scale`` if given (callables are lazy)."""
        m = self.lepes[i]
        if isinstance(m, LePEConv):
            return to_heads(m(scale), self.h)
        m = (m() if callable(m) else m).float()
        return to_heads(m if scale is None else m * scale, self.h)


def _coarsest_level(run: _CoreRun, q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                    more_levels: bool) -> torch.Tensor:
    """Level 0: full softmax attention, and the top-k the next level refines (raster
    order ``(B, h, L0, d)``)."""
    attn = torch.softmax(run.temp * (q0 @ k0.transpose(-1, -2)), dim=-1)  # (B, h, L0, L0)
    weights = attn
    if more_levels or run.attn_type == 'A':
        K0 = run.topks[0]
        if attn.shape[-1] < K0:
            raise ValueError(f'the coarsest level has {run.grid[0]}x{run.grid[1]} = '
                             f'{attn.shape[-1]} tokens, fewer than topk={K0}')
        _record_margin(run.margin_recorder, 0, attn, K0)
        # (B uses only the indices: a selection on the detached weights records no
        # autograd node, which would keep the (L0, K0) int64 indices for its backward)
        run.prev_score, run.prev_idx = (attn.detach() if run.attn_type == 'B' else attn).topk(
            K0, dim=-1, sorted=False)
        if run.attn_type == 'A':
            weights = attn.scatter(-1, run.prev_idx, 0.)
    return weights @ v0


def _margin_hook(recorder: Optional[MarginRecorder], level: int):
    """``(weights, k) -> None`` reporting level ``level``'s top-k margins, or ``None``."""
    if recorder is None:
        return None
    return lambda probs, k: _record_margin(recorder, level, probs, k)


def _finer_level(run: _CoreRun, i: int, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, final: bool) -> torch.Tensor:
    """Level ``i``'s messages in raster order, by the path ``choose_level_path`` picks
    (reported to ``ops.quadtree_paths.record_paths``); updates the top-k and grid the
    next level reads."""
    hi, wi = query.shape[-2:]
    if (hi, wi) != (2 * run.grid[0], 2 * run.grid[1]):
        raise ValueError(f'level {i} is {hi}x{wi}, expected twice level {i - 1} '
                         f'({run.grid[0]}x{run.grid[1]})')
    k, v = to_heads(key, run.h), to_heads(value, run.h)  # (B, h, hi*wi, d)
    weighted_b = run.attn_type == 'B' and run.level_weights is not None
    lv = Level(i, query, k, v, run.prev_idx, run.prev_score, run.h, run.temp, run.attn_type,
               None if final else run.topks[i],
               lepe=functools.partial(run.lepe, i) if run.lepes is not None else None,
               level_weight=run.level_weights[i] if weighted_b else None,
               record_margin=_margin_hook(run.margin_recorder, i),
               chunk_elements=run.chunk_elements, use_triton=run.use_triton,
               inference=run.inference, projections=run.projections)
    facts, queries = level_facts(lv)
    path, reason = choose_level_path(facts)
    # bf16 / fp16 keys and values go to the kernels as they are (read into float32
    # registers: the exact upcast of .float(), without a float32 copy of both maps)
    if not (facts.triton and k.dtype in HALF and v.dtype in HALF):
        k, v = k.float(), v.float()
    lv = lv._replace(key=k, value=v, queries=queries,
                     use_triton=run.use_triton if facts.triton else False)
    out = LEVEL_PATH_MODULES[path].finer_level(lv)
    if out is None:  # the fused kernel declined (dispatch) or raised in auto mode
        path, reason = FUSED_DECLINED
        out = LEVEL_PATH_MODULES[path].finer_level(lv)
    report_path(i, path, reason)
    if out.lepe_added:
        run.lepe_added.add(i)
    if out.weighted:
        run.weighted.add(i)
    if not final:
        run.prev_idx, run.prev_score = out.next_idx, out.next_score
    run.grid = (hi, wi)
    return out.msg


def _merge_levels(run: _CoreRun, messages: List[torch.Tensor],
                  grid: Tuple[int, int]) -> torch.Tensor:
    """Coarse to fine: each level broadcast into the next (B: after its LePE and level
    weight, where the level path did not add them); in place without autograd."""
    out = None
    for i, msg in enumerate(messages):
        if run.attn_type == 'B':
            if run.lepes is not None and i not in run.lepe_added:
                msg = msg.add_(run.lepe(i)) if run.inference else msg + run.lepe(i)
            if run.level_weights is not None and i not in run.weighted:
                w = run.level_weights[i]
                msg = msg.mul_(w) if run.inference else msg * w
        if out is None:
            out = msg
        elif run.inference:  # broadcast the coarse level into the fine one, in place
            B_, h_, _, X = msg.shape
            msg.view(B_, h_, grid[0], 2, grid[1], 2, X).add_(
                out.view(B_, h_, grid[0], 1, grid[1], 1, X))
            out = msg
            grid = (2 * grid[0], 2 * grid[1])
        else:
            out = upsample_tokens(out, grid) + msg
            grid = (2 * grid[0], 2 * grid[1])
        messages[i] = None  # free merged levels
    return out

# --------------------------------------------------------------------------- module
class _AvgPool2x2(torch.autograd.Function):
    """``F.avg_pool2d(x, 2, 2)`` of an even-sided map whose backward needs only the shape:
    nothing is saved (the autograd node of ``avg_pool2d`` keeps its input alive, a whole
    query / key map per pyramid level). The gradient keeps the input's memory format."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        ctx.channels_last = not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last)
        return F.avg_pool2d(x, 2, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        B, C, H, W = ctx.shape
        fmt = torch.channels_last if ctx.channels_last else torch.contiguous_format
        dx = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device, memory_format=fmt)
        # every input of a 2x2 window gets a quarter of the window's gradient (a product
        # and a copy into the window view: torch.compile takes no strided ``out=``)
        dx.view(B, C, H // 2, 2, W // 2, 2).copy_((grad * 0.25)[:, :, :, None, :, None])
        return dx


def _avg_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """2x2 average pooling of an even-sided ``(B, C, H, W)`` map (a pyramid level); with
    autograd, by ``_AvgPool2x2`` (saves nothing)."""
    if x.shape[-2] % 2 == 0 and x.shape[-1] % 2 == 0 and recorded_eagerly(x):
        return _AvgPool2x2.apply(x)
    return F.avg_pool2d(x, 2, 2)


class LePEConv:
    """A lazily evaluated LePE map of ``quadtree_attention_core``: the depth-wise 3x3 conv
    ``conv`` of the value map ``value``, in float32. Called with a level weight ``scale``,
    it folds the weight into the conv's weight and bias (``conv(value) * scale`` without a
    saved copy of ``conv(value)`` for the weight's gradient). With ``recompute``, a bf16 /
    fp16 ``value`` (autocast) is cast inside a checkpoint when autograd records the conv:
    the backward recasts it instead of keeping a float32 copy of the map."""

    def __init__(self, value: torch.Tensor, conv: nn.Conv2d, recompute: bool = True) -> None:
        self.value, self.conv, self.recompute = value, conv, recompute

    def _apply(self, value: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        w, b = self.conv.weight.float(), self.conv.bias
        b = b.float() if b is not None else None
        if scale is not None:
            w = w * scale
            b = b * scale if b is not None else None
        return F.conv2d(value.float(), w, b, padding=self.conv.padding, groups=self.conv.groups)

    def __call__(self, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        v = self.value
        if self.recompute and v.dtype != torch.float32 and recorded_eagerly(
                v, *self.conv.parameters(), *([scale] if scale is not None else [])):
            # (no random op: no RNG state to restore)
            return checkpoint(self._apply, v, scale, use_reentrant=False,
                              preserve_rng_state=False)
        return self._apply(v, scale)


class _LevelAttentionB(nn.Module):
    """Container of variant B's level logits ``weight`` ``(S,)`` (entry 0 = coarsest) and the
    per-level LePE depth-wise convs ``get_vs`` (entry 0 = coarsest); official ``py_att``."""

    def __init__(self, embed_dims: int, num_levels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_levels))
        self.get_vs = nn.ModuleList([
            nn.Conv2d(embed_dims, embed_dims, 3, 1, 1, groups=embed_dims)
            for _ in range(num_levels)
        ])


class QuadTreeAttention(nn.Module):
    """QuadTree attention replacing spatial-reduction attention in a PVTv2 block.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h``.
        qkv_bias: bias of the 1x1-conv ``q_proj``, ``k_proj``, ``v_proj``.
        attn_drop: accepted for interface uniformity; must be 0 (the official module
            has no attention dropout; ``build_attention`` does not pass a backbone's
            ``attn_drop_rate``).
        proj_drop: dropout after ``proj``.
        attn_type: ``'B'`` (learned value pyramid, level weights, LePE; the released
            models) or ``'A'`` (avg-pooled values, score redistribution).
        num_levels: pyramid levels ``S`` (the official ``sr_ratio``; 4, 3, 2, 1 for
            stages 1-4 of the released models).
        topk: keys each query passes on to the next finer level: one value, or one per
            level starting at the coarsest (entries from ``num_levels - 1`` on are unused,
            like the official finest-level top-k). 8 in the classification models,
            32 in the dense ones.
        value_act: activation inside the B value branches: ``'gelu'`` (classification
            code) or ``'relu'`` (detection/segmentation code); same parameters.
        chunk_elements: bound on the gathered key/value elements held at once
            (memory/speed trade-off, no effect on results).
        use_triton: Triton kernels for the finer levels' gathered scores and messages
            (forward and backward): ``None`` auto (on CUDA, when Triton imports), ``True``
            force (an error if they cannot run), ``False`` the PyTorch path.
            ``FLATTEN_MM_TRITON=0`` turns them off everywhere.
        recompute_values: B, when autograd records the attention: intermediate maps of
            the value pyramid are recomputed in the backward instead of kept
            (``torch.utils.checkpoint``): the value branches' inner maps (GroupNorm, act,
            2x2 conv, GroupNorm, act per level; their inputs and outputs, the value
            pyramid, are kept by the attention anyway) and, under bf16 / fp16 autocast, the
            float32 copy of each value map that the LePE conv reads. The same outputs and
            gradients, less memory for more backward launches. With a backbone's
            ``with_cp`` the block is recomputed already; ``False`` then saves a third pass.
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 attn_type: str = 'B',
                 num_levels: int = 1,
                 topk: Union[int, Sequence[int]] = 32,
                 value_act: str = 'relu',
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                 use_triton: Optional[bool] = None,
                 recompute_values: bool = True) -> None:
        super().__init__()
        self.use_triton = dispatch.check_use_triton(use_triton)
        self.recompute_values = bool(recompute_values)
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        if attn_drop != 0:
            raise NotImplementedError(
                f'QuadTreeAttention has no attention-weight dropout (got attn_drop={attn_drop} '
                "in its attn_cfg); a backbone's attn_drop_rate only reaches operators with one")
        if attn_type not in ('A', 'B'):
            raise ValueError(f"attn_type must be 'A' or 'B', got {attn_type!r}")
        if num_levels < 1:
            raise ValueError(f'num_levels must be >= 1, got {num_levels}')
        if value_act not in ('relu', 'gelu'):
            raise ValueError(f"value_act must be 'relu' or 'gelu', got {value_act!r}")
        topks = (topk, ) * num_levels if isinstance(topk, int) else tuple(int(t) for t in topk)
        if len(topks) < max(1, num_levels - 1) or any(t < 1 for t in topks):
            raise ValueError(f'topk must be a positive int or at least {max(1, num_levels - 1)} '
                             f'positive values (one per level from the coarsest), got {topk}')
        for i in range(num_levels - 2):
            if topks[i + 1] > 4 * topks[i]:
                raise ValueError(f'topk {topks[i + 1]} at level {i + 1} exceeds its '
                                 f'{4 * topks[i]} candidates (4 x topk of level {i})')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.attn_type = attn_type
        self.num_levels = num_levels
        self.topks = topks
        self.value_act = value_act
        self.chunk_elements = chunk_elements
        #: optional ``(level, margin)`` callback, see ``quadtree_attention_core``
        self.margin_recorder: Optional[MarginRecorder] = None

        self.q_proj = nn.Conv2d(embed_dims, embed_dims, 1, bias=qkv_bias)
        self.k_proj = nn.Conv2d(embed_dims, embed_dims, 1, bias=qkv_bias)
        self.v_proj = nn.Conv2d(embed_dims, embed_dims, 1, bias=qkv_bias)
        if attn_type == 'B':
            act = nn.ReLU if value_act == 'relu' else nn.GELU
            self.value_branchs = nn.ModuleList([
                nn.Sequential(
                    nn.GroupNorm(1, embed_dims), act(),
                    nn.Conv2d(embed_dims, embed_dims, 2, 2), nn.GroupNorm(1, embed_dims), act(),
                    nn.Conv2d(embed_dims, embed_dims, 1)) for _ in range(num_levels - 1)
            ])
            self.py_att = _LevelAttentionB(embed_dims, num_levels)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    @classmethod
    def has_attention_dropout(cls, cfg: dict) -> bool:
        """No attention dropout (``build_attention`` does not pass ``attn_drop_rate``)."""
        return False

    @property
    def uses_topk(self) -> bool:
        """Whether the coarsest level's top-k selection affects the output."""
        return self.num_levels > 1 or self.attn_type == 'A'

    @property
    def size_divisor(self) -> int:
        """Maps are padded to multiples of this (``2**(num_levels - 1)``)."""
        return 2**(self.num_levels - 1)

    def min_map_size(self) -> int:
        """Smallest square map side whose coarsest level holds ``topk`` tokens (1 if the
        top-k is unused)."""
        if not self.uses_topk:
            return 1
        return self.size_divisor * math.ceil(math.sqrt(self.topks[0]))

    def check_map_size(self, hw_shape: Tuple[int, int]) -> None:
        """Raise ``ValueError`` if a ``hw_shape`` map is too small for the top-k."""
        if not self.uses_topk:
            return
        f = self.size_divisor
        hc, wc = -(-hw_shape[0] // f), -(-hw_shape[1] // f)
        if hc * wc < self.topks[0]:
            side = self.min_map_size()
            raise ValueError(
                f'QuadTreeAttention: a {hw_shape[0]}x{hw_shape[1]} map gives a coarsest level '
                f'of {hc}x{wc} = {hc * wc} tokens with {self.num_levels} levels, fewer than '
                f'topk={self.topks[0]}; need ceil(H/{f}) * ceil(W/{f}) >= {self.topks[0]} '
                f'(e.g. a {side}x{side} map)')

    def _value_branch(self, t: int, v: torch.Tensor) -> torch.Tensor:
        """B's value map of the next coarser level (``value_branchs[t]``; recomputed in the
        backward when ``recompute_values`` and autograd records it)."""
        branch = self.value_branchs[t]
        if (self.recompute_values and recorded_eagerly(v, *branch.parameters())
                and not torch.compiler.is_compiling()):
            # (no random op in a branch: no RNG state to restore; under torch.compile the
            # compiler decides what it keeps)
            return checkpoint(branch, v, use_reentrant=False, preserve_rng_state=False)
        return branch(v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               hw_shape: Tuple[int, int],
               projections: Optional[Projections] = None) -> torch.Tensor:
        """QuadTree attention on projected tokens (no ``q/k/v_proj``, no ``proj``).

        Builds the pyramids (2x2 average pooling; variant B: the learned value branches
        and the LePE convs) and runs ``quadtree_attention_core`` in float32.

        Args:
            q, k, v: ``(B, N, C)`` tokens of an ``hw_shape`` map whose sides are
                multiples of ``size_divisor`` (the padded map).
            hw_shape: ``(H, W)``.
            projections: optional, ``q``, ``k`` (and ``v``) as projections of one input
                (``Projections`` of the tokens: ``q = F.linear(x, *query)``, ...), passed to
                the core (a training forward with the kernels then keeps ``x`` instead of
                the finest query and key maps).

        Returns:
            ``(B, N, C)`` float32 messages (head-major channels).
        """
        B, N, C = q.shape
        H, W = hw_shape
        # tokens are channels-last maps: pooling and convs run on views, no copies
        q, k, v = (tokens_as_map(t, hw_shape) for t in (q, k, v))
        queries, keys, values = [q], [k], [v]  # finest first
        for t in range(self.num_levels - 1):
            q, k = _avg_pool_2x2(q), _avg_pool_2x2(k)
            v = self._value_branch(t, v) if self.attn_type == 'B' else _avg_pool_2x2(v)
            queries.append(q)
            keys.append(k)
            values.append(v)
        queries, keys, values = queries[::-1], keys[::-1], values[::-1]  # coarsest first

        with torch.autocast(device_type=q.device.type, enabled=False):
            level_weights = lepes = None
            if self.attn_type == 'B':
                level_weights = torch.softmax(self.py_att.weight.float(), dim=0)
                # evaluated when their level is merged (keeps one LePE map alive at a time)
                lepes = [LePEConv(val, conv, self.recompute_values)
                         for val, conv in zip(values, self.py_att.get_vs)]
            out = quadtree_attention_core(queries, keys, values, self.num_heads, self.topks,
                                          self.attn_type, level_weights, lepes,
                                          self.margin_recorder, self.chunk_elements,
                                          self.use_triton, projections)
        return out.transpose(1, 2).reshape(B, N, C)  # head-major channels

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        B, N, C = x.shape
        H, W = hw_shape
        self.check_map_size(hw_shape)
        f = self.size_divisor
        pad_h, pad_w = (-H) % f, (-W) % f
        if pad_h or pad_w:
            x = F.pad(x.reshape(B, H, W, C), (0, 0, 0, pad_w, 0, pad_h)).reshape(
                B, (H + pad_h) * (W + pad_w), C)
        Hp, Wp = H + pad_h, W + pad_w
        # the 1x1-conv projections as matmuls on the tokens (same maths, no NCHW copies);
        # under autocast x and the weights are cast here, as the matmuls would cast them:
        # one copy of x for the three (and for the backward), not one each
        x, *flat = autocast_operands(x, *[t for conv in (self.q_proj, self.k_proj, self.v_proj)
                                          for t in (conv.weight.reshape(C, C), conv.bias)])
        params = list(zip(flat[::2], flat[1::2]))  # (weight, bias) of q, k, v
        q, k, v = (F.linear(x, w, b) for w, b in params)
        # (the finest query and key, and A's value, are then recomputed from x in the
        # backward of the fused final level; B's value map is kept by its value branch)
        projections = Projections(x, params[0], params[1],
                                  params[2] if self.attn_type == 'A' else None)
        out = self.attend(q, k, v, (Hp, Wp), projections=projections)
        if pad_h or pad_w:
            out = out.reshape(B, Hp, Wp, C)[:, :H, :W]
        out = out.reshape(B, N, C).to(x.dtype)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'attn_type={self.attn_type!r}, num_levels={self.num_levels}, '
                f'topk={self.topks[:max(1, self.num_levels - 1)]}, value_act={self.value_act!r}')
