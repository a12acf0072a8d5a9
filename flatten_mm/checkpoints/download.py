"""Downloading official checkpoint files: safe under concurrency, faults and bad records.

Used by the ``flatten_mm://`` checkpoint scheme (``flatten_mm.models.hub``) and by
``tools/download_weights.py``. In a folder ``<folder>`` (the cache's ``official/``):

* ``<name>.pth``: the official file, moved into place only when complete (and, where the
  authors published a SHA-256, only when it matches).
* ``<name>.lock``: the inter-process lock of ``name`` (``file_lock``, ``fcntl.flock``):
  whoever holds it is the only one downloading or converting ``name``; the others wait,
  then read what it made. The kernel releases it when its holder dies, so it never goes
  stale.
* ``<name>.pth.<host>-<pid>-<random>.part``: the transfer of one writer. Every writer
  has its own file, so two writers (e.g. where the file system has no locks) never
  write into one file; the last complete one is moved into place atomically.
* ``<name>.pth.part``: a transfer that failed midway, kept for the next writer to resume
  (claimed by an atomic rename, so one writer resumes it).
* ``SHA256SUMS.json``: the *recorded* sums of files without a published one. A sum is
  recorded (``record_sum``) only after its file was loaded and converted, by the caller
  that did so; a file that differs from its record is refused with a message that names
  the record and how to clear it (``forget`` / ``force``).

Every transfer failure (HTTP errors, timeouts, dropped connections, truncated bodies, an
HTML page instead of the file) raises ``DownloadError`` naming the URL, so the caller
goes on with the next URL.
"""
import errno
import hashlib
import http.client
import json
import logging
import os
import os.path as osp
import re
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

from mmengine.logging import print_log

try:  # POSIX; elsewhere the lock is skipped (the per-writer files keep downloads whole)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

CHUNK = 1 << 20
SUMS_FILE = 'SHA256SUMS.json'
#: seconds a socket operation (connect, one read) may take before the transfer fails
TIMEOUT_S = 60.0
#: seconds to wait for another process's download of the same name before giving up
LOCK_WAIT_S = 6 * 3600.0
#: a per-writer ``.part`` file not written for this long belongs to a dead writer
STALE_PART_S = 600.0


class DownloadError(RuntimeError):
    """A download failed, or a file's SHA-256 differs from the published / recorded one."""


class Fetched(NamedTuple):
    """The official file ``fetch`` made available."""

    path: str
    sha256: str
    source: str  # the URL it came from, or its path when it was already there
    downloaded: bool  # by this call (``False``: it was already there, e.g. put by hand)


def log_message(msg: str) -> None:
    """Where download messages go by default: mmengine's current logger (INFO)."""
    print_log(msg, logger='current', level=logging.INFO)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(CHUNK), b''):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def file_lock(path: str, log: Callable[[str], None] = log_message,
              timeout: Optional[float] = None) -> Iterator[None]:
    """Hold the exclusive inter-process lock ``path`` (created if missing) inside the block.

    ``fcntl.flock`` on a file of its own: it excludes other processes and other threads
    (each acquisition opens its own descriptor), and the kernel drops it when the holder
    dies. While waiting, ``log`` hears about it every 30 s. A file system without locks
    (``ENOLCK`` / ``EOPNOTSUPP``) is logged and the block runs unlocked.

    Raises:
        DownloadError: not acquired within ``timeout`` seconds (default ``LOCK_WAIT_S``).
    """
    timeout = LOCK_WAIT_S if timeout is None else timeout
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start = last_log = time.monotonic()
        delay, locked = 0.01, fcntl is not None
        if fcntl is None:  # (Windows)
            log(f'warning: no inter-process lock on this platform (fcntl): {path} is not '
                'held; processes fetching the same file at once each write a temporary file '
                'of their own and the last complete one is kept')
        while locked:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    log(f'warning: cannot lock {path} ({err}); going on without the lock')
                    locked = False
                    break
            now = time.monotonic()
            if now - start > timeout:
                raise DownloadError(f'waited {now - start:.0f} s for the lock {path} (another '
                                    'process is downloading or converting the same file)')
            if now - last_log >= 30:
                log(f'waiting for another process to finish with {path} '
                    f'({now - start:.0f} s so far)')
                last_log = now
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        yield
    finally:
        os.close(fd)  # (releases the lock)


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


#: what a failed transfer raises: URLError / HTTPError / timeouts / resets are OSError,
#: IncompleteRead and friends HTTPException, a malformed URL ValueError
TRANSFER_ERRORS = (OSError, http.client.HTTPException, ValueError)


def _range_total(content_range: Optional[str]) -> Optional[int]:
    """The full size in a ``Content-Range`` header (``bytes */123``, ``bytes 0-9/123``)."""
    m = re.search(r'/(\d+)\s*$', content_range or '')
    return int(m.group(1)) if m else None


def _range_start(content_range: Optional[str]) -> Optional[int]:
    m = re.match(r'\s*bytes\s+(\d+)-', content_range or '')
    return int(m.group(1)) if m else None


def _open(url: str, tmp: str, log: Callable[[str], None]):
    """``(response, offset, mode, total)`` for appending the rest of ``url`` to ``tmp``,
    or ``None`` when ``tmp`` already holds all of it (HTTP 416 with a matching size)."""
    for _ in range(2):  # a second try only after dropping a stale partial file
        offset = osp.getsize(tmp) if osp.isfile(tmp) else 0
        request = urllib.request.Request(url, headers={'User-Agent': 'flatten_mm'})
        if offset:
            request.add_header('Range', f'bytes={offset}-')
        try:
            resp = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as err:
            if err.code == 416 and offset:
                size = _range_total(err.headers.get('Content-Range'))
                if size == offset:
                    log(f'  the partial file already holds all {offset} bytes')
                    return None
                log(f'  the partial file ({offset} bytes) does not fit the file on the server '
                    f'({size} bytes): downloading again')
                os.remove(tmp)
                continue
            raise DownloadError(f'cannot download {url}: HTTP {err.code} {err.reason}') from None
        except TRANSFER_ERRORS as err:
            raise DownloadError(f'cannot download {url}: {type(err).__name__}: {err}') from None
        status = getattr(resp, 'status', None)
        length = resp.headers.get('Content-Length')
        length = int(length) if length and length.isdigit() else None
        if resp.headers.get_content_type() == 'text/html':
            resp.close()
            raise DownloadError(f'cannot download {url}: the server sent an HTML page, not the '
                                'checkpoint (a login, quota or error page?)')
        if offset and status == 206:
            start = _range_start(resp.headers.get('Content-Range'))
            if start not in (None, offset):  # not the part asked for: start again
                resp.close()
                os.remove(tmp)
                continue
            return resp, offset, 'ab', (offset + length if length is not None else None)
        if offset and url.startswith('file:'):  # local file: skip what is already there
            resp.read(offset)
            return resp, offset, 'ab', length
        return resp, 0, 'wb', length  # no resume possible: start again
    raise DownloadError(f'cannot download {url}: the server does not resume consistently')


def _transfer(url: str, tmp: str, log: Callable[[str], None]) -> None:
    """Append the rest of ``url`` to ``tmp`` until it is complete.

    Raises:
        DownloadError: any failure, naming ``url``; what arrived stays in ``tmp``.
    """
    opened = _open(url, tmp, log)
    if opened is None:
        return
    resp, offset, mode, total = opened
    if offset:
        log(f'  resuming at {offset / 2**20:.1f} MiB ({offset} bytes)')
    done, start = offset, time.time()
    try:
        with resp, open(tmp, mode) as f:
            for block in iter(lambda: resp.read(CHUNK), b''):
                f.write(block)
                done += len(block)
                _progress(done, total, start)
    except TRANSFER_ERRORS as err:
        raise DownloadError(f'{url}: the transfer failed after {done} bytes: '
                            f'{type(err).__name__}: {err}') from None
    finally:
        _progress(done, total, start, final=True)
    if total is not None and done != total:
        raise DownloadError(f'{url}: got {done} of {total} bytes')


def _looks_like_html(path: str) -> bool:
    with open(path, 'rb') as f:
        head = f.read(512).lstrip().lower()
    return head.startswith((b'<!doctype', b'<html', b'<?xml', b'<head', b'<body'))


def partial_files(path: str) -> list:
    """Every partial file of ``path``: the resumable one and the per-writer ones."""
    folder, base = osp.split(osp.abspath(path))
    if not osp.isdir(folder):
        return []
    return sorted(osp.join(folder, f) for f in os.listdir(folder)
                  if f.startswith(base + '.') and f.endswith('.part'))


def remove_partials(path: str, older_than: Optional[float] = None) -> None:
    """Remove the partial files of ``path`` (only those not written for ``older_than``
    seconds, when given: the leftovers of dead writers)."""
    now = time.time()
    for part in partial_files(path):
        try:
            if older_than is None or now - osp.getmtime(part) > older_than:
                os.remove(part)
        except FileNotFoundError:
            pass


def download(url: str, path: str, log: Callable[[str], None] = log_message,
             verify: Optional[Callable[[str], None]] = None) -> None:
    """Download ``url`` to ``path``: into a file of this writer's own, resuming the partial
    file ``path + '.part'`` (HTTP range request; ``file://`` URLs skip the bytes already
    there); ``verify(tmp)`` (may raise ``DownloadError``) judges the complete file before
    it is moved to ``path`` atomically. Messages go to ``log``, the progress bar to stderr.

    Raises:
        DownloadError: the URL cannot be read or the transfer failed (what arrived is kept
            in ``path + '.part'`` for the next try to resume), an HTML page came instead of
            the file, or ``verify`` refused it (both discarded).
    """
    part = path + '.part'
    mine = f'{path}.{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.part'
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    try:
        os.replace(part, mine)  # claim the resumable partial file (one claimant wins)
    except FileNotFoundError:
        pass
    try:
        _transfer(url, mine, log)
    except DownloadError as err:
        if osp.isfile(mine) and osp.getsize(mine):
            os.replace(mine, part)
            raise DownloadError(f'{err}; run again to resume') from None
        raise
    finally:
        if osp.isfile(mine) and not osp.getsize(mine):
            os.remove(mine)
    try:
        if _looks_like_html(mine):
            raise DownloadError(f'cannot download {url}: the server sent an HTML page, not the '
                                'checkpoint (a login, quota or error page?)')
        if verify is not None:
            verify(mine)
        os.replace(mine, path)
    finally:
        if osp.isfile(mine):
            os.remove(mine)


# --- recorded sums -------------------------------------------------------------------


def sums_path(folder: str) -> str:
    return osp.join(folder, SUMS_FILE)


def _read_sums(folder: str) -> dict:
    path = sums_path(folder)
    if not osp.isfile(path):
        return {}
    try:
        with open(path) as f:
            sums = json.load(f)
    except (OSError, ValueError) as err:
        raise DownloadError(f'{path} cannot be read ({err}); delete it (it only holds the '
                            'SHA-256 recorded at earlier downloads)') from None
    return sums if isinstance(sums, dict) else {}


def _update_sums(folder: str, change: Callable[[dict], None]) -> None:
    """Read, change and atomically rewrite ``SHA256SUMS.json`` under its own lock."""
    path = sums_path(folder)
    with file_lock(path + '.lock', timeout=60):
        sums = _read_sums(folder)
        change(sums)
        tmp = f'{path}.{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp'
        with open(tmp, 'w') as f:
            json.dump(sums, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def recorded_sum(folder: str, name: str) -> Optional[dict]:
    """The record of ``name`` (``sha256``, ``url``, ``bytes``), ``None`` when none."""
    entry = _read_sums(folder).get(name)
    return entry if isinstance(entry, dict) and entry.get('sha256') else None


def record_sum(folder: str, name: str, digest: str, source: str, nbytes: int,
               log: Callable[[str], None] = log_message) -> None:
    """Record ``digest`` for ``name`` (call it only once the file loaded and converted)."""
    def change(sums):
        sums[name] = dict(sha256=digest, url=source, bytes=nbytes)

    _update_sums(folder, change)
    log(f'SHA-256 {digest} (no published sum; recorded in {sums_path(folder)} and checked on '
        'later runs)')


def forget(folder: str, name: str, log: Callable[[str], None] = log_message) -> None:
    """Drop the record of ``name`` (what ``force`` does before downloading again)."""
    if recorded_sum(folder, name) is None:
        return

    def change(sums):
        sums.pop(name, None)

    _update_sums(folder, change)
    log(f'cleared the recorded SHA-256 of {name} in {sums_path(folder)}')


def check_sum(path: str, name: str, folder: str, digest: str,
              published: Optional[str] = None) -> None:
    """Hold ``digest`` (of the file ``path``, as the message names it) to the published
    sum, else to the recorded one.

    Raises:
        DownloadError: they differ; for a recorded sum the message names the record file
            and how to clear it.
    """
    if published:
        if digest != published:
            raise DownloadError(f'{path}: SHA-256 {digest} differs from the published '
                                f'{published} (corrupt or changed file); delete it to '
                                'download it again')
        return
    record = recorded_sum(folder, name)
    if record is not None and digest != record['sha256']:
        sums = sums_path(folder)
        raise DownloadError(
            f'{path}: SHA-256 {digest} differs from the recorded {record["sha256"]} (entry '
            f'"{name}" of {sums}, recorded from {record.get("url") or "?"}; the authors '
            'publish no sum). A corrupt or changed file, or a wrong record: to clear the '
            f'record, delete that entry of {sums}, or download again with '
            f'`python tools/download_weights.py {name} --force` (force=True)')


def fetch(name: str, urls: Sequence[str], folder: str, sha256: Optional[str] = None,
          manual_urls: Sequence[str] = (), force: bool = False,
          log: Callable[[str], None] = log_message) -> Fetched:
    """``<folder>/<name>.pth``, downloaded from the first of ``urls`` that gives a good file
    unless already there (e.g. put by hand), its SHA-256 held to ``sha256`` (published)
    or to the recorded sum (``check_sum``). Nothing is recorded here: the caller records
    the sum once the file loaded (``record_sum``). ``force``: drop the file, its partial
    files and its record first. Call it holding ``file_lock(<folder>/<name>.lock)``.

    Raises:
        DownloadError: no URL gave a good file (the message names every URL and its
            error, the manual mirrors and where a file downloaded by hand is picked up),
            or the file there differs from its sum.
    """
    raw = osp.join(folder, f'{name}.pth')
    if force:
        for path in [raw] + partial_files(raw):
            if osp.isfile(path):
                os.remove(path)
        forget(folder, name, log)
    if osp.isfile(raw):
        digest = sha256_of(raw)
        check_sum(raw, name, folder, digest, sha256)
        return Fetched(raw, digest, raw, False)
    remove_partials(raw, older_than=STALE_PART_S)
    digests, errors = [], []

    def verify(tmp: str, url: str) -> None:
        digests.append(sha256_of(tmp))
        check_sum(f'{raw} downloaded from {url}', name, folder, digests[-1], sha256)

    for url in urls:
        log(f'downloading {url}')
        try:
            download(url, raw, log, verify=lambda tmp, url=url: verify(tmp, url))
            return Fetched(raw, digests[-1], url, True)
        except DownloadError as err:
            errors.append(str(err))
            log(f'  failed: {err}')
    manual = ''.join(f'\n  {u}' for u in manual_urls)
    raise DownloadError(
        '; '.join(errors or ['no URL']) + '. Without network: download it by hand' +
        (f' (official mirror:{manual}\n)' if manual else '') +
        f' and put it at {raw} (it is picked up from there)')
