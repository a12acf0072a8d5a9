"""ONNX Runtime (CPU) latency of exported backbones, paired with eager PyTorch and with
the softmax counterpart exported the same way.

Per backbone, size and thread count, one process times round-robin
(``measure_alternating``, after warm-up): ours in eager PyTorch, ours in ONNX Runtime
(exported by ``flatten_mm.deploy.export_onnx``, fixed size) and the counterpart in ONNX
Runtime (timm's ``features_only`` model of the same family -- for SimA-XCiT with the same dense
adapters as ours --, exported by ``torch.onnx.export(dynamo=True)`` at the same size and
opset). Eager runs the default
inference path (the fused QuadTree CPU kernel when built). Where flatten_mm's ONNX Runtime
operators change the graph (QuadTree's levels, ``export_onnx(custom_ops=True)``), ours is
exported both ways and timed in the same rounds: one row per graph (``graph``: ``standard``
or ``flatten_mm ops``). Rows give the medians and two ratios: ``onnx_vs_counterpart`` (ours
/ counterpart, both in ONNX Runtime) and ``onnx_vs_eager`` (ours in ONNX Runtime / ours
eager); < 1 means ours in ONNX Runtime is faster.

Cases that share a process disturb each other: ONNX Runtime's intra-op workers (and
PyTorch's OpenMP threads) spin-wait for a while after a call, holding the cores the next
case needs. Timed straight after QuadTree in ONNX Runtime, PVTv2-b0 took 119-133 ms at
512² on 2 cores instead of the 81 ms it takes alone. So the sessions here do not spin
(``ort_session(spinning=False)``) and every timed call follows one untimed call of the
same case (``measure_alternating(lead_in=1)``): each case is timed after a call of its
own, not in the wake of another.
"""
import os.path as osp
import tempfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

#: ours -> (counterpart label, timm model name, timm ``create_model`` keywords at a size)
COUNTERPARTS: Dict[str, Tuple[str, str, Callable[[Tuple[int, int]], dict]]] = {
    'flatten-pvt-v2-b0': ('pvt-v2-b0 (timm)', 'pvt_v2_b0', lambda hw: {}),
    'quadtree-b-pvt-v2-b0': ('pvt-v2-b0 (timm)', 'pvt_v2_b0', lambda hw: {}),
    'flatten-swin-t': ('swin-t (timm)', 'swin_tiny_patch4_window7_224',
                       lambda hw: dict(img_size=tuple(hw))),
    # the blocks our dense SimA-S12 feeds to its adapters
    'sima-xcit-s12-p16': ('xcit-s12-p16 (timm) + adapters', 'xcit_small_12_p16_224',
                          lambda hw: dict(out_indices=(3, 5, 7, 11))),
}
DEFAULT_BACKBONES = tuple(COUNTERPARTS)


class _WithAdapters(nn.Module):
    """A trunk's maps through XCiT's dense adapters (``fpn1..fpn4``: deconvolutions /
    identity / max-pooling), so that both sides of the SimA pair compute the same
    multi-scale outputs (timm's ``features_only`` XCiT returns stride-16 maps only)."""

    def __init__(self, trunk: nn.Module, adapters: Sequence[nn.Module]) -> None:
        super().__init__()
        self.trunk = trunk
        self.adapters = nn.ModuleList(adapters)

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        return [a(f) for a, f in zip(self.adapters, self.trunk(x))]


def counterpart_model(name: str, hw: Tuple[int, int],
                      ours: Optional[nn.Module] = None) -> Tuple[str, nn.Module]:
    """The softmax counterpart of catalogue backbone ``name`` (random weights, eval); for
    SimA, XCiT with copies of ``ours``' adapters (built from the catalogue if not given)."""
    import copy

    import timm
    label, timm_name, kwargs = COUNTERPARTS[name]
    model = timm.create_model(timm_name, pretrained=False, features_only=True, **kwargs(hw))
    if name.startswith('sima-'):
        if ours is None:
            from flatten_mm.models.catalogue import get_backbone_spec
            ours = get_backbone_spec(name).build()
        model = _WithAdapters(model, [copy.deepcopy(getattr(ours, f'fpn{k + 1}'))
                                      for k in ours.out_indices])
    return label, model.eval()


def export_plain(model: nn.Module, x: torch.Tensor, path: str, opset: int = 18) -> None:
    """``torch.onnx.export(dynamo=True)`` of ``model`` at the size of ``x`` (what a user
    exporting a timm model does)."""
    import contextlib
    import io
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(model, (x, ), path, dynamo=True, opset_version=opset)


def onnx_rows(names: Sequence[str] = DEFAULT_BACKBONES,
              sizes: Sequence[Tuple[int, int]] = ((512, 512), ),
              threads: Sequence[int] = (2, ), warmup: int = 2, repeats: int = 5,
              counterparts: bool = True, custom_ops: bool = True,
              workdir: Optional[str] = None, on_row=None) -> List[Dict[str, object]]:
    """One row per backbone, size and thread count (batch 1, random weights).

    Args:
        names: catalogue names (with a counterpart in ``COUNTERPARTS`` when
            ``counterparts``).
        sizes: input ``(H, W)`` sizes; each is exported once and timed at every thread
            count.
        threads: intra-op threads of both PyTorch and ONNX Runtime.
        warmup: untimed rounds.
        repeats: timed rounds.
        counterparts: also time the counterpart in ONNX Runtime.
        custom_ops: also time ours exported with flatten_mm's ONNX Runtime operators,
            where that changes the graph.
        workdir: where the ``.onnx`` files go (default: a temporary folder).
        on_row: called with each row as soon as it is measured.

    Returns:
        Rows: ``backbone, graph, resolution, threads, eager_ms, onnx_ms, onnx_vs_eager`` and, with
        ``counterparts``, ``counterpart, counterpart_onnx_ms, onnx_vs_counterpart``; then
        ``max_rel_diff`` (ours in ONNX Runtime vs eager, worst output) and ``repeats``.
        Times are medians.
    """
    from .timing import measure_alternating
    from flatten_mm.deploy.export import export_onnx, max_relative_differences
    from flatten_mm.deploy.runtime import OnnxModel, ort_session
    from flatten_mm.deploy.targets import backbone_target
    from flatten_mm.models.catalogue import get_backbone_spec
    if counterparts:
        missing = [n for n in names if n not in COUNTERPARTS]
        if missing:
            raise ValueError(f'no counterpart for {missing}; known: {list(COUNTERPARTS)} '
                             '(or run without counterparts)')
    previous = torch.get_num_threads()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = workdir or tmp
            for name in names:
                for hw in sizes:
                    torch.manual_seed(0)
                    ours_model = get_backbone_spec(name).build()
                    target = backbone_target(name, ours_model)
                    path = osp.join(folder, f'{name}_{hw[0]}x{hw[1]}.onnx')
                    export_onnx(target, path, hw, dynamic=False)
                    graphs = {'standard': path}
                    if custom_ops:
                        path_ops = osp.join(folder, f'{name}_{hw[0]}x{hw[1]}_ops.onnx')
                        if export_onnx(target, path_ops, hw, custom_ops=True).meta['custom_ops']:
                            graphs['flatten_mm ops'] = path_ops
                    x = target.example_input(hw)
                    xn = x.numpy()
                    label = other_path = None
                    if counterparts:
                        label, other = counterpart_model(name, hw, ours_model)
                        other_path = osp.join(folder, f'counterpart_{name}_{hw[0]}x{hw[1]}.onnx')
                        export_plain(other, x, other_path)
                        del other
                    for n in threads:
                        torch.set_num_threads(n)
                        ours = {g: OnnxModel(p, threads=n, spinning=False)
                                for g, p in graphs.items()}
                        with torch.no_grad():
                            ref = target.module(x)
                        diff = {g: max(max_relative_differences(ref, m(xn)))
                                for g, m in ours.items()}
                        cases = {'eager': lambda: target.module(x)}
                        cases.update({g: (lambda m=m: m(xn)) for g, m in ours.items()})
                        if counterparts:
                            theirs = ort_session(other_path, threads=n, spinning=False)
                            feed = {theirs.get_inputs()[0].name: xn}
                            cases['counterpart'] = lambda: theirs.run(None, feed)
                        t = measure_alternating(cases, torch.device('cpu'), warmup=warmup,
                                                repeats=repeats, lead_in=1)
                        for g in graphs:
                            row = dict(backbone=name, graph=g, resolution=f'{hw[0]}x{hw[1]}',
                                       threads=n, eager_ms=_ms(t['eager']), onnx_ms=_ms(t[g]),
                                       onnx_vs_eager=round(t[g].median / t['eager'].median, 3))
                            if counterparts:
                                row.update(counterpart=label,
                                           counterpart_onnx_ms=_ms(t['counterpart']),
                                           onnx_vs_counterpart=round(
                                               t[g].median / t['counterpart'].median, 3))
                            row.update(max_rel_diff=f'{diff[g]:.2e}', repeats=repeats)
                            rows.append(row)
                            if on_row is not None:
                                on_row(row)
    finally:
        torch.set_num_threads(previous)
    return rows


def _ms(timing) -> float:
    return round(timing.median * 1e3, 2)

