"""The ahead-of-time limit table of the Triton kernels, as the dispatch reads it.

``kernel_limits.json`` (beside this file) holds, for every kernel specialisation the
dispatch can launch (rows named by the kernel modules' ``limit_key``), the shared memory
per block that Triton's compiler allocates for it on each target (compiled without a GPU by
``dev/kernel_limits.py``, which also writes the readable table
``docs/benchmarks/kernel_limits.md``). The dispatch compares it with the device's
``shared_memory_per_block_optin`` before a kernel's first use.
"""
import json
import os.path as osp
from functools import lru_cache
from typing import Dict, Optional, Tuple

PATH = osp.join(osp.dirname(osp.abspath(__file__)), 'kernel_limits.json')


@lru_cache(maxsize=None)
def table() -> Dict[str, Dict[str, Dict[str, int]]]:
    """``{family: {row: {'sm_80': shared bytes, ...}}}`` (empty if the file is missing)."""
    if not osp.isfile(PATH):
        return {}
    with open(PATH) as f:
        return json.load(f)['shared_bytes']


def shared_bytes(family: str, key: str, capability: Tuple[int, int]) -> Optional[int]:
    """Shared memory per block of the row ``key`` on a device of ``capability``: the value
    compiled for that target, else the largest over the targets compiled (``None`` if the
    row is not in the table)."""
    row = table().get(family, {}).get(key)
    if not row:
        return None
    exact = row.get(f'sm_{capability[0]}{capability[1]}')
    return exact if exact is not None else max(row.values())
