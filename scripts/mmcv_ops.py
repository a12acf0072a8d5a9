"""How ``scripts/setup_env.sh`` builds mmcv's compiled ops, and the check after install.

    python scripts/mmcv_ops.py plan     # shell assignments for setup_env.sh, or exit 2
    python scripts/mmcv_ops.py verify   # run mmcv's ops on every device present

mmdet's RoIAlign / nms and mmseg's ops run on the device of their inputs: a GPU user needs
mmcv built with its CUDA ops, a CPU user its CPU ops. The flavour follows the machine the
environment is set up on, unless asked otherwise:

=====================  ===========  ====================================================
FLATTEN_MM_MMCV_OPS    GPU visible  mmcv gets
=====================  ===========  ====================================================
(unset)                no           CPU ops (~16 min once on 2 cores); one line says how
                                    to get the CUDA ops instead
(unset)                yes          CUDA ops for the visible GPUs (nvcc of torch's CUDA
                                    major version, else stop before the build)
``cuda``               either       CUDA ops for ``TORCH_CUDA_ARCH_LIST``, else the
                                    visible GPUs, else every architecture torch supports
                                    (a login node or image builder building for GPU nodes)
``cpu``                no           CPU ops
``cpu``                yes          refused: mmdet / mmseg on the GPU need the CUDA ops
=====================  ===========  ====================================================

A CPU build of torch always gets the CPU ops (``cuda`` is refused). A switch given to
``setup_env.sh`` is remembered by the environment (``<venv>/.flatten_mm_mmcv_ops``) and
used by later runs when the variable is unset; every message that depends on it names
that file and how to clear it. The build uses ``MAX_JOBS`` compile jobs: the cores the
machine has, within its memory, unless set.

The cached wheel is keyed on torch's version, the flavour and the architectures
(``cu130-sm90``, ``cpu``), so a wheel built for one never installs for another.
"""
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: what FLATTEN_MM_MMCV_OPS may say
SWITCH = 'FLATTEN_MM_MMCV_OPS'
#: the file in the environment that remembers the switch given to setup_env.sh
CHOICE_FILE = '.flatten_mm_mmcv_ops'
#: memory one compile job may take (GiB): nvcc on mmcv's CUDA sources, g++ on its C++ ones
JOB_GIB = {'cuda': 4.0, 'cpu': 1.5}


@dataclass
class Plan:
    """The build decision: ``ops`` ``'cuda'`` / ``'cpu'``, the cache ``tag``, the
    environment of the build, and ``error`` (stop before the build) or ``notes``."""
    ops: str = 'cpu'
    tag: str = 'cpu'
    env: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    def shell(self) -> str:
        """``KEY=value`` lines for ``eval`` in bash."""
        lines = [f'MMCV_OPS={self.ops}', f'MMCV_TAG={self.tag}']
        lines += [f'export {k}={_quote(v)}' for k, v in sorted(self.env.items())]
        lines += [f'echo {_quote("[mmcv] " + n)}' for n in self.notes]
        return '\n'.join(lines)


def _quote(value: str) -> str:
    return "'" + str(value).replace("'", "'\\''") + "'"


def nvcc_version(nvcc: str, run: Callable = subprocess.run) -> Optional[str]:
    """``'13.0'`` from ``nvcc --version`` (``None`` if it does not run)."""
    try:
        out = run([nvcc, '--version'], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    marker = 'release '  # ('Cuda compilation tools, release 13.0, V13.0.88')
    if marker not in out:
        return None
    return out.split(marker, 1)[1].split(',')[0].strip()


def find_nvcc(env: Dict[str, str], which: Callable[[str], Optional[str]] = shutil.which,
              exists: Callable[[str], bool] = os.path.isfile,
              realpath: Callable[[str], str] = os.path.realpath) -> Optional[str]:
    """nvcc of the CUDA toolkit the build will use: ``$CUDA_HOME/bin/nvcc`` (or
    ``$CUDA_PATH``), else the one on ``PATH`` when it sits in a toolkit (``bin/nvcc`` beside
    ``include/cuda.h``; a wrapper script elsewhere is not one), else the default toolkit
    ``/usr/local/cuda``."""
    for var in ('CUDA_HOME', 'CUDA_PATH'):
        if env.get(var) and exists(os.path.join(env[var], 'bin', 'nvcc')):
            return os.path.join(env[var], 'bin', 'nvcc')
    found = which('nvcc')
    if found:
        found = realpath(found)
        if exists(os.path.join(os.path.dirname(os.path.dirname(found)), 'include', 'cuda.h')):
            return found
    default = '/usr/local/cuda/bin/nvcc'
    return default if exists(default) else found


def compile_jobs(ops: str, cpus: Optional[int], mem_gib: Optional[float]) -> int:
    """Parallel compile jobs for the build: one per core, as many as the memory holds
    (``JOB_GIB`` per job), at least one."""
    jobs = max(1, cpus or 1)
    if mem_gib:
        jobs = min(jobs, int(mem_gib // JOB_GIB[ops]))
    return max(1, jobs)


def plan(torch_version: str, torch_cuda: Optional[str], gpu_arches: Sequence[str],
         nvcc: Optional[str], nvcc_ver: Optional[str], env: Dict[str, str],
         torch_arches: Sequence[str] = (), remembered: Optional[Tuple[str, str]] = None,
         cpus: Optional[int] = None, mem_gib: Optional[float] = None) -> Plan:
    """The decision, from facts only (the table of the module docstring; tested with
    every combination).

    Args:
        torch_version: ``torch.__version__``.
        torch_cuda: ``torch.version.cuda`` (``None``: a CPU build).
        gpu_arches: compute capabilities of the visible GPUs (``['9.0']``; empty: none).
        nvcc: path of the nvcc found (``None``: none).
        nvcc_ver: its version (``'13.0'``).
        env: the environment (``FLATTEN_MM_MMCV_OPS``, ``TORCH_CUDA_ARCH_LIST``,
            ``MAX_JOBS``).
        torch_arches: the architectures torch itself was built for
            (``torch.cuda.get_arch_list()``: ``['sm_75', ..., 'sm_120']``), the targets of
            an explicit CUDA build when no GPU is visible and ``TORCH_CUDA_ARCH_LIST`` is
            unset (torch's builder finds none by itself then and fails).
        remembered: ``(value, file)`` of a switch remembered by the environment, used
            when ``FLATTEN_MM_MMCV_OPS`` is unset.
        cpus, mem_gib: the machine's cores and available memory (``MAX_JOBS``).
    """
    choice, source = env.get(SWITCH, '').strip().lower(), f'{SWITCH}={env.get(SWITCH, "")}'
    if not choice and remembered:
        choice = remembered[0].strip().lower()
        source = (f'{SWITCH}={remembered[0].strip()} (remembered in {remembered[1]} from an '
                  f'earlier run: delete that file, or set {SWITCH}, to change it)')
    result = _decide(torch_version, torch_cuda, gpu_arches, nvcc, nvcc_ver, env,
                     torch_arches, choice, source)
    if result.error is None:
        if env.get('MAX_JOBS', '').strip():
            jobs = env['MAX_JOBS'].strip()
        else:
            jobs = str(compile_jobs(result.ops, cpus, mem_gib))
            result.env['MAX_JOBS'] = jobs
        result.notes.append(f'{jobs} compile jobs (MAX_JOBS)')
    return result


def _decide(torch_version: str, torch_cuda: Optional[str], gpu_arches: Sequence[str],
            nvcc: Optional[str], nvcc_ver: Optional[str], env: Dict[str, str],
            torch_arches: Sequence[str], choice: str, source: str) -> Plan:
    if choice not in ('', 'cuda', 'cpu'):
        return Plan(error=f'{source}: say cuda or cpu (or leave it unset)')
    if torch_cuda is None:
        if choice == 'cuda':
            return Plan(error=f'{source} but torch {torch_version} is a CPU build: '
                        'install a CUDA build of torch first (pip install torch from the '
                        'CUDA index of your CUDA version)')
        return Plan(notes=[f'torch {torch_version} is a CPU build: mmcv with its CPU ops'])
    if choice == 'cpu':
        if gpu_arches:
            return Plan(error=(
                f'{source}, but a GPU is visible (compute capability '
                f'{", ".join(gpu_arches)}): mmdet / mmseg on it need mmcv\'s CUDA ops (RoIAlign, '
                f'nms). Leave {SWITCH} unset to build them (nvcc {torch_cuda} required).'))
        return Plan(notes=[f'{source}: mmcv with its CPU ops only (mmdet / mmseg ops will '
                           'not run on CUDA tensors with this wheel)'])
    if choice == '' and not gpu_arches:
        return Plan(notes=[
            'no GPU visible: mmcv with its CPU ops. For the CUDA ops (to build here for GPU '
            f'machines): {SWITCH}=cuda TORCH_CUDA_ARCH_LIST="9.0" bash scripts/setup_env.sh'])
    major = torch_cuda.split('.')[0]
    why = source if choice else 'a GPU is visible'
    install = (f'install the CUDA {torch_cuda} toolkit (at least its compiler: e.g. `conda '
               f'install -c nvidia cuda-nvcc={torch_cuda}` or NVIDIA\'s CUDA toolkit '
               f'installer) and point CUDA_HOME at it (export CUDA_HOME=/usr/local/cuda-'
               f'{torch_cuda}); or {SWITCH}=cpu for the CPU ops only'
               + (' (refused while a GPU is visible)' if gpu_arches else ''))
    if nvcc is None:
        return Plan(error=f'{why}, so mmcv is built with its CUDA ops for torch '
                    f'{torch_version} (CUDA {torch_cuda}), which needs nvcc: none found '
                    f'(CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda). {install}.')
    if nvcc_ver is None or nvcc_ver.split('.')[0] != major:
        return Plan(error=f'{why}, so mmcv is built with its CUDA ops, but torch '
                    f'{torch_version} was built with CUDA {torch_cuda} and {nvcc} is CUDA '
                    f'{nvcc_ver or "of an unknown version"}: torch builds extensions only '
                    f'with the same CUDA major version. {install}.')
    arch_list = env.get('TORCH_CUDA_ARCH_LIST', '').strip()
    if not arch_list:
        arches = gpu_arches or [f'{a[3:-1]}.{a[-1]}' for a in torch_arches
                                if a.startswith('sm_') and a[3:].isdigit()]
        arch_list = ';'.join(sorted(set(arches), key=lambda a: float(a.split('+')[0])))
    if not arch_list:
        return Plan(error='no GPU is visible and torch names no architecture it was built '
                    'for: set TORCH_CUDA_ARCH_LIST to the GPUs the wheel is for (e.g. '
                    '"8.0;9.0")')
    arch_tag = 'sm' + '-sm'.join(a.replace('.', '').replace('+PTX', 'ptx')
                                 for a in arch_list.replace(',', ';').replace(' ', ';').split(';')
                                 if a)
    build_env = dict(FORCE_CUDA='1', CUDA_HOME=os.path.dirname(os.path.dirname(nvcc)),
                     TORCH_CUDA_ARCH_LIST=arch_list)
    notes = [f'{why}: mmcv with its CUDA ops for torch {torch_version} (CUDA {torch_cuda}; '
             f'nvcc {nvcc_ver} at {nvcc}; GPU architectures {arch_list})']
    if not gpu_arches and not env.get('TORCH_CUDA_ARCH_LIST', '').strip():
        notes.append('no GPU visible: built for every architecture torch supports (slow: '
                     'TORCH_CUDA_ARCH_LIST="9.0" builds for one, e.g. H100 / H200)')
    return Plan(ops='cuda', tag=f'cu{torch_cuda.replace(".", "")}-{arch_tag}', env=build_env,
                notes=notes)


def remembered_choice(prefix: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """``(value, file)`` of the switch the environment at ``prefix`` (default: this
    Python's, ``sys.prefix``) remembers."""
    path = os.path.join(prefix or sys.prefix, CHOICE_FILE)
    try:
        with open(path, encoding='utf-8') as f:
            value = f.read().strip()
    except OSError:
        return None
    return (value, path) if value else None


def _memory_gib() -> Optional[float]:
    """Available memory (``MemAvailable`` of /proc/meminfo), ``None`` where unknown."""
    try:
        with open('/proc/meminfo', encoding='ascii') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def _facts(env: Dict[str, str]):
    """This machine's facts for ``plan``."""
    import torch
    arches = []
    if torch.cuda.is_available():
        arches = ['%d.%d' % torch.cuda.get_device_capability(i)
                  for i in range(torch.cuda.device_count())]
    nvcc = find_nvcc(env) if torch.version.cuda else None
    torch_arches = torch.cuda.get_arch_list() if torch.version.cuda else []
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    return dict(torch_version=torch.__version__.split('+')[0], torch_cuda=torch.version.cuda,
                gpu_arches=arches, nvcc=nvcc, nvcc_ver=nvcc_version(nvcc) if nvcc else None,
                torch_arches=torch_arches, cpus=cpus, mem_gib=_memory_gib())


def mmcv_flavour() -> str:
    """``'cuda'`` if the installed mmcv was compiled with CUDA, else ``'cpu'``."""
    from mmcv.ops import get_compiling_cuda_version
    version = get_compiling_cuda_version()
    return 'cpu' if version in (None, '', 'not available') else 'cuda'


def verify(expected: Optional[str] = None) -> List[str]:
    """Problems of the installed mmcv (empty: none): its ops run on the CPU and, where a
    GPU is visible, on it (a CPU-only mmcv meeting a GPU fails here, loudly, instead of at
    the first RoIAlign of a training run); ``expected`` the flavour it must have."""
    import torch
    from mmcv.ops import nms, roi_align
    problems = []
    flavour = mmcv_flavour()
    if expected and flavour != expected:
        problems.append(f'mmcv has {flavour} ops, expected {expected}')
    devices = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])
    for dev in devices:
        try:
            boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.]], device=dev)
            nms(boxes, torch.tensor([0.9, 0.8], device=dev), 0.5)
            feats = torch.randn(1, 2, 8, 8, device=dev)
            rois = torch.tensor([[0., 0., 0., 4., 4.]], device=dev)
            roi_align(feats, rois, (2, 2), 1.0, 0, 'avg', True)
        except Exception as e:  # (an op without a kernel for the device)
            problems.append(f'mmcv ops on {dev}: {type(e).__name__}: '
                            f'{str(e).splitlines()[0] if str(e) else ""}')
    if 'cuda' in devices and flavour == 'cpu':
        remembered = remembered_choice()
        problems.append('a GPU is visible but mmcv was built without CUDA ops: rerun '
                        f'scripts/setup_env.sh without {SWITCH}=cpu'
                        + (f' (remembered in {remembered[1]}: delete that file first)'
                           if remembered else '')
                        + ' to build them')
    return problems


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ('plan', 'verify', 'flavour'):
        print(__doc__)
        return 2
    if argv[0] == 'plan':
        p = plan(**_facts(dict(os.environ)), env=dict(os.environ),
                 remembered=remembered_choice())
        if p.error:
            print(f'[mmcv] cannot build mmcv: {p.error}', file=sys.stderr)
            return 2
        print(p.shell())
        return 0
    if argv[0] == 'flavour':
        try:
            print(mmcv_flavour())
        except Exception:  # (no mmcv, or no ops)
            print('none')
        return 0
    problems = verify(argv[1] if len(argv) > 1 else None)
    for msg in problems:
        print(f'[mmcv] {msg}', file=sys.stderr)
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
