"""A ``benchmarks/`` script (default ``benchmark.py``) loaded as a module (the benchmark
tests call its ``main`` / parsers directly)."""
import importlib.util
import os.path as osp

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def load_cli(script: str = 'benchmark.py'):
    """The tool's module, freshly executed."""
    spec = importlib.util.spec_from_file_location(osp.splitext(script)[0] + '_cli',
                                                  osp.join(ROOT, 'benchmarks', script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
