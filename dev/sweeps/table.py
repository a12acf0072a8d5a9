"""The one resumable CSV table of the sweeps: rows keyed by some columns, read back as
dicts, and rewritten atomically after each added row, so that a stopped sweep resumes
where it stopped and never leaves half a file."""
import csv
import os
import os.path as osp
from typing import Dict, Iterable, List, Mapping, Sequence


def read_table(path: str, columns: Sequence[str]) -> List[Dict[str, str]]:
    """The rows of ``path`` restricted to ``columns`` (missing cells ``''``); ``[]`` when
    the file does not exist."""
    if not osp.isfile(path):
        return []
    with open(path, newline='', encoding='utf-8') as f:
        return [{k: row.get(k) or '' for k in columns} for row in csv.DictReader(f)]


def write_table(path: str, columns: Sequence[str], rows: Iterable[Mapping]) -> None:
    """Rewrite ``path`` with ``rows`` (cells outside ``columns`` dropped, missing ones
    ``''``) through a temporary file replaced in one step."""
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    tmp = f'{path}.tmp{os.getpid()}'
    with open(tmp, 'w', newline='', encoding='utf-8') as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, '') for k in columns})
    os.replace(tmp, path)


def upsert_rows(path: str, columns: Sequence[str], rows: Iterable[Mapping],
                key: Sequence[str]) -> List[Dict[str, str]]:
    """Add ``rows`` to the table, each replacing an earlier row with the same ``key``
    cells (earlier rows keep their order, new ones follow), and rewrite it; returns the
    table's rows."""
    new = [{k: str(row.get(k, '')) for k in columns} for row in rows]
    keys = {tuple(row[k] for k in key) for row in new}
    kept = [row for row in read_table(path, columns) if tuple(row[k] for k in key) not in keys]
    write_table(path, columns, kept + new)
    return kept + new
