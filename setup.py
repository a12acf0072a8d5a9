"""Installation of flatten_mm.

mmcv (with compiled ops), mmdet and mmsegmentation are deliberately *not* hard
requirements here: mmcv 2.1.0 must be built from source against the installed
torch and mmdet/mmseg carry outdated pins. ``scripts/setup_env.sh`` installs
them; the extras below list their runtime needs.
"""
import os.path as osp

from setuptools import find_packages, setup


def read_version() -> str:
    scope: dict = {}
    with open(osp.join(osp.dirname(__file__), 'flatten_mm', 'version.py')) as f:
        exec(f.read(), scope)
    return scope['__version__']


setup(
    name='flatten_mm',
    version=read_version(),
    description='FLatten, SimA and QuadTree attention backbones for mmdet / mmseg',
    long_description=open(osp.join(osp.dirname(__file__), 'README.md')).read()
    if osp.exists(osp.join(osp.dirname(__file__), 'README.md')) else '',
    long_description_content_type='text/markdown',
    packages=find_packages(include=['flatten_mm', 'flatten_mm.*']),
    # C++ source of the optional CPU kernels, compiled on first use (cpu_kernels.py)
    package_data={'flatten_mm.models.layers': ['csrc/*.cpp']},
    python_requires='>=3.9',
    install_requires=[
        'torch>=2.0',
        'mmengine==0.10.7',
        'timm>=1.0',
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
        'dev': ['pytest', 'pytest-timeout', 'fvcore'],
        # ONNX export (torch.onnx dynamo exporter) and ONNX Runtime (flatten_mm.deploy)
        'deploy': ['onnx==1.23.2', 'onnxruntime==1.32.0', 'onnxscript==0.7.2'],
    },
    license='Apache-2.0',
    zip_safe=False,
)
