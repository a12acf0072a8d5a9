"""The QuadTree kernels' first-use check (``ops.dispatch``): a kernel configuration is used
in auto mode only after its forward and backward matched the PyTorch path once.

Registered with ``dispatch`` when imported (the QuadTree layer imports it).
"""
from typing import Tuple

import torch

from . import dispatch
from . import specialisation as spec
from .quadtree_gather import gathered_messages, gathered_scores
from .quadtree_paths import kernels


def _first_use_check(key: tuple, device: torch.device) -> None:
    """Run the kernel of ``key`` (``quadtree_paths.gathered_key`` / ``final_key``) forward
    and backward on a tiny level of the key's layouts (``specialisation.like``: parents
    spanning two program blocks and a ragged tail) against the PyTorch path; raise
    ``dispatch.KernelMismatch`` (or the kernel's error) if they differ."""
    qt = kernels()
    gen = dispatch.check_generator()
    op = key[0]
    if op in ('qt_scores', 'qt_messages'):
        _, _, nf, K, d, parents, *layouts, pw_cls = key  # a, src, index
        L_min = 2 * qt.tile_parents(K, d) + 1
    else:
        _, _, K, d, parents, *layouts, pw_cls = key  # q, k, v, index, extra
        nf, L_min = 4, 2 * qt.tile_parents(K, d, fused=True) + 1
    la, lsrc, lidx = layouts[0], layouts[1], layouts[-2 if op.startswith('qt_final') else 2]
    B, h = spec.sized_like(la[2][0], 1), spec.sized_like(la[2][1], 2)
    ph, pw = _parent_grid(la[2][2], pw_cls if parents else la[2][2], L_min)
    L, M = ph * pw, 4 * ph * pw  # the level is a (2 ph) x (2 pw) map
    Kidx = K // 4 if parents else K
    index = spec.like(lidx, (B, h, L, Kidx), device, gen,
                      integers=L if parents else M)[0]
    iw = pw if parents else 0
    # (the float inputs: a and src, or q, k and v)
    tol = max(dispatch.TOLERANCES[lay[0]] for lay in layouts[:3 if op.startswith('qt_f') else 2])
    if op in ('qt_scores', 'qt_messages'):
        scores = op == 'qt_scores'
        views, storages = spec.check_leaves(
            (la, lsrc), [(B, h, L, nf, d if scores else K), (B, h, M, d)], device, gen,
            positive=(not scores, False))
        gathered = gathered_scores if scores else gathered_messages
        kernel = qt.gathered_scores_triton if scores else qt.gathered_messages_triton

        def run(use_triton):
            a, src = spec.views_of(views, storages)
            if use_triton:
                return kernel(a, src, index, iw)
            return gathered(a, src, index, use_triton=False, parent_width=iw)
    else:
        grouped = op == 'qt_final_a'
        lq, lk, lv, _, lextra = layouts
        shapes = [(B, h, L, 4, d), (B, h, M, d), (B, h, M, d),
                  (B, h, L, K // 4) if grouped else  # (B: the level weight, any shape of 1)
                  tuple(1 for _ in (lextra.sizes if lextra else ()))]
        views, storages = spec.check_leaves((lq, lk, lv, lextra), shapes, device, gen,
                                        positive=(False, False, False, True))

        def run(use_triton):
            q, k, v, extra = spec.views_of(views, storages)
            if use_triton:
                fn = qt.final_level_a_triton if grouped else qt.final_level_b_triton
                return fn(q, k, v, index, extra, iw)
            scores = gathered_scores(q, k, index, use_triton=False, parent_width=iw)
            if grouped:
                attn = torch.softmax(scores.unflatten(-1, (K // 4, 4)), dim=-1)
                attn = (attn * extra[:, :, :, None, :, None]).flatten(-2)
            else:
                attn = torch.softmax(scores, dim=-1)
            out = gathered_messages(attn, v, index, use_triton=False, parent_width=iw)
            return out if grouped or extra is None else out * extra
    dispatch.compare_paths(op, run, storages, gen, tol)


def _parent_grid(parents_cls, width_cls, at_least: int) -> Tuple[int, int]:
    """A parent grid ``(ph, pw)`` of at least ``at_least`` cells whose width and cell
    count have the given ``specialisation.size_class`` es (a level's ``L = ph * pw``)."""
    pw = spec.sized_like(width_cls, 2 if width_cls != parents_cls else at_least)
    if parents_cls == width_cls and spec.size_class(pw) == parents_cls:
        return 1, pw
    for ph in range(max(1, -(-at_least // pw)), max(1, -(-at_least // pw)) + 64):
        if spec.size_class(ph * pw) == parents_cls:
            return ph, pw
    raise ValueError(f'no parent grid with {parents_cls} cells and width {width_cls}')



dispatch.register_first_use_check('quadtree', _first_use_check)
