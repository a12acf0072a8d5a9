"""A non-editable install works: a wheel built from the checkout, installed into a scratch
directory and used from outside the checkout.

* every backbone family builds and runs from the installed package;
* the fused QuadTree CPU kernel compiles from the installed C++ sources (a fresh build
  directory, so nothing of the checkout's builds is reused), and so does the ONNX Runtime
  operator where ONNX Runtime's C API headers are found;
* the configs are found under the package (``flatten_mm/.mim/configs``, ``mim search``);
* ``import flatten_mm`` on a torch older than it needs fails at once, naming both
  versions.
"""
import os
import os.path as osp
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT

PYTHON = sys.executable


def _tracked_files() -> list:
    """The files a clean clone of the work tree would have (git's tracked and unignored
    files; the working tree without build outputs
    where git is unavailable)."""
    try:
        out = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'], cwd=REPO_ROOT, capture_output=True,
                             check=True, timeout=60).stdout.decode()
        return [f for f in out.split('\0') if f and osp.isfile(osp.join(REPO_ROOT, f))]
    except (OSError, subprocess.SubprocessError):
        skip = ('.venv', '.git', 'work_dirs', 'outputs', 'flatten_mm/.mim')
        return [osp.relpath(osp.join(d, f), REPO_ROOT) for d, _, files in os.walk(REPO_ROOT)
                for f in files if not osp.relpath(d, REPO_ROOT).startswith(skip)
                and '__pycache__' not in d]


@pytest.fixture(scope='module')
def wheel_site(tmp_path_factory):
    """``pip wheel`` of a copy of the checkout's files, installed with ``pip install
    --target`` into a scratch directory (no dependencies: they are this environment's)."""
    src = tmp_path_factory.mktemp('checkout')
    for rel in _tracked_files():
        os.makedirs(osp.dirname(src / rel), exist_ok=True)
        shutil.copy2(osp.join(REPO_ROOT, rel), src / rel)
    wheels = tmp_path_factory.mktemp('wheels')
    build = subprocess.run(
        [PYTHON, '-m', 'pip', 'wheel', '--quiet', '--no-deps', '--no-build-isolation',
         '--no-index', '-w', str(wheels), str(src)], capture_output=True, text=True,
        timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = [str(p) for p in wheels.iterdir() if p.suffix == '.whl']
    site = tmp_path_factory.mktemp('site')
    install = subprocess.run(
        [PYTHON, '-m', 'pip', 'install', '--quiet', '--no-deps', '--no-index', '--target',
         str(site), wheel], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    return str(site)


def run_installed(site: str, code: str, tmp_path, timeout: int = 600, **env):
    """Run ``code`` in a fresh Python whose ``flatten_mm`` is the installed one, from a
    directory outside the checkout."""
    prelude = textwrap.dedent(f'''\
        import os, sys
        import flatten_mm
        SITE = os.path.realpath({site!r})
        assert os.path.realpath(flatten_mm.__file__).startswith(SITE), flatten_mm.__file__
        ''')
    environ = dict(os.environ, PYTHONPATH=site, PYTHONWARNINGS='ignore', **env)
    work = tmp_path / 'elsewhere'
    work.mkdir(exist_ok=True)
    proc = subprocess.run([PYTHON, '-c', prelude + textwrap.dedent(code)], cwd=str(work),
                          env=environ, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc.stdout


def test_every_backbone_family_builds_and_runs(wheel_site, tmp_path):
    out = run_installed(wheel_site, '''
        import torch
        from flatten_mm.models.catalogue import backbone_catalogue
        seen = {}
        for spec in backbone_catalogue().values():  # the first variant of every class
            seen.setdefault(spec.cls_name, spec)
        assert len(seen) >= 7, sorted(seen)
        torch.manual_seed(0)
        for cls_name, spec in sorted(seen.items()):
            model = spec.build(use_triton=False).eval()
            with torch.no_grad():
                outs = model(torch.randn(1, 3, 224, 224))
            assert len(outs) == 4 and all(torch.isfinite(o).all() for o in outs), cls_name
            print('ran', cls_name, spec.name)
        ''', tmp_path)
    assert out.count('ran ') >= 7


def test_cpu_kernel_builds_from_the_installed_sources(wheel_site, tmp_path):
    """A fresh build directory: the kernel compiles from ``flatten_mm/models/ops/csrc`` of
    the installed package, and a QuadTree level computed by it matches the PyTorch path."""
    out = run_installed(wheel_site, '''
        from flatten_mm.models.ops import quadtree_cpu
        kernel = quadtree_cpu.quadtree_level_kernel()
        assert kernel is not None, quadtree_cpu.status()
        assert os.path.realpath(quadtree_cpu.__file__).startswith(SITE)
        print('status', quadtree_cpu.status())
        ''', tmp_path, FLATTEN_MM_EXT_DIR=str(tmp_path / 'ext'),
        FLATTEN_MM_REQUIRE_CPU_KERNELS='1')
    assert 'status' in out
    built = [f for d, _, files in os.walk(tmp_path / 'ext') for f in files if f.endswith('.so')]
    assert built, 'no kernel library was compiled into the fresh build directory'


def test_onnx_runtime_operator_builds_from_the_installed_sources(wheel_site, tmp_path):
    pytest.importorskip('onnxruntime')
    from flatten_mm.deploy import ort_ops
    if ort_ops.header_dir() is None:
        pytest.skip(ort_ops.missing_headers_message())
    out = run_installed(wheel_site, '''
        from flatten_mm.deploy import ort_ops
        path = ort_ops.library_path()
        assert path and os.path.isfile(path), ort_ops.status()
        print('library', path)
        ''', tmp_path, FLATTEN_MM_EXT_DIR=str(tmp_path / 'ext'),
        FLATTEN_MM_REQUIRE_CPU_KERNELS='1')
    assert str(tmp_path / 'ext') in out


def test_configs_are_found_under_the_package(wheel_site, tmp_path):
    """Every config ships under ``flatten_mm/.mim/configs`` (what mim reads); one loaded
    from there, outside the checkout, resolves its relative and ``mmdet::`` bases and
    builds its detector."""
    pytest.importorskip('mmdet')
    shipped = sorted(osp.relpath(osp.join(d, f), osp.join(REPO_ROOT, 'configs'))
                     for d, _, files in os.walk(osp.join(REPO_ROOT, 'configs'))
                     for f in files if f.endswith('.py'))
    mim_configs = osp.join(wheel_site, 'flatten_mm', '.mim', 'configs')
    assert [c for c in shipped if not osp.isfile(osp.join(mim_configs, c))] == []
    out = run_installed(wheel_site, '''
        from mmengine.config import Config
        configs = os.path.join(os.path.dirname(flatten_mm.__file__), '.mim', 'configs')
        cfg = Config.fromfile(os.path.join(
            configs, 'mmdet/flatten_pvt_v2/retinanet_flatten-pvt-v2-b0_fpn_1x_coco.py'))
        assert cfg.model.backbone.type == 'flatten_mm.FLattenPVTv2', cfg.model.backbone
        cfg.model.backbone.init_cfg = None
        from mmdet.registry import MODELS
        from mmdet.utils import register_all_modules
        register_all_modules()
        import flatten_mm.models  # (the config's custom_imports)
        model = MODELS.build(cfg.model)
        print('built', type(model).__name__)
        ''', tmp_path)
    assert 'built RetinaNet' in out


def test_mim_search_lists_the_models(wheel_site, tmp_path):
    pytest.importorskip('mim', reason='openmim is not installed (the dev extra of setup.py)')
    out = run_installed(wheel_site, '''
        from mim.commands.search import get_model_info
        models = get_model_info('flatten_mm', local=True)
        assert (models['config'].str.startswith('configs/')).all()
        print(len(models), 'models')
        ''', tmp_path)
    assert int(out.split()[0]) >= 26


def test_import_refuses_an_older_torch_naming_both_versions(tmp_path):
    code = textwrap.dedent('''\
        import torch
        torch.__version__ = '2.3.1+cpu'
        try:
            import flatten_mm
        except ImportError as e:
            print('refused:', e)
        else:
            print('imported')
        ''')
    proc = subprocess.run([PYTHON, '-c', code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('refused:'), proc.stdout
    assert 'torch >= 2.7' in proc.stdout and '2.3.1+cpu' in proc.stdout
