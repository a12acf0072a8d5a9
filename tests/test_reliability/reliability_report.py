"""Collects what each bad input produced, for ``docs/reports/bad_inputs.md``.

Tests call ``record(case, backbone, trigger, outcome)``. When the environment variable
``FLATTEN_MM_RELIABILITY_DOC`` names a markdown file, the records are written into it
at interpreter exit, between the markers ``<!-- generated: begin -->`` and
``<!-- generated: end -->`` (the rest of the file is kept). Regenerate with::

    FLATTEN_MM_RELIABILITY_DOC=docs/reports/bad_inputs.md python -m pytest tests/test_reliability -q
"""
import atexit
import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

BEGIN = '<!-- generated: begin -->'
END = '<!-- generated: end -->'

#: case -> list of (backbone, trigger, outcome)
RECORDS: 'OrderedDict[str, List[Tuple[str, str, str]]]' = OrderedDict()
_TITLES: Dict[str, str] = {}


def describe(exc: BaseException, replace: Optional[Dict[str, str]] = None) -> str:
    """``'Type: message'`` with volatile substrings (tmp paths) replaced."""
    text = f'{type(exc).__name__}: {exc}'
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    return re.sub(r' at 0x[0-9a-f]+', '', text)


def record(case: str, backbone: str, trigger: str, outcome: str, title: str = '') -> None:
    if title:
        _TITLES[case] = title
    entries = RECORDS.setdefault(case, [])
    if (backbone, trigger, outcome) not in entries:
        entries.append((backbone, trigger, outcome))


def _cell(text: str) -> str:
    return '`` ' + text.replace('|', '\\|') + ' ``'


def render() -> str:
    """Markdown: a table per case when every outcome is one line, else code blocks."""
    lines = [BEGIN, '']
    for case, entries in RECORDS.items():
        lines.append(f'### {_TITLES.get(case, case)}')
        lines.append('')
        entries = sorted(entries)
        if all('\n' not in outcome for _, _, outcome in entries):
            lines.append('| backbone / path | input | outcome |')
            lines.append('| --- | --- | --- |')
            for backbone, trigger, outcome in entries:
                lines.append(f'| `{backbone}` | {trigger} | {_cell(outcome)} |')
            lines.append('')
            continue
        for backbone, trigger, outcome in entries:
            lines.append(f'- `{backbone}`: {trigger}')
            lines.append('')
            lines.append('  ```text')
            lines.extend('  ' + line for line in outcome.splitlines())
            lines.append('  ```')
            lines.append('')
    lines.append(END)
    return '\n'.join(lines)


def _write(path: str) -> None:
    if not RECORDS:
        return
    body = render()
    text = ''
    if os.path.isfile(path):
        with open(path) as f:
            text = f.read()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + body + text[text.index(END) + len(END):]
    else:
        text = text.rstrip('\n') + '\n\n' + body + '\n'
    with open(path, 'w') as f:
        f.write(text)


if os.environ.get('FLATTEN_MM_RELIABILITY_DOC'):
    atexit.register(_write, os.environ['FLATTEN_MM_RELIABILITY_DOC'])
