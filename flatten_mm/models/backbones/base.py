"""Small shared pieces of the dense backbones: arch tables, output contract, freezing."""
import copy
from typing import Dict, Iterable, Sequence, Tuple, Union

import torch.nn as nn


def resolve_arch(arch: Union[str, dict], arch_zoo: Dict[str, dict],
                 required_keys: Iterable[str], owner: str) -> dict:
    """Pick a variant from ``arch_zoo`` (aliases allowed) or validate a custom dict.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or a custom dict
            whose keys differ from ``required_keys``.
    """
    required = set(required_keys)
    if isinstance(arch, str):
        key = arch.lower()
        if key not in arch_zoo:
            names = ', '.join(sorted(arch_zoo))
            raise ValueError(f'{owner}: unknown arch {arch!r}; valid archs: {names}')
        return copy.deepcopy(arch_zoo[key])
    if not isinstance(arch, dict):
        raise TypeError(f'{owner}: arch must be a name or a dict, got {type(arch).__name__}')
    missing = required - set(arch)
    unknown = set(arch) - required
    if missing or unknown:
        raise ValueError(f'{owner}: custom arch dict must have exactly the keys '
                         f'{sorted(required)}; missing {sorted(missing)}, unexpected {sorted(unknown)}')
    return copy.deepcopy(arch)


def check_out_indices(out_indices: Sequence[int], num_stages: int, owner: str) -> Tuple[int, ...]:
    """Validate ``out_indices`` (negative indices count from the end)."""
    if isinstance(out_indices, int):
        out_indices = (out_indices, )
    result = []
    for i in out_indices:
        j = i + num_stages if i < 0 else i
        if not 0 <= j < num_stages:
            raise ValueError(f'{owner}: out_indices entry {i} is out of range for '
                             f'{num_stages} stages (valid 0..{num_stages - 1})')
        result.append(j)
    if len(set(result)) != len(result):
        raise ValueError(f'{owner}: out_indices {tuple(out_indices)} has duplicates')
    return tuple(sorted(result))


def check_frozen_stages(frozen_stages: int, num_stages: int, owner: str) -> int:
    """Validate ``frozen_stages`` (-1 = nothing frozen)."""
    if not -1 <= frozen_stages < num_stages:
        raise ValueError(f'{owner}: frozen_stages must be in [-1, {num_stages - 1}], '
                         f'got {frozen_stages}')
    return frozen_stages


def freeze(module: nn.Module) -> None:
    """Put ``module`` in eval mode and stop its gradients."""
    module.eval()
    for p in module.parameters():
        p.requires_grad = False


def expand_per_stage(cfg, num_stages: int, name: str) -> list:
    """A per-stage list from one value (dict/scalar) or a sequence of ``num_stages``."""
    if isinstance(cfg, (list, tuple)):
        if len(cfg) != num_stages:
            raise ValueError(f'{name} has {len(cfg)} entries, expected {num_stages}')
        return [copy.deepcopy(c) for c in cfg]
    return [copy.deepcopy(cfg) for _ in range(num_stages)]
