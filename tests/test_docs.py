"""The user documentation cannot rot (issue #34).

* Every relative link and ``#anchor`` in README.md, CONTRIBUTING.md, ``docs/**/*.md`` and
  the config folders' READMEs resolves (anchors by GitHub's heading slug rules).
* Every repository path named in inline code (``flatten_mm/...``, ``tools/...``) exists.
* Every config path, tool / script path, repository path and command-line flag named in
  a ``bash`` / ``shell`` / ``sh`` code block exists: each ``tools/*.py`` (and
  ``scripts/gpu_session.sh``, ``mim search``) used there runs ``--help`` once per
  session, and every ``--flag`` the docs pass to it must appear in that help.
* User docs name no file outside the repository (the development fixtures).
* The model index: every config is in a metafile, every metafile entry names an existing
  config, no empty ``Metrics``, the official weights of ``flatten_mm.models.zoo`` are the
  metafiles' ``Weights``, and ``mim search flatten_mm`` (openmim, from the installed
  package's ``.mim``; no network) lists every config.
* Every ``FLATTEN_MM_*`` variable the code reads is documented in docs/get_started.md.

The checkers are plain functions; the ``test_checker_*`` cases feed them a broken link, a
broken anchor and a renamed flag, so a checker that stops finding them fails too.
"""
import functools
import glob
import importlib.util
import os
import os.path as osp
import re
import shlex
import subprocess
import sys
import textwrap
from typing import Dict, List, Optional, Tuple

import pytest
import yaml

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
PYTHON = sys.executable

USER_DOCS = sorted(
    [osp.join(REPO_ROOT, 'README.md'), osp.join(REPO_ROOT, 'CONTRIBUTING.md')] +
    glob.glob(osp.join(REPO_ROOT, 'docs', '**', '*.md'), recursive=True) +
    glob.glob(osp.join(REPO_ROOT, 'configs', '**', 'README.md'), recursive=True))

FENCE = re.compile(r'^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*$')
SHELL_LANGS = {'bash', 'shell', 'sh', 'console'}


def _rel(path: str) -> str:
    return osp.relpath(path, REPO_ROOT)


# --------------------------------------------------------------------------------------
# markdown parsing


def split_markdown(text: str) -> Tuple[List[Tuple[int, str]], List[Tuple[int, str, str]]]:
    """``(prose lines, code blocks)``: prose as ``(line number, line)`` outside fences,
    code blocks as ``(line number of the fence, language, body)``."""
    prose, blocks = [], []
    lines = text.split('\n')
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((start + 1, lang, textwrap.dedent('\n'.join(body))))
        i += 1
    return prose, blocks


def _strip_inline_code(line: str) -> str:
    return re.sub(r'(`+)(.+?)\1', lambda m: ' ' * len(m.group(0)), line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: rendered text, lower case, punctuation other
    than ``-`` / ``_`` removed, spaces to ``-``."""
    text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # links -> their text
    text = re.sub(r'<[^>]+>', '', text)  # inline HTML
    text = text.replace('`', '')
    text = re.sub(r'(\*\*|__|\*)', '', text)
    text = text.strip().lower()
    text = re.sub(r'[^\w\- ]', '', text)
    return text.replace(' ', '-')


def anchors(text: str) -> set:
    """Every anchor of a markdown file (duplicates get ``-1``, ``-2`` ...)."""
    prose, _ = split_markdown(text)
    seen: Dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = re.match(r'^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$', line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f'{slug}-{n}')
        seen[slug] = n + 1
    for m in re.finditer(r'<a\s+(?:name|id)="([^"]+)"', text):
        out.add(m.group(1))
    return out


LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')


def links(text: str) -> List[Tuple[int, str]]:
    """``(line, target)`` of every inline link / image outside code."""
    prose, _ = split_markdown(text)
    out = []
    for n, line in prose:
        for m in LINK.finditer(_strip_inline_code(line)):
            out.append((n, m.group(1)))
    return out


@functools.lru_cache(maxsize=None)
def _anchors_of(path: str) -> frozenset:
    with open(path, encoding='utf-8') as f:
        return frozenset(anchors(f.read()))


def check_links(path: str, text: Optional[str] = None, root: str = REPO_ROOT) -> List[str]:
    """Broken relative links and anchors of one markdown file."""
    if text is None:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    errors = []
    own = anchors(text)
    for line, target in links(text):
        if re.match(r'^[a-z][a-z0-9+.-]*:', target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition('#')
        where = f'{_rel(path)}:{line}: ({target})'
        if file_part:
            dest = osp.normpath(osp.join(osp.dirname(path), file_part))
            if not osp.exists(dest):
                errors.append(f'{where} does not exist')
                continue
            if not dest.startswith(root + os.sep) and dest != root:
                errors.append(f'{where} points outside the repository')
                continue
        else:
            dest = path
        if anchor:
            if not dest.endswith('.md') or osp.isdir(dest):
                errors.append(f'{where}: an anchor on a non-markdown target')
                continue
            names = own if dest == path else _anchors_of(dest)
            if anchor not in names:
                errors.append(f'{where}: no heading with anchor #{anchor} in {_rel(dest)}')
    return errors


# --------------------------------------------------------------------------------------
# commands in shell blocks


def shell_commands(body: str) -> List[List[str]]:
    """Commands of a shell block as token lists (continuations joined, comments dropped,
    split at ``&&``, ``||``, ``;``, ``|``; leading ``VAR=value`` assignments removed)."""
    joined = re.sub(r'\\\n', ' ', body)
    commands = []
    for line in joined.split('\n'):
        line = line.strip()
        if line.startswith('$ '):
            line = line[2:]
        if not line or line.startswith('#'):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # unbalanced quotes: not a command
            continue
        current: List[str] = []
        for tok in tokens + [';']:
            if tok in ('&&', '||', ';', '|'):
                while current and re.match(r'^[A-Za-z_][A-Za-z0-9_]*=', current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(tok)
    return commands


CONFIG_PATH = re.compile(r'^configs/(?:mmdet|mmseg|quickstart|_base_)/[\w./-]+\.py$')
REPO_PATH = re.compile(r'^(?:configs|tools|scripts|demo|tests|docs)/[\w./*{},-]+$')
#: wrappers whose extra arguments go to a Python tool
WRAPPERS = {'tools/dist_train.sh': 'tools/train.py', 'tools/slurm_train.sh': 'tools/train.py',
            'tools/dist_test.sh': 'tools/test.py', 'tools/slurm_test.sh': 'tools/test.py'}
#: paths written by a command (the output of ``-o``, ``--out`` ...) need not exist
OUTPUT_FLAGS = {'-o', '--out', '--output', '--out-dir', '--work-dir', '--show-dir', '--csv',
                '--md', '--png', '--json', '--markdown', '--dir', '--dest'}


def _path_exists(token: str) -> bool:
    """A repository path, with the docs' ``bN`` size placeholder and globs allowed."""
    pattern = token.replace('-bN_', '-b?_').replace('-bN-', '-b?-')
    pattern = re.sub(r'\{[^}]*\}', '*', pattern)
    return bool(glob.glob(osp.join(REPO_ROOT, pattern)))


def tool_of(cmd: List[str]) -> Optional[str]:
    """The tool whose ``--help`` lists the command's flags: ``tools/*.py`` run by python,
    a wrapper script's Python tool, ``scripts/gpu_session.sh``, or ``mim <subcommand>``."""
    if not cmd:
        return None
    head = osp.basename(cmd[0])
    if re.match(r'^python[\d.]*$', head) and len(cmd) > 1 and cmd[1].startswith('tools/'):
        return cmd[1] if cmd[1].endswith('.py') else None
    if head == 'bash' and len(cmd) > 1:
        if cmd[1] in WRAPPERS:
            return WRAPPERS[cmd[1]]
        if cmd[1] == 'scripts/gpu_session.sh':
            return cmd[1]
    if head == 'mim' and len(cmd) > 1 and cmd[1] == 'search':
        return 'mim search'
    return None


def _run_help(tool: str) -> Tuple[int, str]:
    if tool == 'mim search':
        from click.testing import CliRunner
        from mim.commands.search import cli
        result = CliRunner().invoke(cli, ['--help'])
        return result.exit_code, result.output
    argv = ['bash', tool, '--help'] if tool.endswith('.sh') else [PYTHON, tool, '--help']
    env = dict(os.environ, PYTHONWARNINGS='ignore')
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    return proc.returncode, proc.stdout + proc.stderr


@functools.lru_cache(maxsize=None)
def _all_helps() -> Dict[str, Tuple[int, str]]:
    """``--help`` of every tool the docs' shell blocks use, each run once per session
    (concurrently: most tools import torch and mmengine before parsing arguments)."""
    from concurrent.futures import ThreadPoolExecutor
    tools = set()
    for path in USER_DOCS:
        with open(path, encoding='utf-8') as f:
            _, blocks = split_markdown(f.read())
        for _, lang, body in blocks:
            if lang in SHELL_LANGS:
                tools.update(tool_of(cmd) for cmd in shell_commands(body))
    tools = sorted(t for t in tools - {None, 'mim search'}
                   if osp.exists(osp.join(REPO_ROOT, t)))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(tools, pool.map(_run_help, tools)))


def tool_help(tool: str) -> str:
    """``--help`` output of a tool (the flags it accepts)."""
    rc, out = _all_helps()[tool] if tool in _all_helps() else _run_help(tool)
    assert rc == 0, f'{tool} --help failed:\n{out}'
    return out


def check_commands(path: str, text: Optional[str] = None,
                   help_of=tool_help) -> List[str]:
    """Missing configs / tools / repository paths and unknown flags in a file's shell
    blocks."""
    if text is None:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    errors = []
    _, blocks = split_markdown(text)
    for line, lang, body in blocks:
        if lang not in SHELL_LANGS:
            continue
        for cmd in shell_commands(body):
            where = f'{_rel(path)}:{line}: `{" ".join(cmd)}`'
            outputs = {cmd[i + 1] for i, tok in enumerate(cmd[:-1]) if tok in OUTPUT_FLAGS}
            for tok in cmd:
                value = tok.split('=', 1)[1] if tok.startswith('--') and '=' in tok else tok
                if value in outputs:
                    continue
                if CONFIG_PATH.match(value) or (REPO_PATH.match(value) and not value.startswith(
                        ('configs/my/', 'docs/reports/', 'docs/benchmarks/'))):
                    if not _path_exists(value):
                        errors.append(f'{where}: {value} does not exist')
            tool = tool_of(cmd)
            if tool is None:
                continue
            if tool != 'mim search' and not osp.exists(osp.join(REPO_ROOT, tool)):
                errors.append(f'{where}: {tool} does not exist')
                continue
            flags = [t.split('=', 1)[0] for t in cmd[2:] if re.match(r'^--?[A-Za-z][\w-]*', t)]
            if not flags:
                continue
            if tool == 'mim search' and importlib.util.find_spec('mim') is None:
                continue  # openmim (the dev extra) not installed: the mim tests below skip
            text_help = help_of(tool)
            for flag in flags:
                if not re.search(r'(?<![\w-])' + re.escape(flag) + r'(?![\w-])', text_help):
                    errors.append(f'{where}: {tool} has no option {flag}')
    return list(dict.fromkeys(errors))


# --------------------------------------------------------------------------------------
# the checks on the real documentation


@pytest.mark.parametrize('path', USER_DOCS, ids=_rel)
def test_links_and_anchors_resolve(path):
    assert check_links(path) == []


@pytest.mark.parametrize('path', USER_DOCS, ids=_rel)
def test_commands_name_existing_configs_tools_and_flags(path):
    assert check_commands(path) == []


# --------------------------------------------------------------------------------------
# commands named in config comments, and a dry run of every command's arguments

CONFIG_FILES = sorted(glob.glob(osp.join(REPO_ROOT, 'configs', '**', '*.py'), recursive=True))
COMMENT_COMMAND = re.compile(r'((?:python[\d.]*|bash) (?:tools|scripts)/\S+.*)$')


def comment_commands(text: str) -> str:
    """The commands a Python file names in its comments (``# ... python tools/x.py ARGS``
    with its ``\\`` continuations), as the body of a shell block."""
    commands, current = [], None
    for line in text.splitlines():
        comment = line.split('#', 1)[1].strip() if '#' in line else None
        if current is not None and comment is not None:
            current.append(comment)
        elif comment is not None and COMMENT_COMMAND.search(comment):
            current = [COMMENT_COMMAND.search(comment).group(1)]
        else:
            current = None
        if current is not None and not current[-1].endswith('\\'):
            commands.append(' '.join(c.rstrip('\\').strip() for c in current))
            current = None
    return '\n'.join(commands)


@functools.lru_cache(maxsize=None)
def _tool_module(tool: str):
    spec = importlib.util.spec_from_file_location(
        'doc_tool_' + re.sub(r'\W', '_', tool), osp.join(REPO_ROOT, tool))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _official_names() -> frozenset:
    rc, out = _run([PYTHON, 'tools/download_weights.py', '--list'])
    assert rc == 0, out
    return frozenset(re.findall(r'[\w.-]+', out))


def _run(argv: List[str]) -> Tuple[int, str]:
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS='ignore'))
    return proc.returncode, proc.stdout + proc.stderr


PLACEHOLDER = re.compile(r'^[A-Z][A-Z_0-9]*$|[<>$]|\.\.\.')


def dry_run(cmd: List[str]) -> Optional[str]:
    """What is wrong with a command's arguments, without running it: the tool's own
    ``parse_args`` (choices, required values, exclusive flags, a ``flatten_mm://`` name
    given where a file is written) and, for ``download_weights.py``, that every NAME is an
    official file it lists. Commands with placeholders (``CONFIG``, ``<dir>``, ``$X``) are
    left to the flag check."""
    tool = tool_of(cmd)
    if tool is None or tool.endswith('.sh') or tool == 'mim search' or cmd[1] != tool:
        return None
    args = cmd[2:]
    if any(PLACEHOLDER.search(a) for a in args):
        return None
    if tool == 'tools/download_weights.py':
        unknown = [a for a in args if not a.startswith('-') and a not in _official_names()
                   and (args.index(a) == 0 or not args[args.index(a) - 1].startswith('--'))]
        return f'not an official name: {unknown}' if unknown else None
    module = _tool_module(tool)
    if not hasattr(module, 'parse_args'):
        return None
    import contextlib
    import io
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            module.parse_args(args)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue() else str(e)
    return None


def check_dry_runs(path: str, body: Optional[str] = None) -> List[str]:
    """``dry_run`` of every command in a file's shell blocks (or in ``body``)."""
    if body is None:
        with open(path, encoding='utf-8') as f:
            _, blocks = split_markdown(f.read())
        bodies = [b for _, lang, b in blocks if lang in SHELL_LANGS]
    else:
        bodies = [body]
    errors = []
    for text in bodies:
        for cmd in shell_commands(text):
            problem = dry_run(cmd)
            if problem:
                errors.append(f'{_rel(path)}: `{" ".join(cmd)}`: {problem}')
    return errors


@pytest.mark.parametrize('path', USER_DOCS, ids=_rel)
def test_documented_commands_parse(path):
    assert check_dry_runs(path) == []


def test_commands_in_config_comments_exist_and_parse():
    """A config comment that names a command (``# python tools/download_weights.py NAME``)
    names an existing tool, flags it has, paths that exist and arguments it accepts."""
    errors, seen = [], 0
    for path in CONFIG_FILES:
        with open(path, encoding='utf-8') as f:
            body = comment_commands(f.read())
        if not body:
            continue
        seen += len(shell_commands(body))
        errors += check_commands(path, text=f'```bash\n{body}\n```\n')
        errors += check_dry_runs(path, body)
    assert seen >= 8 and errors == []


def test_dry_run_finds_a_stale_command():
    """The checks above fail on what the shipped configs once said: a flatten_mm:// name
    as the output of convert_checkpoint.py, an unknown family, an unknown official name."""
    stale = ("# python tools/convert_checkpoint.py flatten_pvt_v2_b0.pth \\\n"
             "#     flatten_mm://flatten-pvt-v2-b0 --family flatten_pvt_v2 --arch b0\n"
             "# python tools/convert_checkpoint.py a.pth b.pth --family nope\n"
             "x = 1  # fetch ahead: python tools/download_weights.py flatten-pvt-v9\n")
    body = comment_commands(stale)
    assert len(shell_commands(body)) == 3
    errors = check_dry_runs('configs/x.py', body)
    assert len(errors) == 3, errors
    assert 'is a name, not a file' in errors[0] and 'flatten-pvt-v9' in errors[2]


INLINE_PATH = re.compile(
    r'`((?:flatten_mm|tools|scripts|configs|tests|docs|demo)/[\w./*-]*)`')


@pytest.mark.parametrize('path', USER_DOCS, ids=_rel)
def test_repository_paths_named_in_prose_exist(path):
    """`flatten_mm/...`, `tools/...` and the like in inline code name real files (a
    moved module must take its docs along)."""
    with open(path, encoding='utf-8') as f:
        prose, _ = split_markdown(f.read())
    missing = [f'{_rel(path)}:{n}: {m.group(1)}' for n, line in prose
               for m in INLINE_PATH.finditer(line) if not _path_exists(m.group(1).rstrip('/'))]
    assert missing == []


def test_readme_is_short_and_links_the_guides():
    with open(osp.join(REPO_ROOT, 'README.md'), encoding='utf-8') as f:
        text = f.read()
    assert len(text.splitlines()) <= 210
    for guide in ('docs/get_started.md', 'docs/model_zoo.md', 'docs/advanced/kernels.md',
                  'docs/user_guides/train_and_test.md', 'docs/user_guides/pretrained_weights.md',
                  'docs/user_guides/swap_backbone.md', 'CONTRIBUTING.md'):
        assert f']({guide}' in text, guide
    for data_dir in ('data/coco', 'data/ade/ADEChallengeData2016'):
        assert data_dir in text


@pytest.mark.parametrize('path', USER_DOCS, ids=_rel)
def test_user_docs_name_nothing_outside_the_repository(path):
    with open(path, encoding='utf-8') as f:
        text = f.read()
    for bad in ('../shared', 'shared/spec', 'shared/fixtures'):
        assert bad not in text, f'{_rel(path)} names {bad}'


@pytest.mark.parametrize('path', [p for p in USER_DOCS if not _rel(p).startswith(
    ('docs/benchmarks', 'docs/reports'))], ids=_rel)
def test_user_docs_carry_no_test_counts_or_ci_minutes(path):
    with open(path, encoding='utf-8') as f:
        text = f.read()
    assert not re.search(r'\d+ (?:tests? )?passed', text), _rel(path)
    assert not re.search(r'\bCI (?:time|minutes|\d+ min)', text), _rel(path)


def test_every_environment_variable_is_documented():
    used = set()
    for pattern in ('flatten_mm/**/*.py', 'tools/**/*.py', 'scripts/*.sh', 'tests/**/*.py',
                    '.ci/*'):
        for f in glob.glob(osp.join(REPO_ROOT, pattern), recursive=True):
            if osp.isfile(f):
                with open(f, encoding='utf-8', errors='replace') as fh:
                    used.update(re.findall(r'FLATTEN_MM_[A-Z][A-Z_]*[A-Z]', fh.read()))
    with open(osp.join(REPO_ROOT, 'docs', 'get_started.md'), encoding='utf-8') as f:
        documented = set(re.findall(r'FLATTEN_MM_[A-Z][A-Z_]*[A-Z]', f.read()))
    assert sorted(used - documented) == []


# --------------------------------------------------------------------------------------
# the checkers find what they must


def test_checker_finds_a_broken_link_and_anchor(tmp_path):
    doc = tmp_path / 'x.md'
    text = textwrap.dedent('''\
        # Title: with `code` and --flags

        ## Second heading
        [ok](#title-with-code-and---flags) [ok2](#second-heading) [web](https://example.org)
        [gone](no_such_file.md) [bad anchor](#no-such-heading)
        `[in code](no_such_either.md)`

        ```bash
        cat [not a link](nowhere.md)
        ```
        ''')
    doc.write_text(text)
    errors = check_links(str(doc), text, root=str(tmp_path))
    assert len(errors) == 2, errors
    assert 'no_such_file.md) does not exist' in errors[0]
    assert '#no-such-heading' in errors[1]


def test_checker_finds_an_anchor_missing_in_another_file():
    text = '[x](docs/get_started.md#no-such-section) [y](docs/get_started.md#environment-variables)'
    errors = check_links(osp.join(REPO_ROOT, 'README.md'), text)
    assert len(errors) == 1 and '#no-such-section' in errors[0], errors


def test_github_slugs():
    assert github_slug('Install: into an existing mmdet / mmseg environment') == \
        'install-into-an-existing-mmdet--mmseg-environment'
    assert github_slug('Checks: --verify and --train-smoke') == 'checks---verify-and---train-smoke'
    assert github_slug('Loading: `init_cfg` and load_from') == 'loading-init_cfg-and-load_from'
    assert github_slug('NaN / inf input') == 'nan--inf-input'
    assert anchors('# A\n## A\n```\n# not a heading\n```\n') == {'a', 'a-1'}


def test_checker_finds_a_renamed_flag_and_a_missing_config():
    helps = {'tools/train.py': 'usage: train.py [-h] [--work-dir WORK_DIR] [--amp]'}
    text = textwrap.dedent('''\
        ```bash
        python tools/train.py configs/mmdet/flatten_pvt/retinanet_flatten-pvt-t_fpn_1x_coco.py \\
            --work-dir w --ampp   # renamed
        bash tools/dist_train.sh configs/mmdet/no_such/config_1x_coco.py 8 --amp
        python tools/no_such_tool.py --x
        FOO=1 python tools/train.py CONFIG --amp && ls demo/data/no_such_dir
        ```
        ''')
    errors = check_commands(osp.join(REPO_ROOT, 'README.md'), text, help_of=helps.__getitem__)
    assert any('has no option --ampp' in e for e in errors), errors
    assert any('configs/mmdet/no_such/config_1x_coco.py does not exist' in e for e in errors)
    assert any('tools/no_such_tool.py does not exist' in e for e in errors)
    assert any('demo/data/no_such_dir does not exist' in e for e in errors)
    assert len(errors) == 4, errors


# --------------------------------------------------------------------------------------
# the model index (mim)


def _metafiles() -> List[str]:
    return sorted(glob.glob(osp.join(REPO_ROOT, 'configs', '**', 'metafile.yml'),
                            recursive=True))


def _models() -> List[dict]:
    models = []
    for f in _metafiles():
        with open(f, encoding='utf-8') as fh:
            models.extend(yaml.safe_load(fh)['Models'])
    return models


def test_model_index_imports_every_metafile():
    with open(osp.join(REPO_ROOT, 'model-index.yml'), encoding='utf-8') as f:
        imports = yaml.safe_load(f)['Import']
    assert sorted(imports) == sorted(_rel(f) for f in _metafiles())


def test_metafiles_cover_every_config_with_results_or_a_reason():
    configs = sorted(_rel(p) for p in glob.glob(osp.join(REPO_ROOT, 'configs', 'mm*', '*',
                                                         '*.py'))
                     if '_base_' not in p.split(osp.sep))  # fragments, not models
    models = _models()
    assert sorted(m['Config'] for m in models) == configs
    for m in models:
        assert m['Name'] == osp.splitext(osp.basename(m['Config']))[0]
        results = m.get('Results')
        if results:
            assert all(r['Metrics'] for r in results), m['Name']
        else:
            assert m['Metadata']['Published Results'].startswith('none'), m['Name']


def test_metafiles_carry_every_official_file_of_the_zoo():
    from flatten_mm.models import zoo
    by_config = {m['Config']: m for m in _models()}
    for w in zoo.official_weights().values():
        if w.is_whole_model:
            m = by_config[w.config]
            assert m['Weights'] == w.urls[0], w.name
            assert m['Metadata']['Converted Checkpoint'] == w.uri, w.name
            published = {(r['Dataset'], k): v for r in m['Results']
                         for k, v in r['Metrics'].items()}
            for label, value in w.metrics:  # ('COCO box AP', 38.4)
                dataset, metric = label.split(' ', 1)
                assert published[(dataset, metric)] == value, (w.name, label)
        else:
            users = zoo.configs_using(w, REPO_ROOT)
            for cfg in users:
                md = by_config[cfg]['Metadata']
                assert md['Pretrained Weights'] == w.urls[0], (w.name, cfg)
                assert md['Pretrained Checkpoint'] == w.uri, (w.name, cfg)


def test_model_zoo_table_matches_the_metafiles():
    """docs/model_zoo.md's per-config table says what the metafiles say."""
    with open(osp.join(REPO_ROOT, 'docs', 'model_zoo.md'), encoding='utf-8') as f:
        rows = {m.group(1): [c.strip() for c in m.group(2).split('|')]
                for m in re.finditer(r'^\| \[([\w.-]+)\]\(\.\./configs/[^)]+\) \|(.*)\|$',
                                     f.read(), re.M)}
    for m in _models():
        published = ', '.join(f'{k} {v}' for r in m.get('Results', [])
                              for k, v in r['Metrics'].items()) or '-'
        if m['Config'].startswith('configs/mmpretrain/'):  # ImageNet classifiers
            assert rows[m['Name']] == [published, 'official' if 'Weights' in m else
                                       'none released'], m['Name']
            continue
        imagenet = 'official' if 'Pretrained Weights' in m['Metadata'] else 'none released'
        trained = 'official, converted' if 'Weights' in m else '-'
        assert rows[m['Name']] == [published, imagenet, trained], m['Name']


@pytest.fixture(scope='module')
def installed_copy(tmp_path_factory):
    """flatten_mm built and installed (non-editable, no dependencies) into a directory
    put first on PYTHONPATH: what `pip install .` gives a user, with its `.mim`."""
    pytest.importorskip('mim', reason='openmim is not installed (the dev extra of setup.py)')
    import shutil
    # build from a copy: the build writes flatten_mm/.mim into the source tree it runs in
    src = tmp_path_factory.mktemp('src')
    skip = shutil.ignore_patterns('__pycache__', '*.pyc', '.mim', '*.egg-info')
    for name in ('setup.py', 'README.md', 'model-index.yml'):
        shutil.copy(osp.join(REPO_ROOT, name), src / name)
    for name in ('flatten_mm', 'configs', 'tools'):
        shutil.copytree(osp.join(REPO_ROOT, name), src / name, ignore=skip)
    target = tmp_path_factory.mktemp('site')
    proc = subprocess.run(
        [PYTHON, '-m', 'pip', 'install', '--quiet', '--no-deps', '--no-build-isolation',
         '--no-index', '--target', str(target), str(src)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(target)


def _mim(args: List[str], site: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=site, PYTHONWARNINGS='ignore')
    code = 'import sys; from mim.cli import cli; sys.exit(cli())'
    return subprocess.run([PYTHON, '-c', code] + args, capture_output=True, text=True,
                          timeout=300, env=env, cwd=site)


def test_installed_package_carries_the_mim_files(installed_copy):
    mim_dir = osp.join(installed_copy, 'flatten_mm', '.mim')
    assert osp.isfile(osp.join(mim_dir, 'model-index.yml'))
    for m in _models():
        assert osp.isfile(osp.join(mim_dir, m['Config'])), m['Config']
    assert osp.isfile(osp.join(mim_dir, 'tools', 'train.py'))


def test_installed_package_has_its_data_and_no_developer_tooling(installed_copy):
    """`pip install .` carries the files the models read at run time (the CPU kernel's
    and the ONNX Runtime operators' sources, the Triton kernels' limit table) and nothing
    of benchmarks/ or dev/."""
    ops = osp.join(installed_copy, 'flatten_mm', 'models', 'ops')
    assert osp.isfile(osp.join(ops, 'kernel_limits.json'))
    assert osp.isfile(osp.join(ops, 'csrc', 'quadtree_cpu.cpp'))
    assert osp.isfile(osp.join(ops, 'csrc', 'quadtree_level.h'))
    assert osp.isfile(osp.join(installed_copy, 'flatten_mm', 'deploy', 'csrc',
                               'quadtree_ort.cpp'))
    installed = [osp.relpath(osp.join(d, f), installed_copy)
                 for d, _, files in os.walk(installed_copy) for f in files]
    dev_names = ('benchmark', 'parity', 'sweep', 'gpu_kernel_check', 'gpu_session',
                 'flops_table', 'check_parity')
    assert not [p for p in installed if any(n in p for n in dev_names)]


def test_shipped_tools_run_from_the_installed_package(installed_copy):
    """Every Python tool mim ships (`flatten_mm/.mim/tools`) starts (`--help`) with only
    the installed package on the path: no tool imports benchmarks/, dev/ or tests/."""
    tools = osp.join(installed_copy, 'flatten_mm', '.mim', 'tools')
    scripts = sorted(osp.join(d, f) for d, _, files in os.walk(tools) for f in files
                     if f.endswith('.py'))
    assert len(scripts) >= 8
    code = textwrap.dedent('''\
        import runpy, sys
        failed = []
        for path in sys.argv[1:]:
            sys.argv = [path, '--help']
            try:
                runpy.run_path(path, run_name='__main__')
            except SystemExit as e:
                if e.code not in (0, None):
                    failed.append(path)
            except Exception as e:
                failed.append(f'{path}: {type(e).__name__}: {e}')
        print('FAILED', failed)
        sys.exit(1 if failed else 0)
        ''')
    env = dict(os.environ, PYTHONPATH=installed_copy, PYTHONWARNINGS='ignore')
    proc = subprocess.run([PYTHON, '-c', code] + scripts, capture_output=True, text=True,
                          timeout=600, env=env, cwd=installed_copy)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_mim_search_lists_every_config(installed_copy):
    env = dict(os.environ, PYTHONPATH=installed_copy, PYTHONWARNINGS='ignore')
    code = textwrap.dedent('''\
        import json
        from mim.commands.search import get_model_info
        df = get_model_info('flatten_mm', local=True)
        print(json.dumps({name: {k: (v if isinstance(v, (str, int, float)) else None)
                                 for k, v in row.items() if v == v}
                          for name, row in df.to_dict('index').items()}))
        ''')
    proc = subprocess.run([PYTHON, '-c', code], capture_output=True, text=True, timeout=300,
                          env=env, cwd=installed_copy)
    assert proc.returncode == 0, proc.stderr
    import json
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    models = {m['Name']: m for m in _models()}
    assert sorted(rows) == sorted(models)
    for name, m in models.items():
        assert rows[name]['config'] == m['Config']
    row = rows['mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco']
    assert row['coco/box_ap'] == 38.8 and row['coco/mask_ap'] == 36.5
    assert row['weight'].endswith('QuadTreeAttention_maskrcnn/b0_1x.pth')
    # the command line, as the docs show it
    proc = _mim(['search', 'flatten_mm', '--model', 'quadtree-pvtv2'], installed_copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'retinanet_quadtree-b-pvt-v2-b4_fpn_1x_coco' in proc.stdout
    assert 'mask-rcnn_flatten-swin' not in proc.stdout


COCO_MINI = ['test_dataloader.dataset.data_root=demo/data/coco_mini/',
             'test_dataloader.dataset.ann_file=annotations/instances_val2017.json',
             'test_dataloader.dataset.data_prefix.img=val2017/',
             'test_dataloader.dataset.indices=2',
             'test_evaluator.ann_file=demo/data/coco_mini/annotations/instances_val2017.json']


def test_mim_download_then_tools_test(installed_copy, tmp_path):
    """`mim download flatten_mm --config NAME --dest D` then `tools/test.py D/NAME.py
    D/<file>`: mim fetches the metafile's `Weights` (the official file; put into D
    beforehand here, so mim finds it and nothing touches the network) and dumps the
    config; tools/test.py reads the official mmdet 2.x file as it is (converted in memory,
    said in the log) and evaluates (two bundled COCO images)."""
    pytest.importorskip('mmdet')
    sys.path.insert(0, osp.join(REPO_ROOT, 'tests'))
    from official_layouts import write_official
    from flatten_mm.apis.whole_model import build_config_model
    name = 'retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco'
    weights = {m['Name']: m for m in _models()}[name]['Weights']
    official = tmp_path / weights.split('/')[-1]
    write_official(build_config_model(osp.join(REPO_ROOT, 'configs', 'mmdet', 'quadtree_pvt_v2',
                                               f'{name}.py')), 'retinanet', official)
    proc = _mim(['download', 'flatten_mm', '--config', name, '--dest', str(tmp_path)],
                installed_copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'exists' in proc.stdout and (tmp_path / f'{name}.py').is_file()
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHONWARNINGS='ignore')
    proc = subprocess.run(
        [PYTHON, 'tools/test.py', str(tmp_path / f'{name}.py'), str(official), '--work-dir',
         str(tmp_path / 'work'), '--cfg-options'] + COCO_MINI,
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO_ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert 'official quadtree whole-model checkpoint' in out and 'converted in memory' in out
    assert 'coco/bbox_mAP' in out


# ----------------------------------------------------------------- python in the user docs
SNIPPET_DOCS = sorted([osp.join(REPO_ROOT, 'README.md'), osp.join(REPO_ROOT, 'docs', 'get_started.md')]
                      + glob.glob(osp.join(REPO_ROOT, 'docs', 'user_guides', '*.md')))
#: python blocks that are shown, not run here, and where they are run instead
NOT_RUN = {'OnnxModel(': 'needs an exported .onnx file; tests/test_deploy runs OnnxModel',
           'register_custom_ops_library(': 'needs the built operator library and an exported '
                                           'file; tests/test_deploy/test_ort_custom_ops.py '
                                           'registers it'}
SCHEME_NAME = re.compile(r"flatten_mm://([\w.-]+)")


def _python_blocks(kind: str) -> List[Tuple[str, int, str]]:
    """``(doc, line, code)`` of the python blocks of the user docs: ``'inference'`` (they
    call mmdet's / mmseg's inference APIs) or ``'config'`` (config snippets)."""
    found = []
    for path in SNIPPET_DOCS:
        with open(path, encoding='utf-8') as f:
            _, blocks = split_markdown(f.read())
        for line, lang, body in blocks:
            if lang != 'python' or any(marker in body for marker in NOT_RUN):
                continue
            inference = 'Inferencer' in body or re.search(r'\binference_\w+\(', body)
            if (kind == 'inference') == bool(inference):
                found.append((_rel(path), line, body))
    return found


@pytest.fixture(scope='module')
def official_stand_ins(tmp_path_factory):
    """A ``flatten_mm://`` cache holding, for every whole model the examples name, a
    freshly initialised model of its config in the converted layout with its dataset
    meta: the examples run as written, without the network."""
    pytest.importorskip('mmdet')
    pytest.importorskip('mmseg')
    import torch
    from flatten_mm.apis.forward import build_model
    from flatten_mm.models import hub, zoo
    from mmengine.config import Config
    home = tmp_path_factory.mktemp('flatten_mm_home')
    names = {n for _, _, code in _python_blocks('inference') for n in SCHEME_NAME.findall(code)}
    assert names, 'no example names an official model'
    for name in sorted(names):
        weights = zoo.get_official_weights(name)
        assert weights.is_whole_model, name
        cfg = Config.fromfile(osp.join(REPO_ROOT, weights.config))
        torch.manual_seed(0)
        model = build_model(cfg, init_weights=True)
        # (the dataset meta a converted official file has: mmdet 2.x stored CLASSES,
        # mmseg 0.x CLASSES and PALETTE)
        if cfg.default_scope == 'mmdet':
            from mmdet.datasets import CocoDataset
            meta = dict(classes=tuple(CocoDataset.METAINFO['classes']))
        else:
            from mmseg.datasets import ADE20KDataset
            meta = dict(classes=tuple(ADE20KDataset.METAINFO['classes']),
                        palette=[list(c) for c in ADE20KDataset.METAINFO['palette']])
        # (and the converter version a file converted today records: flatten_mm.models.hub)
        meta = dict(dataset_meta=meta, converter=hub.converter_version(weights))
        torch.save(dict(state_dict=model.state_dict(), meta=meta),
                   home / osp.basename(weights.target))
    return str(home)


@pytest.mark.parametrize('doc,line,code', _python_blocks('inference'),
                         ids=lambda v: str(v)[:40] if isinstance(v, str) else str(v))
def test_inference_examples_run_as_written(doc, line, code, official_stand_ins, tmp_path):
    """Each inference example of the README and get_started, unchanged, in a fresh
    process (from a folder with the repository's configs/ and demo/), its `flatten_mm://`
    models read from the cache: it runs, and what it paints lands in its out_dir."""
    for name in ('configs', 'demo'):
        os.symlink(osp.join(REPO_ROOT, name), tmp_path / name)
    env = dict(os.environ, FLATTEN_MM_HOME=official_stand_ins, PYTHONWARNINGS='ignore',
               PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([PYTHON, '-c', code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f'{doc}:{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    for out_dir in re.findall(r"out_dir='([^']+)'", code):
        painted = glob.glob(osp.join(tmp_path, out_dir, '**', '*.[jp][pn]g'), recursive=True)
        assert painted, f'{doc}:{line}: nothing painted under {out_dir}'


@pytest.mark.parametrize('doc,line,code', _python_blocks('config'),
                         ids=lambda v: str(v)[:40] if isinstance(v, str) else str(v))
def test_config_snippets_build(doc, line, code, tmp_path):
    """Each config snippet of the README and user guides builds what it describes: a
    whole config (`_base_`), a `model = dict(...)` fragment merged into mmdet's Mask R-CNN
    config (what the docs tell users to put into theirs), or a `backbone = dict(...)`
    (built and run on its smallest input). Every `Pretrained` checkpoint it names is an
    official file's `flatten_mm://` name (a local path would be a file the reader does
    not have)."""
    pytest.importorskip('mmdet')
    from mmengine.config import Config
    from flatten_mm.apis.forward import build_model
    from flatten_mm.models import zoo
    for name in SCHEME_NAME.findall(code):
        zoo.get_official_weights(name)  # raises for a name without official weights
    local = re.findall(r"checkpoint='([^']+)'", code)
    assert all(c.startswith('flatten_mm://') for c in local), f'{doc}:{line}: {local}'
    path = tmp_path / 'snippet.py'
    if '_base_' not in code and re.search(r'^model = dict\(', code, re.M):
        code = "_base_ = ['mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py']\n" + code
    path.write_text(code)
    cfg = Config.fromfile(str(path))
    if 'model' in cfg:
        model = build_model(cfg, scope=cfg.get('default_scope', 'mmdet'))
        assert type(model.backbone).__module__.startswith('flatten_mm.'), f'{doc}:{line}'
        return
    assert 'backbone' in cfg, f'{doc}:{line}: neither a model nor a backbone'
    import torch
    from flatten_mm.registry import MODELS
    backbone = MODELS.build(cfg.backbone).eval()
    side = max(64, backbone.min_input_size()[0]) if hasattr(backbone, 'min_input_size') else 64
    with torch.no_grad():
        outs = backbone(torch.randn(1, 3, side, side))
    assert len(outs) == len(backbone.out_indices), f'{doc}:{line}'
