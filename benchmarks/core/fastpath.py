"""Consistency checks: every fast path against its reference path on a device, and
``torch.compile`` graph breaks / compiled outputs of a backbone."""
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from .cases import tiny_backbones
from .syncs import backbone_host_syncs


def compile_report(model: nn.Module, x: torch.Tensor, backend: Optional[str] = None
                   ) -> Dict[str, Any]:
    """``torch.compile`` compatibility of ``model`` on input ``x``.

    Always counts graphs and graph breaks with ``torch._dynamo.explain`` (tracing only).
    With ``backend`` (e.g. ``'inductor'``, ``'aot_eager'``) the model is also compiled
    and run, and the largest absolute difference to eager mode is reported.

    Returns:
        ``dict(graphs, graph_breaks, break_reasons, max_abs_diff, error)``.
    """
    report: Dict[str, Any] = dict(graphs=None, graph_breaks=None, break_reasons=[],
                                  max_abs_diff=None, error=None)
    try:
        import torch._dynamo as dynamo
    except ImportError as err:  # pragma: no cover
        report['error'] = f'no torch._dynamo: {err}'
        return report
    model = model.eval()
    try:
        with torch.no_grad():
            dynamo.reset()
            explanation = dynamo.explain(model)(x)
        report['graphs'] = explanation.graph_count
        report['graph_breaks'] = explanation.graph_break_count
        report['break_reasons'] = [str(getattr(b, 'reason', b))[:200]
                                   for b in explanation.break_reasons][:5]
        if backend is not None:
            dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            with torch.no_grad():
                ref = model(x)
                out = compiled(x)
            ref = ref if isinstance(ref, (tuple, list)) else (ref, )
            out = out if isinstance(out, (tuple, list)) else (out, )
            report['max_abs_diff'] = max(float((a - b).abs().max()) for a, b in zip(ref, out))
    except Exception as err:  # noqa: BLE001 - reported, the benchmark goes on
        report['error'] = f'{type(err).__name__}: {str(err)[:300]}'
    finally:
        dynamo.reset()
    return report


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_fast_paths(device: str = 'cpu') -> Dict[str, Any]:
    """Relative max differences between every fast path and its reference path on
    ``device`` (the checks of ``tests/test_layers/test_fast_paths.py`` at realistic
    sizes; run this on a GPU, where CI never runs). TF32 is disabled during the checks.

    Returns:
        check name -> dict of relative differences (``|a - b|_max / |b|_max``) or an
        ``'ERROR ...'`` string; ``host_syncs``: backbone -> the ops of a training step and of an
        inference forward that synchronise the host with the device
        (``syncs.backbone_host_syncs``; empty lists expected).
    """
    from flatten_mm.models.layers import (FocusedLinearAttention, QuadTreeAttention,
                                          ShiftedWindowAttention, nchw_to_nlc, nlc_to_nchw)
    from flatten_mm.models.ops import quadtree_cpu as cpu_kernels
    from flatten_mm.models.layers.conv import token_conv
    from flatten_mm.models.layers.focused_linear_attention import (
        depthwise_conv_heads, focused_linear_core, focused_linear_core_reference)
    from flatten_mm.models.layers.sima_attention import sima_core, sima_core_reference

    dev = torch.device(device)
    cuda = dev.type == 'cuda'
    if cuda:
        tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def fla_core():
        out = {}
        for B, N, C, h in [(2, 4096, 64, 1), (1, 3136, 96, 3), (2, 784, 160, 5)]:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, N, C, generator=g).to(dev) for _ in range(3))
            pos = torch.randn(1, N, C, generator=g).to(dev)
            scale = (0.5 * torch.randn(1, 1, C, generator=g)).to(dev)
            ref = focused_linear_core_reference(q, k + pos, v, scale, h, 3)
            with torch.no_grad():
                fast = focused_linear_core(q, k, v, scale, h, 3, k_pos=pos)
                half = focused_linear_core(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale, h,
                                           3, k_pos=pos)
            grad = focused_linear_core(q.clone().requires_grad_(True), k, v, scale, h, 3,
                                       k_pos=pos).detach()
            out[f'N{N}_C{C}_h{h}'] = dict(no_grad=_rel(fast, ref), grad=_rel(grad, ref),
                                          bf16_inputs=_rel(half, ref))
        return out

    def token_convs():
        torch.manual_seed(0)
        conv = nn.Conv2d(32, 32, 5, padding=2, groups=32).to(dev)
        conv3 = nn.Conv2d(96, 96, 3, padding=1, groups=96).to(dev)
        x = torch.randn(2, 64 * 48, 96, device=dev)
        with torch.no_grad():
            return dict(
                dwc_heads=_rel(token_conv(conv, x, (64, 48), repeat=3),
                               depthwise_conv_heads(conv, x, (64, 48), 3)),
                dw3x3=_rel(token_conv(conv3, x, (64, 48)),
                           nchw_to_nlc(conv3(nlc_to_nchw(x, (64, 48))))))

    def sima():
        out = {}
        for N, d in [(4096, 48), (32, 64)]:
            qkv = torch.randn(2, N, 3 * 8 * d, device=dev)
            q, k, v = qkv.reshape(2, N, 3, 8, d).permute(2, 0, 3, 1, 4).unbind(0)
            for order in ('qk_first', 'kv_first'):
                out[f'N{N}_d{d}_{order}'] = _rel(sima_core(q, k, v, order),
                                                 sima_core_reference(q, k, v, order))
        return out

    def quadtree():
        out = {}
        for attn_type in ('A', 'B'):
            torch.manual_seed(0)
            m = QuadTreeAttention(64, 2, attn_type=attn_type, num_levels=4, topk=32)
            m = m.to(dev).eval()
            x = torch.randn(2, 120 * 100, 64, device=dev)
            with torch.no_grad():
                fast = m(x, (120, 100))
            out[attn_type] = dict(no_grad_vs_grad=_rel(fast, m(x, (120, 100)).detach()))
            if not cuda and cpu_kernels.quadtree_level_kernel() is not None:
                with torch.no_grad(), cpu_kernels.use_cpu_kernels(False):
                    out[attn_type]['cpu_kernel_vs_pytorch'] = _rel(fast, m(x, (120, 100)))
            if cuda:
                with torch.no_grad():
                    out[attn_type]['device_vs_cpu'] = _rel(fast.cpu(), m.cpu()(x.cpu(),
                                                                                 (120, 100)))
        return out

    def caches():
        torch.manual_seed(0)
        w = ShiftedWindowAttention(96, 3, window_size=7, shift=True).to(dev).eval()
        f = FocusedLinearAttention(32, 1, pretrain_hw_shape=(56, 56)).to(dev).eval()
        nn.init.normal_(f.positional_encoding)
        x, y = torch.randn(2, 60 * 45, 96, device=dev), torch.randn(1, 100 * 80, 32, device=dev)
        with torch.no_grad():
            w(x, (60, 45))
            f(y, (100, 80))
            cached_w, cached_f = w(x, (60, 45)), f(y, (100, 80))
        return dict(window_bias=_rel(cached_w, w(x, (60, 45)).detach()),
                    fla_pos_table=_rel(cached_f, f(y, (100, 80)).detach()))

    def backbones():
        out = {}
        for name, (model, hw) in tiny_backbones().items():
            x = torch.randn(2, 3, *hw)
            model.eval()
            with torch.no_grad():
                ref = model(x)
                model.to(dev)
                got = model(x.to(dev))
            out[name] = dict(device_vs_cpu=max(_rel(a.cpu(), b) for a, b in zip(got, ref)))
        return out

    results: Dict[str, Any] = {}
    try:
        for name, fn in [('fla_core', fla_core), ('token_conv', token_convs), ('sima', sima),
                         ('quadtree', quadtree), ('caches', caches),
                         ('backbones_device_vs_cpu', backbones),
                         ('host_syncs', lambda: backbone_host_syncs(dev))]:
            if name == 'backbones_device_vs_cpu' and not cuda:
                continue
            try:
                results[name] = fn()
            except Exception as err:  # noqa: BLE001 - reported
                results[name] = f'ERROR {type(err).__name__}: {err}'
    finally:
        if cuda:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    return results
