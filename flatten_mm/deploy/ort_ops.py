"""flatten_mm's ONNX Runtime custom operators: build, locate, register.

One operator today, ``flatten_mm::QuadTreeLevel`` (``csrc/quadtree_ort.cpp``): a finer
level of QuadTree attention by the same C++ forward as the fused PyTorch CPU kernel,
reading each parent's candidate keys in place. The plain-operator graph of a level writes
the gathered ``(N, 4K, d)`` key and value tiles out first: QuadTree-B-b0 is 1.7-1.9x
slower in ONNX Runtime that way (docs/user_guides/deploy.md). ``export_onnx(...,
custom_ops=True)`` writes the operator instead, and such a file needs this library
wherever it runs.

Building needs a C++17 compiler and ONNX Runtime's C API headers (no library to link:
ONNX Runtime hands its API table to ``RegisterCustomOps``). The ``onnxruntime`` wheels
ship no headers; they are taken from where the user has them, in order:

1. ``$FLATTEN_MM_ORT_INCLUDE`` (a folder holding ``onnxruntime_c_api.h``, or its parent),
   e.g. the ``include/`` folder of ONNX Runtime's release archive;
2. the system's ``libonnxruntime-dev`` (``apt-get install libonnxruntime-dev`` on Debian 13
   / Ubuntu): ``/usr/include/onnxruntime``, ``/usr/local/include/onnxruntime``,
   ``/usr/include``, ``/usr/local/include``.

Nothing is downloaded. The headers' ``ORT_API_VERSION`` N (ONNX Runtime 1.N) must not be
newer than the installed ``onnxruntime``: a library built against them loads in ONNX
Runtime >= 1.N only (the C API only grows), so newer headers are refused before building.
The build is cached under ``$FLATTEN_MM_EXT_DIR`` (default ``~/.cache/flatten_mm/ext``),
keyed by the sources, the flags and the headers' API version. It is compiled with AVX2 and
FMA where the building CPU has them (``FLATTEN_MM_CPU_ISA=generic``: without), records
them, and refuses to register (an error status, not a crash) on a CPU without them.

Command line: ``tools/deployment/build_ort_ops.py {build,status,headers}``.
"""
import ctypes
import hashlib
import importlib.metadata
import os
import os.path as osp
import re
import subprocess
import threading
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from ..models.ops import quadtree_cpu
from ..models.ops import quadtree_graph_op  # noqa: F401 (defines the PyTorch graph operator)

#: the operators' ONNX domain (``opset_import`` of a file that uses them)
DOMAIN = 'flatten_mm'
#: the command line that builds the library
TOOL = 'python tools/deployment/build_ort_ops.py'
#: folder holding ``onnxruntime_c_api.h``, searched first
ENV_INCLUDE = 'FLATTEN_MM_ORT_INCLUDE'
#: the system package that ships the headers (Debian 13 / Ubuntu)
SYSTEM_PACKAGE = 'libonnxruntime-dev'
_HEADER = 'onnxruntime_c_api.h'
#: where the system package manager puts the headers, searched after ``ENV_INCLUDE``
_SYSTEM_INCLUDES = ('/usr/include/onnxruntime', '/usr/local/include/onnxruntime',
                    '/usr/include', '/usr/local/include')
_HERE = osp.dirname(osp.abspath(__file__))
_SOURCES = (osp.join(_HERE, 'csrc', 'quadtree_ort.cpp'),
            osp.join(_HERE, 'csrc', 'isa_guard.cpp'),
            osp.join(_HERE, '..', 'models', 'ops', 'csrc', 'quadtree_level.h'))
_LIBRARY = 'libflatten_mm_ort_ops.so'

_lock = threading.Lock()
_built: Dict[str, Optional[str]] = {}  # header folder -> library path (None: failed)
_errors: Dict[str, str] = {}


def _cache_root() -> str:
    return os.environ.get('FLATTEN_MM_EXT_DIR') or osp.join(
        os.environ.get('XDG_CACHE_HOME') or osp.expanduser('~/.cache'), 'flatten_mm', 'ext')


def header_dir() -> Optional[str]:
    """The first folder holding ``onnxruntime_c_api.h`` (see the module doc), or ``None``."""
    given = os.environ.get(ENV_INCLUDE, '')
    candidates = [given, osp.join(given, 'onnxruntime')] if given else []
    candidates += _SYSTEM_INCLUDES
    return next((d for d in candidates if osp.isfile(osp.join(d, _HEADER))), None)


def api_version(include: str) -> int:
    """``ORT_API_VERSION`` of the headers in ``include`` (ONNX Runtime 1.N has API N)."""
    with open(osp.join(include, _HEADER), errors='replace') as f:
        match = re.search(r'^\s*#\s*define\s+ORT_API_VERSION\s+(\d+)', f.read(), flags=re.M)
    if match is None:
        raise RuntimeError(f'{include}/{_HEADER} defines no ORT_API_VERSION')
    return int(match.group(1))


def runtime_version() -> Optional[Tuple[str, int]]:
    """The installed ``onnxruntime``'s version and C API version (1.N -> N), or ``None``
    when it is not installed."""
    try:
        version = importlib.metadata.version('onnxruntime')
    except importlib.metadata.PackageNotFoundError:
        return None
    match = re.match(r'1\.(\d+)', version)
    return (version, int(match.group(1))) if match else None


def missing_headers_message() -> str:
    """Why there are no headers, and the two ways to get them."""
    runtime = runtime_version()
    release = runtime[0] if runtime else '<version>'
    searched = ', '.join(([f'${ENV_INCLUDE}'] if os.environ.get(ENV_INCLUDE) else [])
                         + list(_SYSTEM_INCLUDES))
    return (f'no ONNX Runtime headers ({_HEADER} in {searched}): install them with '
            f'`apt-get install {SYSTEM_PACKAGE}` (Debian 13 / Ubuntu), or extract ONNX '
            f'Runtime\'s release archive (onnxruntime-linux-x64-{release}.tgz, the installed '
            f'version) and set {ENV_INCLUDE}=<release archive>/include')


def check_api(include: str) -> str:
    """Refuse headers newer than the installed ``onnxruntime`` (the library would not load
    in it); returns one line naming both versions.

    Raises:
        RuntimeError: the headers' API is newer than the runtime's."""
    api = api_version(include)
    runtime = runtime_version()
    if runtime is None:
        return f'headers {include} (ORT_API_VERSION {api}); onnxruntime not installed'
    version, runtime_api = runtime
    line = (f'headers {include} (ORT_API_VERSION {api}, ONNX Runtime 1.{api}); '
            f'onnxruntime {version} (API {runtime_api})')
    if api > runtime_api:
        raise RuntimeError(
            f'the ONNX Runtime headers in {include} are of ONNX Runtime 1.{api} '
            f'(ORT_API_VERSION {api}), newer than the installed onnxruntime {version} (API {runtime_api}): a '
            f'library built against them would not load in it. Use headers of ONNX Runtime '
            f'1.{runtime_api} or older ({ENV_INCLUDE}), or upgrade onnxruntime')
    return line


def _flags() -> List[str]:
    return ['-O3', '-std=c++17', '-fPIC', '-fno-math-errno', '-fopenmp-simd',
            '-fvisibility=hidden']


def compile_library(include: str, library: str, isa: Optional[List[str]] = None) -> str:
    """Compile the operator library into ``library`` (a whole file or none): the operator
    with ``isa`` (default: ``quadtree_cpu.isa_flags()``, AVX2 + FMA where this CPU has
    them), its entry point ``RegisterCustomOps`` without (``csrc/isa_guard.cpp``: it
    checks the CPU has what the rest was compiled for before running any of it)."""
    isa = quadtree_cpu.isa_flags() if isa is None else list(isa)
    compiler = os.environ.get('CXX', 'c++')
    partial = f'{library}.{os.getpid()}.{threading.get_ident()}'
    includes = [f'-I{include}', f'-I{osp.dirname(_SOURCES[2])}']
    steps = [[compiler, *_flags(), *isa, *includes, '-c', _SOURCES[0], '-o', f'{partial}.op.o'],
             [compiler, *_flags(), *includes, '-c', _SOURCES[1], '-o', f'{partial}.guard.o'],
             [compiler, '-shared', f'{partial}.op.o', f'{partial}.guard.o', '-o', partial]]
    try:
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f'{" ".join(cmd)} failed:\n{proc.stderr.strip()[-2000:]}')
        os.replace(partial, library)  # whole file or none: another process may be loading it
    finally:
        for path in (f'{partial}.op.o', f'{partial}.guard.o', partial):
            if osp.exists(path):
                os.remove(path)
    return library


def _build(include: str) -> str:
    isa = quadtree_cpu.isa_flags()
    digest = hashlib.sha1(' '.join(_flags() + isa + [str(api_version(include))]).encode())
    for path in _SOURCES:
        with open(path, 'rb') as f:
            digest.update(f.read())
    folder = osp.join(_cache_root(), 'ort_ops', digest.hexdigest()[:10])
    library = osp.join(folder, _LIBRARY)
    if not osp.isfile(library):
        os.makedirs(folder, exist_ok=True)
        compile_library(include, library, isa)
    return library


def library_isa(library: str) -> List[str]:
    """The instruction sets beyond the architecture's baseline that ``library`` was compiled
    for (its exported ``flatten_mm_ort_ops_isa``), e.g. ``['avx', 'avx2', 'fma']``; the
    library refuses to register on a CPU without them. (Loads it into this process.)"""
    function = ctypes.CDLL(library).flatten_mm_ort_ops_isa
    function.restype = ctypes.c_char_p
    return function().decode().split()


def library_path() -> Optional[str]:
    """The built operator library (built on the first call), or ``None`` when it cannot be
    built: no headers (see ``missing_headers_message``; the headers are an optional system
    package, so this is never an error), headers newer than the installed onnxruntime, or a
    compiler error (these warned once per process; ``RuntimeError`` with
    ``FLATTEN_MM_REQUIRE_CPU_KERNELS=1``, as CI sets)."""
    include = header_dir()
    key = include or ''
    with _lock:
        if key not in _built:
            _built[key] = None
            if include is None:
                _errors[key] = missing_headers_message()
            else:
                try:
                    check_api(include)
                    _built[key] = _build(include)
                except Exception as e:  # newer headers, no compiler, compile error
                    _errors[key] = f'{type(e).__name__}: {e}'
            if _built[key] is None and (include is None or not quadtree_cpu.build_required()):
                warnings.warn('flatten_mm: the ONNX Runtime custom operators could not be '
                              f'built. Reason: {_errors[key]}', RuntimeWarning, stacklevel=2)
    if _built[key] is None and include is not None and quadtree_cpu.build_required():
        raise RuntimeError('flatten_mm: the ONNX Runtime custom operators could not be built '
                           f'(FLATTEN_MM_REQUIRE_CPU_KERNELS is set): {_errors[key]}')
    return _built[key]


def status() -> str:
    """One line: the library's path, or why there is none; with the headers' and the
    installed onnxruntime's API versions."""
    include = header_dir()
    if include is None:
        return f'unavailable: {missing_headers_message()}'
    try:
        versions = check_api(include)
    except RuntimeError as e:
        return f'unavailable: {e}'
    if include not in _built:
        return f'not built yet ({versions})'
    library = _built[include]
    return f'{library} ({versions})' if library else f'unavailable: {_errors[include]}'


def uses_custom_ops(model) -> bool:
    """Whether the ``onnx.ModelProto`` imports our operators' domain."""
    return any(o.domain == DOMAIN for o in model.opset_import)


def register(options) -> str:
    """Register the library with ``onnxruntime.SessionOptions``; returns its path.

    Raises:
        RuntimeError: it cannot be built (the reason, and how to get the headers)."""
    library = library_path()
    if library is None:
        raise RuntimeError(
            f'this ONNX file uses flatten_mm\'s ONNX Runtime operators ({DOMAIN} domain), '
            f'which could not be built here: {status()}. Build them with `{TOOL} '
            'build`, or export again without custom_ops for a file of standard '
            'operators only')
    options.register_custom_ops_library(library)
    return library


def translation_table() -> Dict:
    """``torch.onnx.export(custom_translation_table=...)`` entries: each of flatten_mm's
    graph operators (``models.ops.quadtree_graph_op``) -> one node of this library."""
    import onnxscript  # (the deploy extra)
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    schema = OpSchema(
        'QuadTreeLevel', DOMAIN, 1,
        doc='One finer level of QuadTree attention (flatten_mm/deploy/csrc/quadtree_ort.cpp)',
        inputs=[param('q', 'T'), param('k', 'T'), param('v', 'T'),
                param('prev_idx', 'tensor(int64)'), param('prev_score', 'T'),
                param('init', 'T')],
        outputs=[param('msg', 'T'), param('next_idx', 'tensor(int64)'),
                 param('next_score', 'T')],
        type_constraints=[('T', ['tensor(float)'], 'float32')],
        attributes=[attr('width', OpSchema.AttrType.INT, 'the level width'),
                    attr('scale', OpSchema.AttrType.FLOAT, 'the score scale'),
                    attr('topk', OpSchema.AttrType.INT, 'candidates passed on (0: final)'),
                    attr('type_a', OpSchema.AttrType.INT, '1: variant A, 0: B')])
    node = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), 'QuadTreeLevel', schema)

    def quadtree_level(q, k, v, prev_idx, prev_score, init, width, scale, topk, type_a):
        return node(q, k, v, prev_idx, prev_score, init, width=width, scale=scale, topk=topk,
                    type_a=int(type_a))

    return {torch.ops.flatten_mm_graph.quadtree_level.default: quadtree_level}

