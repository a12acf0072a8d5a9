"""Export rewrites of ``flatten_mm/deploy/rewrites.py`` outside the two-stage ones
(test_two_stage.py): ``nn.AdaptiveAvgPool2d`` as slices (UperNet's PPM), equal to
PyTorch's pooling and general in the exported file."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flatten_mm.deploy import export_onnx
from flatten_mm.deploy.export import compare_with_pytorch
from flatten_mm.deploy.rewrites import export_rewrites
from flatten_mm.deploy.targets import ExportTarget


@pytest.mark.parametrize('bins', [1, 2, 3, 6, (2, 5)])
@pytest.mark.parametrize('hw', [(7, 10), (1, 1), (6, 6), (13, 4)])
def test_adaptive_pool_rewrite_equals_pytorch(bins, hw):
    x = torch.randn(2, 3, *hw, dtype=torch.float64)
    pool = nn.AdaptiveAvgPool2d(bins)
    original = nn.AdaptiveAvgPool2d.forward
    ref = pool(x)
    with export_rewrites() as applied:
        out = pool(x)
    assert 'torch.nn.AdaptiveAvgPool2d (bins as slices)' in applied
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert nn.AdaptiveAvgPool2d.forward is original  # restored after the block


class _PPM(nn.Module):
    """UperNet's pyramid pooling in miniature: pool to 1/2/3/6 bins, resize back, sum."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, 4, 3, stride=8, padding=1)
        self.pools = nn.ModuleList(nn.AdaptiveAvgPool2d(b) for b in (1, 2, 3, 6))

    def forward(self, x):
        x = self.proj(x)
        out = x
        for pool in self.pools:
            out = out + F.interpolate(pool(x), size=x.shape[-2:], mode='bilinear',
                                      align_corners=False)
        return (out, )


def test_adaptive_pool_exports_with_a_dynamic_size(tmp_path):
    torch.manual_seed(0)
    target = ExportTarget(_PPM().eval(), 'backbone', 'ppm', 'x', ['out'])
    # without the rewrite the file fails at a second size (GatherND at export-size
    # indices) and would be declared fixed-size by the export's own probe
    result = export_onnx(target, str(tmp_path / 'ppm.onnx'), (96, 128), dynamic=True)
    assert result.dynamic, result.messages
    for check in compare_with_pytorch(target, result.path, [(96, 128), (72, 200), (40, 56)]):
        assert max(check.diffs) <= 1e-5, check


@pytest.mark.parametrize('approximate', ['none', 'tanh'])
def test_gelu_rewrite_equals_pytorch(approximate):
    x = torch.randn(4, 1000, dtype=torch.float64) * 4
    gelu = nn.GELU(approximate=approximate)
    original = nn.GELU.forward
    ref = gelu(x)
    with export_rewrites() as applied:
        out = gelu(x)
    assert 'torch.nn.GELU (the form ONNX Runtime fuses)' in applied
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    assert nn.GELU.forward is original


class _MLP(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Conv2d(3, 16, 1), nn.GELU(), nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return (self.fc2(self.act(self.fc1(x))), )


def test_exported_gelu_runs_as_one_onnx_runtime_kernel(tmp_path):
    """The rewritten GELU is fused by ONNX Runtime's optimizer (no ``Erf`` left), where
    the exporter's own form runs as five element-wise ops."""
    ort = pytest.importorskip('onnxruntime')
    import onnx
    torch.manual_seed(0)
    target = ExportTarget(_MLP().eval(), 'backbone', 'mlp', 'x', ['out'])
    result = export_onnx(target, str(tmp_path / 'mlp.onnx'), (32, 32))
    assert max(compare_with_pytorch(target, result.path, [(32, 32)])[0].diffs) <= 1e-6
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / 'optimized.onnx')
    opts.log_severity_level = 3
    ort.InferenceSession(result.path, opts, providers=['CPUExecutionProvider'])
    ops = [n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node]
    assert 'Erf' not in ops and ops.count('Gelu') + ops.count('BiasGelu') == 1, ops
