"""Path ``cpu_kernel``: a finer level without autograd by the compiled CPU kernel.

The same formula as ``quadtree_rows`` (scores of each parent's 4 child queries with the
``4 Kp`` children of its selected cells, softmax -- A: within each cell's children times
the cell's coarser weight --, top-k passed on, A: selected weights zeroed at a non-final
level, messages), fused per parent row in C++ (``ops.quadtree_cpu``, ``csrc/``): no
``(N, 4K)`` tensor, no gathered rows. Saves nothing (inference only). Results equal the
PyTorch path up to float rounding and the order of the selected keys; no margins.
"""
from typing import Callable, Optional, Tuple

import torch

from . import quadtree_cpu as cpu_kernels
from .quadtree_layout import to_heads
from .quadtree_level import Level, LevelOutput, run_raw_level


def finer_level_cpu(q_map: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    prev_idx: torch.Tensor, prev_score: Optional[torch.Tensor], h: int,
                    temp: float, attn_type: str, topk: Optional[int],
                    init: Optional[torch.Tensor] = None, kernel: Optional[Callable] = None
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``quadtree_rows.finer_level_rows`` by the fused CPU kernel (same arguments and
    results; ``kernel``: ``quadtree_cpu.quadtree_level_kernel()`` if not given)."""
    kernel = kernel or cpu_kernels.quadtree_level_kernel()
    B, C, hi, wi = q_map.shape
    d = C // h
    M = hi * wi
    Kp = prev_idx.shape[-1]
    q = to_heads(q_map, h).reshape(B * h, M, d).contiguous()
    msg = (q_map.new_zeros(B, h, M, d) if init is None else init).view(B * h, M, d)
    type_a = attn_type == 'A'
    scores = prev_score.reshape(B * h, M // 4, Kp).contiguous() if type_a else None
    next_idx, next_score = kernel(q, k.reshape(B * h, M, d).contiguous(),
                                  v.reshape(B * h, M, d).contiguous(),
                                  prev_idx.reshape(B * h, M // 4, Kp).contiguous(), scores,
                                  msg, wi, temp, topk or 0, type_a)
    if topk is None:
        return msg.view(B, h, M, d), None, None
    return (msg.view(B, h, M, d), next_idx.view(B, h, M, topk),
            next_score.view(B, h, M, topk) if type_a else None)


def finer_level(lv: Level) -> LevelOutput:
    """The level by the compiled kernel (B: summed into its LePE map)."""
    return run_raw_level(finer_level_cpu, lv)
