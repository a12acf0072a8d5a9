"""Adapter interface, comparison rule and report of the parity check."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ..converters import key_mismatch_report

#: relative tolerance: max abs difference <= REL_TOL * max(1, max |reference|)
REL_TOL = 1e-4


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
        return self.max_abs_diff / max(1.0, self.max_abs_ref)


@dataclass
class ParityReport:
    """Result of one fixture."""
    fixture: str
    adapter: str
    stages: List[StageResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s.passed for s in self.stages)

    def format(self) -> str:
        lines = [f'{self.fixture} [{self.adapter}]']
        for s in self.stages:
            status = 'ok  ' if s.passed else 'FAIL'
            lines.append(f'  {status} {s.name:<22} {str(list(s.shape)):<18} max|diff| {s.max_abs_diff:.3e}'
                         f'  rel {s.rel_diff:.3e}  (tol {s.tolerance:.1e}, max|ref| {s.max_abs_ref:.3g})'
                         + (f'  {s.note}' if s.note else ''))
        lines.append(f'  => {"PASS" if self.passed else "FAIL"}')
        return '\n'.join(lines)


class FixtureAdapter:
    """How one family is checked. Subclasses implement ``matches``, ``build``,
    ``convert`` and ``stage_outputs``; ``compare`` may be overridden (QuadTree)."""

    name = 'base'
    #: parameters only the dense backbone has (not in the official state dict)
    dense_only_prefixes: Sequence[str] = ()

    def matches(self, fx: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    def build(self, fx: Mapping[str, Any]) -> nn.Module:
        """The flatten_mm backbone equivalent to ``fx['official_ctor']``."""
        raise NotImplementedError

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

    def compare(self, fx: Mapping[str, Any], outputs: Sequence[torch.Tensor]) -> List[StageResult]:
        refs = fx['stage_outputs']
        if len(outputs) != len(refs):
            raise ValueError(f'{self.name}: got {len(outputs)} outputs, fixture has {len(refs)}')
        results = []
        for i, (out, ref) in enumerate(zip(outputs, refs)):
            results.append(compare_tensors(f'stage_outputs[{i}]', out, ref))
        return results


def compare_tensors(name: str, out: torch.Tensor, ref: torch.Tensor,
                    rel_tol: float = REL_TOL) -> StageResult:
    """Max abs difference against ``rel_tol * max(1, max|ref|)``."""
    if tuple(out.shape) != tuple(ref.shape):
        return StageResult(name, tuple(ref.shape), float('inf'), float(ref.abs().max()), 0., False,
                           f'shape {tuple(out.shape)} != reference {tuple(ref.shape)}')
    diff = float((out.double() - ref.double()).abs().max())
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


def run_parity(fx: Mapping[str, Any], name: Optional[str] = None) -> ParityReport:
    """Build, convert, run (eval, no grad, float32) and compare one fixture."""
    adapter = find_adapter(fx)
    torch.manual_seed(0)
    model = adapter.build(fx)
    adapter.load(model, adapter.convert(fx), adapter.dense_only_prefixes)
    model.eval()
    with torch.no_grad():
        outputs = adapter.stage_outputs(model, fx['input'].float())
    return ParityReport(name or fx.get('name', '?'), adapter.name, adapter.compare(fx, outputs))
