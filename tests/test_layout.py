"""The package's layout holds (issue #33): every import inside ``flatten_mm`` points down
the floors below, there is no import cycle, function-local imports are only for optional
dependencies (each names why), nothing developer-only ships in the package, and no
function outside a Triton kernel body grows past 100 lines.

Floors, bottom up (a module may import its own floor and the floors below it; inside
``models`` the sub-packages have floors of their own)::

    registry, version
    checkpoints                      files and state dicts, no model code
    compat                           mmengine's checkpoint loader made safe (uses checkpoints)
    models: ops < layers < catalogue < zoo < pretrained < backbones < models/__init__
    apis                             whole models from configs
    swap, analysis, deploy, datasets user features
"""
import ast
import os
import os.path as osp
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
PACKAGE = osp.join(ROOT, 'flatten_mm')

#: (module-name prefix, floor); the longest matching prefix decides
FLOORS = (
    ('flatten_mm.registry', 0), ('flatten_mm.version', 0),
    ('flatten_mm.checkpoints', 1), ('flatten_mm.compat', 1.5),
    ('flatten_mm.models.ops', 2), ('flatten_mm.models.layers', 3),
    ('flatten_mm.models.catalogue', 4), ('flatten_mm.models.zoo', 5),
    ('flatten_mm.models.pretrained', 6), ('flatten_mm.models.backbones', 7),
    ('flatten_mm.models', 8),
    ('flatten_mm.apis', 9),
    ('flatten_mm.swap', 10), ('flatten_mm.analysis', 10), ('flatten_mm.deploy', 10),
    ('flatten_mm.datasets', 10),
    ('flatten_mm', 11),  # the package's face
)

#: third-party packages that flatten_mm does not require (setup.py's install_requires
#: has torch, timm, mmengine, numpy): importing one inside a function is the one reason
#: for a function-local import
OPTIONAL = {'mmdet', 'mmseg', 'mmcv', 'triton', 'onnx', 'onnxruntime', 'onnxscript',
            'matplotlib', 'PIL', 'torchvision', 'fvcore', 'cv2', 'mmpretrain'}


def _module_name(path: str) -> str:
    rel = osp.relpath(path, ROOT)[:-len('.py')].replace(os.sep, '.')
    return rel[:-len('.__init__')] if rel.endswith('.__init__') else rel


def _files() -> List[str]:
    out = []
    for dirpath, _, files in os.walk(PACKAGE):
        out += [osp.join(dirpath, f) for f in files if f.endswith('.py')]
    return sorted(out)


def _resolve(module: str, path: str, node: ast.ImportFrom) -> List[str]:
    """Absolute names a ``from ... import`` brings in (a submodule per imported name where
    one exists, else the module itself)."""
    if node.level:
        package = module if path.endswith('__init__.py') else module.rsplit('.', 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit('.', 1)[0]
        base = f'{package}.{node.module}' if node.module else package
    else:
        base = node.module or ''
    names = []
    for alias in node.names:
        candidate = f'{base}.{alias.name}'
        rel = candidate.replace('.', os.sep)
        if osp.isfile(osp.join(ROOT, rel + '.py')) or osp.isdir(osp.join(ROOT, rel)):
            names.append(candidate)
        else:
            names.append(base)
    return names


def _imports(path: str) -> List[Tuple[str, int, Optional[ast.AST]]]:
    """``(imported module, line, enclosing function or None)`` for every import."""
    module = _module_name(path)
    tree = ast.parse(open(path, encoding='utf-8').read())
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.extend((n, child.lineno, func) for n in _resolve(module, path, child))
            visit(child, inner)

    visit(tree, None)
    return found


def _floor(module: str) -> Optional[int]:
    best = None
    for prefix, floor in FLOORS:
        if module == prefix or module.startswith(prefix + '.'):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, floor)
    return None if best is None else best[1]


def _graph() -> Dict[str, Set[str]]:
    graph = {}
    for path in _files():
        graph[_module_name(path)] = {m for m, _, _ in _imports(path)
                                     if m.split('.')[0] == 'flatten_mm'}
    return graph


def test_every_module_has_a_floor():
    unplaced = [m for m in _graph() if _floor(m) is None]
    assert not unplaced


def test_imports_point_down():
    upward = []
    for path in _files():
        module = _module_name(path)
        for imported, line, _ in _imports(path):
            if imported.split('.')[0] != 'flatten_mm' or imported == 'flatten_mm':
                continue
            if _floor(imported) > _floor(module):
                upward.append(f'{osp.relpath(path, ROOT)}:{line} imports {imported}')
    assert not upward, 'imports that point up the floors:\n' + '\n'.join(upward)


def test_no_import_cycle():
    graph = _graph()
    # a module's own package __init__ re-exports it: package -> child edges are the only
    # ones allowed to close a loop with the child importing a sibling through the package
    state: Dict[str, int] = {}
    stack: List[str] = []
    cycles = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, 'import cycles:\n' + '\n'.join(' -> '.join(c) for c in cycles)


def test_function_local_imports_are_optional_dependencies():
    """Inside a function only an optional package is imported (late, so that the rest
    works without it); a ``# late:`` comment on the line may name another reason
    (the Triton kernel modules, imported only once the dispatch said they import)."""
    offending = []
    for path in _files():
        lines = open(path, encoding='utf-8').read().splitlines()
        for imported, line, func in _imports(path):
            if func is None or imported.split('.')[0] in OPTIONAL:
                continue
            if '# late:' in lines[line - 1]:
                continue
            offending.append(f'{osp.relpath(path, ROOT)}:{line} {func.name}() imports '
                             f'{imported}')
    assert not offending, ('function-local imports of required modules (hoist them, or say '
                           'why with "# late: ..."):\n' + '\n'.join(offending))


def test_no_developer_tooling_in_the_package():
    """Benchmarks, sweeps, parity fixtures and the GPU checks live in ``benchmarks/`` and
    ``dev/`` of a checkout; the installed package imports neither."""
    for path in _files():
        for imported, line, _ in _imports(path):
            assert imported.split('.')[0] not in ('benchmarks', 'dev', 'tests'), (
                f'{osp.relpath(path, ROOT)}:{line} imports {imported}')
    present = {d for d in os.listdir(PACKAGE) if osp.isdir(osp.join(PACKAGE, d))}
    assert not present & {'benchmark', 'parity', 'sweeps', 'utils'}


def _is_triton_kernel(node: ast.AST) -> bool:
    return any('triton' in ast.unparse(d) and 'jit' in ast.unparse(d)
               for d in node.decorator_list)


def test_functions_stay_under_100_lines():
    long = []
    for path in _files():
        tree = ast.parse(open(path, encoding='utf-8').read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and not _is_triton_kernel(node):
                length = node.end_lineno - node.lineno + 1
                if length > 100:
                    long.append(f'{osp.relpath(path, ROOT)}:{node.lineno} {node.name} '
                                f'{length} lines')
    assert not long, 'functions over 100 lines:\n' + '\n'.join(long)


@pytest.mark.parametrize('package', sorted(
    osp.relpath(d, ROOT) for d, _, files in os.walk(PACKAGE)
    if '__init__.py' in files))
def test_every_package_says_its_concern(package):
    doc = ast.get_docstring(ast.parse(open(osp.join(ROOT, package, '__init__.py')).read()))
    assert doc and len(doc.split()) >= 8, f'{package}/__init__.py has no docstring'
