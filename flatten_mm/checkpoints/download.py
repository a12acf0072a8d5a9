"""Downloading official checkpoint files: resumable, with their SHA-256 checked.

Used by the ``flatten_mm://`` checkpoint scheme (``flatten_mm.models.hub``) and by
``tools/download_weights.py``. A file is downloaded to ``<folder>/<name>.pth`` through
``<name>.pth.part`` (an interrupted download resumes from it); its SHA-256 is checked
against the published sum where one is known, otherwise against the sum recorded at its
first download in ``<folder>/SHA256SUMS.json``. A file put into ``<folder>`` by hand
(no network) is picked up and checked the same way.
"""
import hashlib
import json
import logging
import os
import os.path as osp
import sys
import time
import urllib.request
from typing import Callable, Optional, Sequence

from mmengine.logging import print_log

CHUNK = 1 << 20
SUMS_FILE = 'SHA256SUMS.json'


class DownloadError(RuntimeError):
    """A download failed or its SHA-256 does not match."""


def log_message(msg: str) -> None:
    """Where download messages go by default: mmengine's current logger (INFO)."""
    print_log(msg, logger='current', level=logging.INFO)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(CHUNK), b''):
            digest.update(block)
    return digest.hexdigest()


def _progress(done: int, total: Optional[int], start: float, final: bool = False) -> None:
    rate = done / max(time.time() - start, 1e-6) / 2**20
    if total:
        width = 30
        filled = int(width * done / total)
        text = (f'\r  [{"#" * filled}{"." * (width - filled)}] {100 * done / total:5.1f}% '
                f'{done / 2**20:.1f}/{total / 2**20:.1f} MiB {rate:.1f} MiB/s')
    else:
        text = f'\r  {done / 2**20:.1f} MiB {rate:.1f} MiB/s'
    sys.stderr.write(text + ('\n' if final else ''))
    sys.stderr.flush()


def download(url: str, path: str, log: Callable[[str], None] = log_message) -> None:
    """Download ``url`` to ``path`` through ``path + '.part'``, resuming a partial file
    (HTTP range request; ``file://`` URLs skip the bytes already there); messages go to
    ``log``, the progress bar to stderr.

    Raises:
        DownloadError: the URL cannot be read.
    """
    part = path + '.part'
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    offset = osp.getsize(part) if osp.isfile(part) else 0
    request = urllib.request.Request(url, headers={'User-Agent': 'flatten_mm'})
    if offset:
        request.add_header('Range', f'bytes={offset}-')
    try:
        resp = urllib.request.urlopen(request, timeout=60)
    except Exception as err:  # noqa: BLE001 (URLError, HTTPError, ValueError, OSError)
        raise DownloadError(f'cannot download {url}: {type(err).__name__}: {err}') from None
    with resp:
        status = getattr(resp, 'status', None)
        length = resp.headers.get('Content-Length')
        length = int(length) if length and length.isdigit() else None
        if offset and status == 206:  # the server sends the rest
            mode, total = 'ab', (offset + length if length else None)
        elif offset and url.startswith('file:'):  # local file: skip what is already there
            resp.read(offset)
            mode, total = 'ab', length
        else:  # no resume possible: start again
            offset, mode, total = 0, 'wb', length
        if offset:
            log(f'  resuming at {offset / 2**20:.1f} MiB ({offset} bytes)')
        done, start = offset, time.time()
        with open(part, mode) as f:
            for block in iter(lambda: resp.read(CHUNK), b''):
                f.write(block)
                done += len(block)
                _progress(done, total, start)
        _progress(done, total, start, final=True)
    if total is not None and done != total:
        raise DownloadError(f'{url}: got {done} of {total} bytes; run again to resume')
    os.replace(part, path)


def _load_sums(path: str) -> dict:
    if osp.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {}


def fetch(name: str, urls: Sequence[str], folder: str, sha256: Optional[str] = None,
          manual_urls: Sequence[str] = (), force: bool = False,
          log: Callable[[str], None] = log_message) -> str:
    """``<folder>/<name>.pth``: downloaded from the first of ``urls`` that answers unless
    already there, then its SHA-256 checked (``sha256``: the published sum, else the one
    recorded at the first download) or recorded; messages go to ``log``.

    Raises:
        DownloadError: no URL could be read (the message names every URL, the manual
            mirrors and where a file downloaded by hand is picked up), or the SHA-256
            differs.
    """
    raw = osp.join(folder, f'{name}.pth')
    sums_path = osp.join(folder, SUMS_FILE)
    if force and osp.isfile(raw):
        os.remove(raw)
    if not osp.isfile(raw):
        errors = []
        for url in urls:
            log(f'downloading {url}')
            try:
                download(url, raw, log)
                break
            except DownloadError as err:
                errors.append(str(err))
        else:
            manual = ''.join(f'\n  {u}' for u in manual_urls)
            raise DownloadError(
                '; '.join(errors) + f'. Without network: download it by hand' +
                (f' (official mirror:{manual}\n)' if manual else '') +
                f' and put it at {raw} (it is picked up from there)')
    digest = sha256_of(raw)
    sums = _load_sums(sums_path)
    expected = sha256 or sums.get(name, {}).get('sha256')
    if expected and digest != expected:
        where = 'published' if sha256 else f'recorded in {sums_path} at the first download'
        raise DownloadError(f'{raw}: SHA-256 {digest} differs from the {where} {expected} '
                            '(corrupt or changed file); delete it to download it again')
    if name not in sums:
        sums[name] = dict(sha256=digest, url=urls[0] if urls else '', bytes=osp.getsize(raw))
        tmp = f'{sums_path}.tmp-{os.getpid()}'
        with open(tmp, 'w') as f:
            json.dump(sums, f, indent=1, sort_keys=True)
        os.replace(tmp, sums_path)
        if not sha256:
            log(f'SHA-256 {digest} (no published sum; recorded in {sums_path} and checked on '
                'later runs)')
    else:
        log(f'SHA-256 {digest} ok')
    return raw
