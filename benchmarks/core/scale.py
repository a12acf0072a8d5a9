"""Scale suite: the largest square image whose training step fits a memory budget.

For ours and each softmax counterpart (``cases.BACKBONE_PAIRS``), with and without
gradient checkpointing on both sides, the suite looks for the largest side ``S`` (a
multiple of ``step``) at which one training step at batch 1 (``train.backbone_step``:
forward, loss, backward, AdamW step) fits under ``budget_gb``, and records the step time
and the memory at every side it tried.

Every probe runs in a child process, so that a step that does not fit cannot take the
benchmark (or the machine) down with it:

* **CPU**: the step fits when the child's peak resident set (the kernel's ``ru_maxrss``,
  torch's own libraries included: the same few hundred MiB on both sides of a pair) stays
  within the budget; the parent kills a child whose resident set passes the budget, and
  an address-space limit (the budget plus the libraries' mappings) stops a runaway
  allocation before the machine runs out.
* **CUDA**: the step fits when it raises no out-of-memory error and
  ``torch.cuda.max_memory_allocated`` (which starts at the parameters) stays under the
  budget; that peak is the memory recorded.

The search doubles from ``start`` while steps fit, then bisects between the last side
that fitted and the first that did not, down to ``step``.
"""
import json
import os
import os.path as osp
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

#: repository root (the child imports ``benchmarks`` from there)
ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SCALE_COLUMNS = ('name', 'source', 'device', 'with_cp', 'budget_gb', 'side', 'fits',
                 'step_s', 'peak_mem_mb', 'error')
#: the error of a probe whose model cannot checkpoint (``enable_checkpointing``): no size
#: fits or fails, the search stops and the summary says so
NO_CHECKPOINTING = 'has no gradient checkpointing switch'


def enable_checkpointing(model: nn.Module) -> nn.Module:
    """Gradient checkpointing of every block: timm's ``set_grad_checkpointing``, else
    every submodule with a ``with_cp`` flag (ours and mmdet's / mmseg's backbones)."""
    if hasattr(model, 'set_grad_checkpointing'):
        model.set_grad_checkpointing(True)
        return model
    flagged = [m for m in model.modules() if hasattr(m, 'with_cp')]
    if not flagged:
        raise ValueError(f'{type(model).__name__} has no gradient checkpointing switch')
    for m in flagged:
        m.with_cp = True
    return model


def probe(name: str, side: int, with_cp: bool, device: str = 'cpu',
          quick: bool = False, budget_gb: Optional[float] = None) -> Dict[str, Any]:
    """One training step of ``name`` at ``side`` x ``side``, batch 1, in this process
    (what the child runs). Returns ``fits``, ``step_s`` and ``peak_mem_mb``."""
    from .cases import backbone_cases
    from .train import backbone_step

    case = backbone_cases(quick=quick)[name]
    dev = torch.device(device)
    torch.manual_seed(0)
    model = case.build((side, side)).to(dev)
    if with_cp:
        enable_checkpointing(model)
    x = torch.randn(1, 3, side, side, device=dev)
    step = backbone_step(model, lambda inp: case.run(model, inp), x, 'train')
    if dev.type == 'cuda':
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    loss = step()
    if dev.type == 'cuda':
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    if dev.type == 'cuda':
        peak = torch.cuda.max_memory_allocated(dev) / 2**20
    else:  # ru_maxrss: KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    fits = bool(torch.isfinite(loss)) and (budget_gb is None or dev.type != 'cuda'
                                           or peak <= budget_gb * 1024)
    return dict(fits=fits, step_s=round(seconds, 3), peak_mem_mb=round(peak, 1))


#: address space a child may map beyond the budget (torch's libraries and thread arenas
#: map ~3 GiB of address space that is never resident); a hard stop against runaway
#: allocations while the parent watches the resident set
_MAPPING_HEADROOM = 6 * 2**30


def _rss_bytes(pid: int) -> int:
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                if line.startswith('VmRSS:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run_watched(cmd: List[str], budget_bytes: Optional[int], timeout_s: Optional[float],
                 env: Dict[str, str]) -> Dict[str, Any]:
    """Run ``cmd``; on CPU (``budget_bytes``) kill it once its resident set passes the
    budget. Returns ``stdout``, ``stderr``, ``returncode``, ``maxrss`` (bytes, from the
    kernel's accounting of the child) and ``killed`` (why, or ``''``)."""
    def limit():
        if budget_bytes is not None:
            cap = budget_bytes + _MAPPING_HEADROOM
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    killed = ''
    with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, preexec_fn=limit, cwd=ROOT,
                                env=env)
        start = time.monotonic()
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if budget_bytes is not None and _rss_bytes(proc.pid) > budget_bytes:
                killed = 'resident memory over the budget'
            elif timeout_s is not None and time.monotonic() - start > timeout_s:
                killed = f'timed out after {timeout_s:.0f} s'
            if killed:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return dict(stdout=stdout, stderr=stderr, returncode=proc.returncode,
                maxrss=usage.ru_maxrss * 1024, killed=killed)


def run_probe(name: str, side: int, with_cp: bool, budget_gb: float, device: str = 'cpu',
              quick: bool = False, threads: Optional[int] = None,
              timeout_s: Optional[float] = None) -> Dict[str, Any]:
    """``probe`` in a child process under the budget; a row of ``SCALE_COLUMNS``. On CPU
    the step fits when the child's peak resident set (the kernel's ``ru_maxrss``) stays
    within ``budget_gb``."""
    args = dict(name=name, side=side, with_cp=with_cp, device=device, quick=quick,
                budget_gb=budget_gb)
    code = ('import json, sys, torch\n'
            f'sys.path.insert(0, {ROOT!r})\n'
            + (f'torch.set_num_threads({int(threads)})\n' if threads else '')
            + 'from benchmarks.core.scale import probe\n'
            f'print("SCALE_RESULT " + json.dumps(probe(**{args!r})))\n')
    cpu = torch.device(device).type == 'cpu'
    budget = int(budget_gb * 2**30)
    result = _run_watched([sys.executable, '-c', code], budget if cpu else None, timeout_s,
                          dict(os.environ, PYTHONWARNINGS='ignore'))
    row = dict(name=name, device=device, with_cp=with_cp, budget_gb=budget_gb, side=side,
               fits=False, step_s='', peak_mem_mb='', error=result['killed'])
    for line in result['stdout'].splitlines():
        if line.startswith('SCALE_RESULT '):
            row.update(json.loads(line[len('SCALE_RESULT '):]))
    if cpu:  # the kernel's peak of the whole child, not only of the step
        row['peak_mem_mb'] = round(result['maxrss'] / 2**20, 1)
        row['fits'] = bool(row['fits']) and result['maxrss'] <= budget
    if not row['fits'] and not row['error']:
        tail = result['stderr'].strip().splitlines()
        row['error'] = (tail[-1] if tail else f'exit code {result["returncode"]}')[:300]
        if row['peak_mem_mb'] != '' and not tail:
            row['error'] = 'resident memory over the budget'
    return row


def largest_side(name: str, with_cp: bool, budget_gb: float, start: int = 1024,
                 step: int = 256, max_side: int = 8192,
                 run: Optional[Callable[..., Dict[str, Any]]] = None,
                 **kwargs) -> List[Dict[str, Any]]:
    """Every probe of the search for the largest side of ``name`` (rows in the order
    run); the largest fitting side is ``max(r['side'] for r in rows if r['fits'])``.
    ``run`` probes one side (default ``run_probe``)."""
    run = run or run_probe
    if start % step or start < step:
        raise ValueError(f'start ({start}) must be a positive multiple of step ({step})')
    rows: List[Dict[str, Any]] = []

    def fits(side: int) -> bool:
        rows.append(run(name, side, with_cp, budget_gb, **kwargs))
        return bool(rows[-1]['fits'])

    good, bad = 0, None
    side = start
    while side <= max_side:  # doubling
        if not fits(side):
            bad = side
            break
        good, side = side, side * 2
    if bad is None or NO_CHECKPOINTING in str(rows[-1].get('error', '')):
        return rows
    while bad - good > step:  # bisection on multiples of ``step``
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return rows


def run_scale_benchmark(pairs: Dict[str, Sequence[str]], budget_gb: float,
                        with_cp: Sequence[bool] = (False, True), device: str = 'cpu',
                        start: int = 1024, step: int = 256, max_side: int = 8192,
                        quick: bool = False, threads: Optional[int] = None,
                        timeout_s: Optional[float] = None,
                        on_row: Optional[Callable[[Dict[str, Any]], None]] = None
                        ) -> List[Dict[str, Any]]:
    """The search for every backbone of ``pairs`` (ours and its baselines, each once) and
    every ``with_cp`` setting; rows of ``SCALE_COLUMNS`` (``on_row`` sees each search's rows
    as it ends, e.g. to save them)."""
    from .cases import backbone_cases
    cases = backbone_cases(quick=quick)
    names: List[str] = []
    for ours, baselines in pairs.items():
        names += [n for n in (ours, *baselines) if n in cases and n not in names]
    rows: List[Dict[str, Any]] = []
    for cp in with_cp:
        for name in names:
            found = largest_side(name, cp, budget_gb, start=start, step=step,
                                 max_side=max_side, device=device, quick=quick,
                                 threads=threads, timeout_s=timeout_s)
            for r in found:
                r['source'] = cases[name].source
            rows += found
            if on_row is not None:
                for r in found:
                    on_row(r)
    return rows


def scale_summary(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per backbone and ``with_cp``: the largest fitting side, its step time and memory,
    and the first side that did not fit."""
    out: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        key = (r['name'], bool(r['with_cp']))
        s = out.setdefault(key, dict(name=r['name'], with_cp=bool(r['with_cp']),
                                     budget_gb=r['budget_gb'], largest_side=0, step_s='',
                                     peak_mem_mb='', first_failing_side=''))
        fits = r['fits'] in (True, 'True', 'true', 1)
        if NO_CHECKPOINTING in str(r.get('error', '')):
            s['first_failing_side'] = 'no with_cp switch'
        elif fits and int(r['side']) > s['largest_side']:
            s.update(largest_side=int(r['side']), step_s=r['step_s'],
                     peak_mem_mb=r['peak_mem_mb'])
        elif not fits and (s['first_failing_side'] == ''
                           or isinstance(s['first_failing_side'], int)
                           and int(r['side']) < s['first_failing_side']):
            s['first_failing_side'] = int(r['side'])
    return list(out.values())
