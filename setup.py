"""Installation of flatten_mm.

mmcv (with compiled ops), mmdet and mmsegmentation are deliberately *not* hard
requirements here: mmcv 2.1.0 must be built from source against the installed
torch and mmdet/mmseg carry outdated pins. ``scripts/setup_env.sh`` installs
them; the extras below list their runtime needs.
"""
import os
import os.path as osp
import shutil
import sys

from setuptools import find_packages, setup

ROOT = osp.dirname(osp.abspath(__file__))
#: what mim (OpenMMLab's package manager) reads from ``flatten_mm/.mim``: the model
#: index with its metafiles, the configs they name, and the tools
MIM_FILES = ('model-index.yml', 'configs', 'tools')


def read_version() -> dict:
    scope: dict = {}
    with open(osp.join(osp.dirname(__file__), 'flatten_mm', 'version.py')) as f:
        exec(f.read(), scope)
    return scope


VERSION = read_version()


def add_mim_extension() -> None:
    """Put ``model-index.yml``, ``configs/`` and ``tools/`` under ``flatten_mm/.mim``.

    ``mim search flatten_mm`` reads ``<installed package>/.mim/model-index.yml`` and the
    metafiles / configs it names (as for mmdet and mmseg, whose ``setup.py`` does the
    same). Building a wheel or an sdist copies them; an editable install (``pip install
    -e .``: ``editable_wheel``, or the legacy ``develop``) links them, so edits show up.
    Other commands (``egg_info``, ``dist_info``) leave ``.mim`` as it is. Building from
    an sdist (no ``configs/`` next to ``setup.py``) keeps the sdist's copy.
    """
    if 'develop' in sys.argv or 'editable_wheel' in sys.argv:
        mode = 'copy' if os.name == 'nt' else 'symlink'
    elif {'sdist', 'bdist_wheel', 'build', 'build_py', 'install'} & set(sys.argv):
        mode = 'copy'
    else:
        return
    mim_path = osp.join(ROOT, 'flatten_mm', '.mim')
    os.makedirs(mim_path, exist_ok=True)
    for name in MIM_FILES:
        src = osp.join(ROOT, name)
        if not osp.exists(src):
            continue
        dst = osp.join(mim_path, name)
        if osp.islink(dst) or osp.isfile(dst):
            os.remove(dst)
        elif osp.isdir(dst):
            shutil.rmtree(dst)
        if mode == 'symlink':
            os.symlink(osp.relpath(src, mim_path), dst)
        elif osp.isfile(src):
            shutil.copyfile(src, dst)
        else:
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))


add_mim_extension()

setup(
    name='flatten_mm',
    version=VERSION['__version__'],
    description='FLatten, SimA and QuadTree attention backbones for mmdet / mmseg',
    long_description=open(osp.join(osp.dirname(__file__), 'README.md')).read()
    if osp.exists(osp.join(osp.dirname(__file__), 'README.md')) else '',
    long_description_content_type='text/markdown',
    packages=find_packages(include=['flatten_mm', 'flatten_mm.*']),
    # C++ source of the optional CPU kernel, compiled on first use (ops/quadtree_cpu.py),
    # and the Triton kernels' shared-memory limit table the dispatch reads (kernel_limits.py)
    package_data={
        'flatten_mm.models.ops': ['csrc/*.cpp', 'csrc/*.h', 'kernel_limits.json'],
        'flatten_mm.deploy': ['csrc/*.cpp'],
        # the mim extension (add_mim_extension above)
        'flatten_mm': ['.mim/model-index.yml', '.mim/configs/**/*.py', '.mim/configs/**/*.yml',
                       '.mim/configs/**/*.md', '.mim/tools/**/*.py', '.mim/tools/**/*.sh'],
    },
    python_requires='>=3.9',
    install_requires=[
        # (flatten_mm/__init__.py refuses an older torch at import, naming both versions)
        'torch>=' + '.'.join(map(str, VERSION['MIN_TORCH'])),
        # flatten_mm/compat.py adapts mmengine 0.10.7's checkpoint loader to torch >= 2.6
        'mmengine==0.10.7',
        'timm>=1.0',  # timm.layers
        'numpy',
        'ninja',  # torch.utils.cpp_extension builds the optional CPU kernels with it
    ],
    extras_require={
        # mmcv==2.1.0 (built with ops) and mmdet==3.3.0 (--no-deps) come from
        # scripts/setup_env.sh; these are their runtime needs.
        'mmcv': ['addict', 'packaging', 'Pillow', 'pyyaml', 'yapf', 'opencv-python'],
        'det': ['addict', 'packaging', 'Pillow', 'pyyaml', 'yapf', 'opencv-python',
                'pycocotools', 'terminaltables', 'shapely', 'scipy', 'six', 'tqdm',
                'matplotlib'],
        'seg': ['addict', 'packaging', 'Pillow', 'pyyaml', 'yapf', 'opencv-python',
                'prettytable', 'ftfy', 'regex', 'scipy', 'matplotlib'],
        # mmpretrain==1.2.0 (--no-deps, scripts/setup_env.sh): ImageNet pretraining with the
        # configs/mmpretrain configs; these are its runtime needs
        'cls': ['einops', 'importlib-metadata', 'mat4py', 'matplotlib', 'modelindex', 'rich'],
        # openmim: `mim search flatten_mm` (tests/test_docs.py). 0.3.7 is the last release
        # without the opendatalab -> openxlab dependency, which pins setuptools~=60.2,
        # requests~=2.28.2 and packaging~=24.0 and would downgrade them here.
        'dev': ['pytest', 'pytest-timeout', 'pytest-xdist', 'fvcore', 'openmim==0.3.7'],
        # ONNX export (torch.onnx dynamo exporter) and ONNX Runtime (flatten_mm.deploy)
        'deploy': ['onnx==1.23.2', 'onnxruntime==1.32.0', 'onnxscript==0.7.2'],
    },
    license='Apache-2.0',
    zip_safe=False,
)
