"""Adapter interface, comparison rule and report of the parity check."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from flatten_mm.checkpoints.converters import convert_classifier, key_mismatch_report
from flatten_mm.registry import MODELS

#: default tolerance: max abs difference <= REL_TOL * max(1, max |reference|) per output.
#: Relative to the reference's magnitude because float32 rounding grows with it; floored
#: at 1 because the rounding comes from the O(1) operands of the computation (normed
#: tokens, residual stream), so an output whose values happen to be small must not get a
#: bound far below the noise of the arithmetic that produced it. The shipped fixtures
#: agree to <= 9.1e-7 (FLatten/SimA/QuadTree, every stage and float32 code path); the
#: official float32 outputs themselves differ from float64 by up to ~5e-7 of max|ref|
#: (fixture README), so 1e-5 leaves a 10x margin for other CPUs / larger models while a
#: wrong weight or op (>= 1e-3) still fails by orders of magnitude.
REL_TOL = 1e-5


@dataclass
class StageResult:
    """Comparison of one output point."""
    name: str
    shape: tuple
    max_abs_diff: float
    max_abs_ref: float
    tolerance: float
    passed: bool
    note: str = ''

    @property
    def rel_diff(self) -> float:
        """``max_abs_diff / max(1, max_abs_ref)``, the quantity bounded by ``REL_TOL``."""
        return self.max_abs_diff / max(1.0, self.max_abs_ref)

    def summary(self) -> str:
        """``name: max|diff| ..., rel ... (tol ...)`` in one line."""
        return (f'{self.name}: max|diff| {self.max_abs_diff:.3e}, rel {self.rel_diff:.3e} '
                f'(tol {self.tolerance:.1e})')


@dataclass
class ParityReport:
    """Result of one fixture."""
    fixture: str
    adapter: str
    stages: List[StageResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s.passed for s in self.stages)

    @property
    def worst(self) -> Optional[StageResult]:
        """The output point with the largest relative difference (``None`` if none)."""
        return max(self.stages, key=lambda s: s.rel_diff, default=None)

    def format(self) -> str:
        lines = [f'{self.fixture} [{self.adapter}]']
        for s in self.stages:
            status = 'ok  ' if s.passed else 'FAIL'
            lines.append(f'  {status} {s.name:<22} {str(list(s.shape)):<18} max|diff| {s.max_abs_diff:.3e}'
                         f'  rel {s.rel_diff:.3e}  (tol {s.tolerance:.1e}, max|ref| {s.max_abs_ref:.3g})'
                         + (f'  {s.note}' if s.note else ''))
        worst = self.worst
        lines.append(f'  => {"PASS" if self.passed else "FAIL"}'
                     + (f'; worst {worst.summary()}' if worst else ''))
        return '\n'.join(lines)


class FixtureAdapter:
    """How one family is checked. Subclasses implement ``matches``, ``build``,
    ``convert`` and ``stage_outputs``; ``compare`` may be overridden (QuadTree)."""

    name = 'base'
    #: parameters only the dense backbone has (not in the official state dict)
    dense_only_prefixes: Sequence[str] = ()

    def matches(self, fx: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    def backbone_cfg(self, fx: Mapping[str, Any]) -> dict:
        """Config of the flatten_mm backbone equivalent to ``fx['official_ctor']``."""
        raise NotImplementedError

    def build(self, fx: Mapping[str, Any]) -> nn.Module:
        """The flatten_mm backbone equivalent to ``fx['official_ctor']``."""
        return MODELS.build(self.backbone_cfg(fx))

    def classifier_args(self, fx: Mapping[str, Any]) -> dict:
        """Arguments of ``classifier_cfg`` besides the backbone read from the official
        constructor (SimA: ``tokens_norm``)."""
        return {}

    def family(self, fx: Mapping[str, Any]) -> str:
        """The converter family of the fixture's official state dict."""
        return self.name

    def classifier_points(self, fx: Mapping[str, Any], classifier: nn.Module
                          ) -> Dict[str, Tuple[nn.Module, torch.Tensor]]:
        """Modules inside the converted classifier whose output the fixture also records
        (``name -> (module, reference)``), besides ``features`` and ``logits``."""
        return {}

    def convert(self, fx: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
        """The fixture's official state dict converted to flatten_mm keys."""
        raise NotImplementedError

    def stage_outputs(self, model: nn.Module, x: torch.Tensor) -> Sequence[torch.Tensor]:
        """Outputs at the points named by the fixture's ``stage_outputs_doc``."""
        raise NotImplementedError

    def load(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor],
             allow_missing: Sequence[str] = ()) -> None:
        """Strict load with a readable error; ``allow_missing`` lists prefixes of
        parameters that only the dense backbone has (e.g. new output norms)."""
        expected = {k: v for k, v in model.state_dict().items()
                    if not any(k.startswith(p) for p in allow_missing)}
        problem = key_mismatch_report(state_dict, expected)
        if problem:
            raise KeyError(f'{self.name}: converted state dict does not fit the model:\n{problem}')
        model.load_state_dict(state_dict, strict=False)

    def compare(self, fx: Mapping[str, Any], outputs: Sequence[torch.Tensor],
                rel_tol: float = REL_TOL) -> List[StageResult]:
        """One ``StageResult`` per ``fx['stage_outputs']`` entry (``compare_tensors``)."""
        refs = fx['stage_outputs']
        if len(outputs) != len(refs):
            raise ValueError(f'{self.name}: got {len(outputs)} outputs, fixture has {len(refs)}')
        results = []
        for i, (out, ref) in enumerate(zip(outputs, refs)):
            results.append(compare_tensors(f'stage_outputs[{i}]', out, ref, rel_tol))
        return results


def compare_tensors(name: str, out: torch.Tensor, ref: torch.Tensor,
                    rel_tol: float = REL_TOL) -> StageResult:
    """Max abs difference against ``rel_tol * max(1, max|ref|)``."""
    if tuple(out.shape) != tuple(ref.shape):
        return StageResult(name, tuple(ref.shape), float('inf'), float(ref.abs().max()), 0., False,
                           f'shape {tuple(out.shape)} != reference {tuple(ref.shape)}')
    diff = float((out.detach().double() - ref.double()).abs().max())
    max_ref = float(ref.abs().max())
    tol = rel_tol * max(1.0, max_ref)
    return StageResult(name, tuple(ref.shape), diff, max_ref, tol, diff <= tol)


ADAPTERS: Dict[str, FixtureAdapter] = {}


def register_adapter(cls):
    """Class decorator: register one adapter instance under ``cls.name``."""
    ADAPTERS[cls.name] = cls()
    return cls


def find_adapter(fx: Mapping[str, Any]) -> FixtureAdapter:
    """The adapter whose ``matches`` accepts the fixture."""
    found = [a for a in ADAPTERS.values() if a.matches(fx)]
    if not found:
        ctor = fx.get('official_ctor', {})
        raise ValueError(f"no parity adapter for fixture family {fx.get('family')!r} "
                         f"(official class {ctor.get('cls')!r} in {ctor.get('module')!r}); "
                         f'available adapters: {sorted(ADAPTERS)}')
    return found[0]


def run_parity(fx: Mapping[str, Any], name: Optional[str] = None, rel_tol: float = REL_TOL,
               autograd: bool = False) -> ParityReport:
    """Build, convert, run (eval, float32) and compare one fixture.

    Args:
        fx: the loaded fixture (``shared/fixtures/README.md``).
        name: name shown in the report (default ``fx['name']``).
        rel_tol: each output passes when its max abs difference is at most
            ``rel_tol * max(1, max|ref|)``.
        autograd: run with autograd (grad mode on, an input that requires grad) instead of
            ``torch.no_grad()``: the training code path of operators that have a separate
            inference path (QuadTree's chunked levels and fused CPU kernel).
    """
    if not rel_tol > 0:
        raise ValueError(f'rel_tol must be positive, got {rel_tol}')
    adapter = find_adapter(fx)
    torch.manual_seed(0)
    model = adapter.build(fx)
    adapter.load(model, adapter.convert(fx), adapter.dense_only_prefixes)
    model.eval()
    x = fx['input'].float()
    if autograd:
        with torch.enable_grad():
            outputs = adapter.stage_outputs(model, x.clone().requires_grad_(True))
    else:
        with torch.no_grad():
            outputs = adapter.stage_outputs(model, x)
    outputs = [o.detach() for o in outputs]
    results = adapter.compare(fx, outputs, rel_tol)
    if fx.get('logits') is not None:
        results += compare_classifier(adapter, fx, rel_tol, autograd)
    return ParityReport(name or fx.get('name', '?'), adapter.name, results)


def build_classifier(adapter: FixtureAdapter, fx: Mapping[str, Any]) -> nn.Module:
    """The mmpretrain ``ImageClassifier`` of the fixture's official classifier
    (``flatten_mm.models.classification.classifier_cfg``) with the official state dict
    converted by ``convert_classifier`` and loaded strictly: every parameter of the
    classifier comes from the official file."""
    from flatten_mm.models.classification import build_classifier as build, classifier_cfg
    cfg = classifier_cfg(adapter.backbone_cfg(fx), num_classes=fx['logits'].shape[1],
                         **adapter.classifier_args(fx))
    torch.manual_seed(0)
    model = build(cfg)
    state_dict, _ = convert_classifier(fx['state_dict'], adapter.family(fx))
    problem = key_mismatch_report(state_dict, model.state_dict())
    if problem:
        raise KeyError(f'{adapter.name}: converted classifier does not fit the mmpretrain '
                       f'classifier:\n{problem}')
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def compare_classifier(adapter: FixtureAdapter, fx: Mapping[str, Any], rel_tol: float = REL_TOL,
                       autograd: bool = False) -> List[StageResult]:
    """``features`` (the head's input) and ``logits`` of the converted official
    classifier against the fixture, and the intermediate points the adapter names
    (``classifier_points``: SimA's class-attention blocks)."""
    model = build_classifier(adapter, fx)
    x = fx['input'].float()
    points = adapter.classifier_points(fx, model)
    seen: Dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_hook(
        lambda _m, _i, out, name=name: seen.__setitem__(name, out.detach()))
        for name, (module, _) in points.items()]
    try:
        with torch.set_grad_enabled(autograd):
            if autograd:
                x = x.clone().requires_grad_(True)
            features = model.head.pre_logits(model.extract_feat(x))
            logits = model.head.fc(features)
    finally:
        for hook in hooks:
            hook.remove()
    results = [compare_tensors(name, seen[name], ref, rel_tol)
               for name, (_, ref) in points.items()]
    if fx.get('features') is not None:
        results.append(compare_tensors('features', features.detach(), fx['features'], rel_tol))
    results.append(compare_tensors('logits', logits.detach(), fx['logits'], rel_tol))
    return results
