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
ship no headers; they are taken from, in order:

1. ``$FLATTEN_MM_ORT_INCLUDE`` (a folder holding ``onnxruntime_c_api.h``, or its parent);
2. the cache ``fetch_headers`` fills (``tools/deployment/build_ort_ops.py fetch-headers``, run by
   ``scripts/setup_env.sh``): Debian's ``libonnxruntime-dev`` package, checked
   against the SHA-256 of the Debian package index;
3. a system install (``/usr/include/onnxruntime``, ``/usr/local/include/onnxruntime``).

A library built against the headers of ONNX Runtime X loads in ONNX Runtime >= X (the C
API only grows). The build is cached under ``$FLATTEN_MM_EXT_DIR`` (default
``~/.cache/flatten_mm/ext``), keyed by the sources, the flags and the headers' API version.

Command line: ``tools/deployment/build_ort_ops.py {fetch-headers,build,status}``.
"""
import hashlib
import io
import lzma
import os
import os.path as osp
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import urllib.request
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from ..models.ops import quadtree_cpu
from ..models.ops import quadtree_graph_op  # noqa: F401 (defines the PyTorch graph operator)

#: the operators' ONNX domain (``opset_import`` of a file that uses them)
DOMAIN = 'flatten_mm'
#: the command line that fetches the headers and builds the library
TOOL = 'python tools/deployment/build_ort_ops.py'
#: folder holding ``onnxruntime_c_api.h``, searched first
ENV_INCLUDE = 'FLATTEN_MM_ORT_INCLUDE'
#: Debian mirror and release ``fetch_headers`` reads (a release that has libonnxruntime-dev)
DEBIAN_MIRROR = os.environ.get('FLATTEN_MM_DEBIAN_MIRROR', 'https://deb.debian.org/debian')
DEBIAN_SUITE = 'trixie'
_HEADER = 'onnxruntime_c_api.h'
_SYSTEM_INCLUDES = ('/usr/include/onnxruntime', '/usr/local/include/onnxruntime')
_HERE = osp.dirname(osp.abspath(__file__))
_SOURCES = (osp.join(_HERE, 'csrc', 'quadtree_ort.cpp'),
            osp.join(_HERE, '..', 'models', 'ops', 'csrc', 'quadtree_level.h'))

_lock = threading.Lock()
_built: Dict[str, Optional[str]] = {}  # header folder -> library path (None: failed)
_errors: Dict[str, str] = {}


def _cache_root() -> str:
    return os.environ.get('FLATTEN_MM_EXT_DIR') or osp.join(
        os.environ.get('XDG_CACHE_HOME') or osp.expanduser('~/.cache'), 'flatten_mm', 'ext')


def _fetched_include() -> str:
    return osp.join(_cache_root(), 'ort_headers', 'include', 'onnxruntime')


def header_dir() -> Optional[str]:
    """The first folder holding ``onnxruntime_c_api.h`` (see the module doc), or ``None``."""
    given = os.environ.get(ENV_INCLUDE, '')
    candidates = [given, osp.join(given, 'onnxruntime') if given else '', _fetched_include(),
                  *_SYSTEM_INCLUDES]
    return next((d for d in candidates if d and osp.isfile(osp.join(d, _HEADER))), None)


def api_version(include: str) -> int:
    """``ORT_API_VERSION`` of the headers in ``include`` (ONNX Runtime 1.N has API N)."""
    with open(osp.join(include, _HEADER)) as f:
        match = re.search(r'#define ORT_API_VERSION (\d+)', f.read())
    if match is None:
        raise RuntimeError(f'{include}/{_HEADER} defines no ORT_API_VERSION')
    return int(match.group(1))


def _debian_arch() -> str:
    return {'x86_64': 'amd64', 'AMD64': 'amd64', 'aarch64': 'arm64',
            'arm64': 'arm64'}.get(platform.machine(), 'amd64')


def _package_entry(index: str, package: str) -> Dict[str, str]:
    for stanza in index.split('\n\n'):
        fields = dict(re.findall(r'^([\w-]+): (.*)$', stanza, flags=re.M))
        if fields.get('Package') == package:
            return fields
    raise RuntimeError(f'{package} is not in the Debian package index')


def _ar_member(data: bytes, prefix: str) -> Tuple[str, bytes]:
    """The first member of the ``ar`` archive ``data`` (a .deb) whose name starts with
    ``prefix``."""
    if not data.startswith(b'!<arch>\n'):
        raise RuntimeError('not a Debian package (no ar signature)')
    pos = 8
    while pos + 60 <= len(data):
        name = data[pos:pos + 16].decode().strip().rstrip('/')
        size = int(data[pos + 48:pos + 58].decode().strip())
        if name.startswith(prefix):
            return name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    raise RuntimeError(f'the package has no {prefix}* member')


def fetch_headers(suite: str = DEBIAN_SUITE, mirror: str = DEBIAN_MIRROR,
                  timeout: float = 120) -> str:
    """Download Debian's ``libonnxruntime-dev`` for ``suite`` and unpack its headers into
    the cache; returns the folder. The package's SHA-256 is checked against the index."""
    arch = _debian_arch()
    url = f'{mirror}/dists/{suite}/main/binary-{arch}/Packages.xz'
    with urllib.request.urlopen(url, timeout=timeout) as r:
        index = lzma.decompress(r.read()).decode('utf-8', 'replace')
    entry = _package_entry(index, 'libonnxruntime-dev')
    with urllib.request.urlopen(f'{mirror}/{entry["Filename"]}', timeout=timeout) as r:
        deb = r.read()
    if hashlib.sha256(deb).hexdigest() != entry['SHA256']:
        raise RuntimeError(f'{entry["Filename"]}: SHA-256 differs from the package index')
    name, payload = _ar_member(deb, 'data.tar')
    dest = _fetched_include()
    os.makedirs(osp.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=osp.dirname(dest))  # same file system: an atomic rename
    try:
        try:  # (xz, gz, bz2 or plain; Debian uses xz)
            tar = tarfile.open(fileobj=io.BytesIO(payload))
        except tarfile.ReadError as e:
            raise RuntimeError(f'cannot unpack {name} of {entry["Filename"]}: {e}') from e
        with tar:
            for member in tar.getmembers():
                path = osp.normpath(member.name)
                if (member.isfile() and path.startswith('usr/include/onnxruntime/')
                        and '..' not in path.split('/')):
                    target = osp.join(tmp, path[len('usr/include/onnxruntime/'):])
                    os.makedirs(osp.dirname(target), exist_ok=True)
                    with tar.extractfile(member) as src, open(target, 'wb') as out:
                        shutil.copyfileobj(src, out)
        if not osp.isfile(osp.join(tmp, _HEADER)):
            raise RuntimeError(f'{entry["Filename"]} holds no {_HEADER}')
        with open(osp.join(tmp, 'SOURCE'), 'w') as f:
            f.write(f'{mirror}/{entry["Filename"]} (Debian {suite}, version '
                    f'{entry.get("Version", "?")}, sha256 {entry["SHA256"]})\n')
        if osp.isdir(dest):
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if osp.isdir(tmp):
            shutil.rmtree(tmp)
    return dest


def _compile_flags() -> List[str]:
    # (the ISA choice of the PyTorch kernel: AVX2 + FMA where this CPU has them)
    return ['-O3', '-std=c++17', '-shared', '-fPIC', '-fno-math-errno', '-fopenmp-simd',
            '-fvisibility=hidden'] + quadtree_cpu.isa_flags()


def _build(include: str) -> str:
    flags = _compile_flags()
    digest = hashlib.sha1(' '.join(flags + [str(api_version(include))]).encode())
    for path in _SOURCES:
        with open(path, 'rb') as f:
            digest.update(f.read())
    folder = osp.join(_cache_root(), 'ort_ops', digest.hexdigest()[:10])
    library = osp.join(folder, 'libflatten_mm_ort_ops.so')
    if osp.isfile(library):
        return library
    os.makedirs(folder, exist_ok=True)
    compiler = os.environ.get('CXX', 'c++')
    partial = f'{library}.{os.getpid()}.tmp'
    cmd = [compiler, *flags, f'-I{include}', f'-I{osp.dirname(_SOURCES[1])}', _SOURCES[0],
           '-o', partial]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f'{" ".join(cmd)} failed:\n{proc.stderr.strip()[-2000:]}')
    os.replace(partial, library)  # whole file or none: another process may be loading it
    return library


def library_path() -> Optional[str]:
    """The built operator library (built on the first call), or ``None`` when it cannot be
    built: no headers or a compiler error (warned once per process; ``RuntimeError`` with
    ``FLATTEN_MM_REQUIRE_CPU_KERNELS=1``, as CI sets)."""
    include = header_dir()
    key = include or ''
    with _lock:
        if key not in _built:
            try:
                if include is None:
                    raise RuntimeError(
                        f'no ONNX Runtime C API headers ({_HEADER}): run `{TOOL} '
                        f'fetch-headers` (or {__name__}.fetch_headers()), or point '
                        f'{ENV_INCLUDE} at an onnxruntime include folder')
                _built[key] = _build(include)
            except Exception as e:  # no headers, no compiler, compile error
                _built[key] = None
                _errors[key] = f'{type(e).__name__}: {e}'
                if not quadtree_cpu.build_required():
                    warnings.warn('flatten_mm: the ONNX Runtime custom operators could not be '
                                  f'built. Reason: {_errors[key]}', RuntimeWarning,
                                  stacklevel=2)
    if _built[key] is None and quadtree_cpu.build_required():
        raise RuntimeError('flatten_mm: the ONNX Runtime custom operators could not be built '
                           f'(FLATTEN_MM_REQUIRE_CPU_KERNELS is set): {_errors[key]}')
    return _built[key]


def status() -> str:
    """One line: the library's path, or why there is none."""
    include = header_dir()
    if include is None:
        return f'unavailable: no ONNX Runtime headers (see {TOOL} fetch-headers)'
    key = include
    if key not in _built:
        return f'not built yet (headers: {include}, API {api_version(include)})'
    return _built[key] or f'unavailable: {_errors[key]}'


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

