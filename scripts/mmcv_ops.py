"""How ``scripts/setup_env.sh`` builds mmcv's compiled ops, and the check after install.

    python scripts/mmcv_ops.py plan     # shell assignments for setup_env.sh, or exit 2
    python scripts/mmcv_ops.py verify   # run mmcv's ops on every device present

mmdet's RoIAlign / nms and mmseg's ops run on the device of their inputs: a GPU user needs
mmcv built with its CUDA ops, a CPU user its CPU ops. The flavour follows the installed
torch, not the machine the build happens to run on:

* torch is a CPU build: CPU ops (tag ``cpu``).
* torch is a CUDA build: CUDA ops (``FORCE_CUDA=1``: whether or not a GPU is visible, so a
  wheel built on a login node or in CI runs on the GPU nodes), which need ``nvcc`` of the
  CUDA major version torch was built with; without it the plan stops *before* the build
  and says what to install. ``FLATTEN_MM_MMCV_OPS=cpu`` builds the CPU ops instead, on
  purpose (CPU-only machines, CI); with a GPU visible that is refused. The target GPU
  architectures are ``TORCH_CUDA_ARCH_LIST`` if set, else those of the visible GPUs, else
  every architecture torch itself was built for.

The cached wheel is keyed on torch's version, the flavour and the architectures
(``cu130-sm90``, ``cpu``), so a wheel built for one never installs for another.
"""
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

#: what FLATTEN_MM_MMCV_OPS may say
SWITCH = 'FLATTEN_MM_MMCV_OPS'


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


def plan(torch_version: str, torch_cuda: Optional[str], gpu_arches: Sequence[str],
         nvcc: Optional[str], nvcc_ver: Optional[str], env: Dict[str, str],
         torch_arches: Sequence[str] = ()) -> Plan:
    """The decision, from facts only (tested with every combination).

    Args:
        torch_version: ``torch.__version__``.
        torch_cuda: ``torch.version.cuda`` (``None``: a CPU build).
        gpu_arches: compute capabilities of the visible GPUs (``['9.0']``; empty: none).
        torch_arches: the architectures torch itself was built for
            (``torch.cuda.get_arch_list()``: ``['sm_75', ..., 'sm_120']``), the targets
            when no GPU is visible and ``TORCH_CUDA_ARCH_LIST`` is unset (torch's builder
            finds none by itself then and fails).
        nvcc: path of the nvcc found (``None``: none).
        nvcc_ver: its version (``'13.0'``).
        env: the environment (``FLATTEN_MM_MMCV_OPS``, ``TORCH_CUDA_ARCH_LIST``).
    """
    choice = env.get(SWITCH, '').strip().lower()
    if choice not in ('', 'cuda', 'cpu'):
        return Plan(error=f'{SWITCH}={env[SWITCH]!r}: say cuda or cpu (or leave it unset)')
    if torch_cuda is None:
        if choice == 'cuda':
            return Plan(error=f'{SWITCH}=cuda but torch {torch_version} is a CPU build: '
                        'install a CUDA build of torch first (pip install torch from the '
                        'CUDA index of your CUDA version)')
        return Plan(notes=[f'torch {torch_version} is a CPU build: mmcv with its CPU ops'])
    if choice == 'cpu':
        if gpu_arches:
            return Plan(error=(
                f'{SWITCH}=cpu, but a GPU is visible (compute capability '
                f'{", ".join(gpu_arches)}): mmdet / mmseg on it need mmcv\'s CUDA ops (RoIAlign, '
                f'nms). Unset {SWITCH} to build them (nvcc {torch_cuda} required).'))
        return Plan(notes=[f'{SWITCH}=cpu: mmcv with its CPU ops only, although torch '
                           f'{torch_version} is a CUDA build (mmdet / mmseg ops will not '
                           'run on CUDA tensors with this wheel)'])
    major = torch_cuda.split('.')[0]
    install = (f'install the CUDA {torch_cuda} toolkit (at least its compiler: e.g. `conda '
               f'install -c nvidia cuda-nvcc={torch_cuda}` or NVIDIA\'s installer from '
               'https://developer.nvidia.com/cuda-toolkit-archive) and point CUDA_HOME at it '
               f'(export CUDA_HOME=/usr/local/cuda-{torch_cuda}); on a machine without GPUs, '
               f'{SWITCH}=cpu builds the CPU ops only')
    if nvcc is None:
        return Plan(error=f'torch {torch_version} is a CUDA {torch_cuda} build, so mmcv is '
                    f'built with its CUDA ops, which needs nvcc: none found (CUDA_HOME, PATH, '
                    f'/usr/local/cuda). {install}.')
    if nvcc_ver is None or nvcc_ver.split('.')[0] != major:
        return Plan(error=f'torch {torch_version} was built with CUDA {torch_cuda} but '
                    f'{nvcc} is CUDA {nvcc_ver or "of an unknown version"}: torch builds '
                    f'extensions only with the same CUDA major version. {install}.')
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
    notes = [f'torch {torch_version} is a CUDA {torch_cuda} build: mmcv with its CUDA ops '
             f'(nvcc {nvcc_ver} at {nvcc}; GPU architectures {arch_list})']
    if not gpu_arches and not env.get('TORCH_CUDA_ARCH_LIST', '').strip():
        notes.append('no GPU visible: built for every architecture torch supports (slow: '
                     'TORCH_CUDA_ARCH_LIST="9.0" builds for one, e.g. H100 / H200)')
    return Plan(ops='cuda', tag=f'cu{torch_cuda.replace(".", "")}-{arch_tag}', env=build_env,
                notes=notes)


def _facts(env: Dict[str, str]):
    import torch
    arches = []
    if torch.cuda.is_available():
        arches = ['%d.%d' % torch.cuda.get_device_capability(i)
                  for i in range(torch.cuda.device_count())]
    nvcc = find_nvcc(env) if torch.version.cuda else None
    torch_arches = torch.cuda.get_arch_list() if torch.version.cuda else []
    return dict(torch_version=torch.__version__.split('+')[0], torch_cuda=torch.version.cuda,
                gpu_arches=arches, nvcc=nvcc, nvcc_ver=nvcc_version(nvcc) if nvcc else None,
                torch_arches=torch_arches)


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
        problems.append('a GPU is visible but mmcv was built without CUDA ops: remove the '
                        'cached wheel (FLATTEN_MM_CACHE) and rerun scripts/setup_env.sh '
                        f'without {SWITCH}=cpu')
    return problems


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ('plan', 'verify', 'flavour'):
        print(__doc__)
        return 2
    if argv[0] == 'plan':
        p = plan(**_facts(dict(os.environ)), env=dict(os.environ))
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
