"""Machine / library description written in every report header."""
import os
from typing import Any, Dict

import torch


def environment() -> Dict[str, Any]:
    """Machine / library description for the report header."""
    import platform
    info = dict(torch=torch.__version__, threads=torch.get_num_threads(),
                python=platform.python_version(), machine=platform.machine(),
                cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    info['cpu'] = line.split(':', 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info['gpu'] = torch.cuda.get_device_name(0)
    from flatten_mm.models.ops import quadtree_cpu as cpu_kernels
    cpu_kernels.quadtree_level_kernel()  # built here, not inside a timed call
    info['cpu_kernels'] = cpu_kernels.status()
    return info

