"""The ``flatten_mm://`` download under concurrency and faults (issue #56).

An official-layout QuadTree-B-b0 ImageNet file (``official_layouts.to_official_pvt_keys``
of a built backbone, plus a head) is served by a local HTTP server on 127.0.0.1 (a
thread, port 0) that supports range requests and injects faults on demand: a connection
cut mid-body, HTTP 500, an HTML page with status 200, a stalled body. Nothing reaches
beyond 127.0.0.1. The expected weights are the built backbone's own (the converter must
invert the official layout), never the converter's output.

Covered: two processes (and two threads) preparing one name at once share one download;
an interrupted transfer resumes; 416 on a complete or stale partial file; errors of one
URL fall through to the next; a sum is recorded only after the file converted, and a
wrong record is named and cleared by ``force``; the hand-placed offline file and
``--from-file`` are held to the record; a converter version change rebuilds the cache;
in a 2-process gloo job a failing preparer makes both ranks raise the same error within
seconds, and two "nodes" with separate homes each prepare their own copy.
"""
import argparse
import dataclasses
import datetime
import hashlib
import http.server
import json
import multiprocessing
import os
import os.path as osp
import re
import socket
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from official_layouts import to_official_pvt_keys

from flatten_mm.checkpoints import download
from flatten_mm.checkpoints.download import DownloadError
from flatten_mm.models import hub, zoo
from flatten_mm.models.catalogue import get_backbone_spec

NAME = 'quadtree-b-pvt-v2-b0'
JOIN_S = 90  # upper bound of a child process's life


@pytest.fixture(scope='module')
def official():
    """``(file bytes, expected backbone state dict)`` of an official-layout B-b0 file."""
    torch.manual_seed(0)
    model = get_backbone_spec(NAME).build()
    sd = to_official_pvt_keys(model.state_dict())
    dim = model.state_dict()['stages.3.norm.weight'].shape[0]
    sd.update({'head.weight': torch.randn(10, dim), 'head.bias': torch.randn(10)})
    path = osp.join(os.environ.get('TMPDIR', '/tmp'), f'official-{os.getpid()}.pth')
    torch.save({'model': sd, 'args': argparse.Namespace(model='quadtree_b0')}, path)
    with open(path, 'rb') as f:
        data = f.read()
    os.remove(path)
    return data, {k: v.clone() for k, v in model.state_dict().items()}


class Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.files``; ``server.faults[path]`` lists one fault per request."""

    def log_message(self, *args):  # (quiet)
        pass

    def do_GET(self):
        server = self.server
        data = server.files.get(self.path)
        rng = self.headers.get('Range')
        with server.mutex:
            server.requests.append((self.path, rng))
            queue = server.faults.get(self.path, [])
            fault = queue.pop(0) if queue else None
        if fault == '500' or data is None:
            self.send_error(500 if data is not None else 404)
            return
        if fault == 'html':
            body = b'<!DOCTYPE html><html><body>Sign in to continue</body></html>'
            self._head(200, len(body), 'text/html')
            self.wfile.write(body)
            return
        if fault == 'html-as-binary':  # an error page without the right content type
            body = b'<html><body>quota exceeded</body></html>'
            self._head(200, len(body))
            self.wfile.write(body)
            return
        start = int(re.match(r'bytes=(\d+)-', rng).group(1)) if rng else 0
        if rng and start >= len(data):
            self.send_response(416)
            self.send_header('Content-Range', f'bytes */{len(data)}')
            self.send_header('Content-Length', '0')
            self.end_headers()
            return
        body = data[start:] if fault != 'ignore-range' else data
        if rng and fault != 'ignore-range':
            self._head(206, len(body), extra=('Content-Range',
                                              f'bytes {start}-{len(data) - 1}/{len(data)}'))
        else:
            self._head(200, len(body))
        if fault in ('cut', 'stall'):
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            if fault == 'stall':  # until the client gave up (bounded)
                server.release.wait(10)
            self.close_connection = True
            return
        for i in range(0, len(body), server.chunk):
            self.wfile.write(body[i:i + server.chunk])
            if server.pace:
                server.pace.wait(server.pace_s)  # (slows the body so writers overlap)

    def _head(self, status, length, ctype='application/octet-stream', extra=None):
        self.send_response(status)
        self.send_header('Content-Type', ctype)
        self.send_header('Content-Length', str(length))
        if extra:
            self.send_header(*extra)
        self.end_headers()


@pytest.fixture
def server(official):
    """A threaded HTTP server on 127.0.0.1 serving the official file at ``/b0.pth``."""
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    srv.daemon_threads = True
    srv.files = {'/b0.pth': official[0], '/mirror.pth': official[0]}
    srv.faults, srv.requests, srv.mutex = {}, [], threading.Lock()
    srv.release, srv.chunk, srv.pace, srv.pace_s = threading.Event(), 1 << 20, None, 0.0
    thread = threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05),
                              daemon=True)
    thread.start()
    srv.url = lambda path='/b0.pth': f'http://127.0.0.1:{srv.server_address[1]}{path}'
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()
    thread.join(10)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.HOME_ENV, str(tmp_path / 'home'))
    monkeypatch.setattr(download, 'TIMEOUT_S', 5.0)
    return tmp_path / 'home'


def serve(monkeypatch, *urls, sha256=None):
    entries = tuple(dataclasses.replace(w, urls=tuple(urls), sha256=sha256)
                    if w.name == NAME else w for w in zoo.OFFICIAL_WEIGHTS)
    monkeypatch.setattr(zoo, 'OFFICIAL_WEIGHTS', entries)


def gets(server, path='/b0.pth'):
    return [r for r in server.requests if r[0] == path]


def assert_expected(path, expected):
    state_dict = torch.load(path, map_location='cpu', weights_only=True)['state_dict']
    assert state_dict.keys() == expected.keys()
    assert all(torch.equal(state_dict[k], v) for k, v in expected.items())


def record_of(home):
    return json.loads((home / 'official' / 'SHA256SUMS.json').read_text())[NAME]['sha256']


def _no_leftovers(home):
    """Nothing but the official file, its lock and the record remains in official/."""
    left = sorted(os.listdir(home / 'official'))
    assert left == sorted(['SHA256SUMS.json', 'SHA256SUMS.json.lock', f'{NAME}.lock',
                           f'{NAME}.pth']), left


# --- one process -----------------------------------------------------------------------


def test_first_download_is_recorded_after_it_converted(server, cache, official, monkeypatch):
    serve(monkeypatch, server.url())
    recorded = []
    monkeypatch.setattr(hub, 'record_sum', lambda *a, **k: recorded.append(
        (osp.isfile(hub.converted_path(zoo.get_official_weights(NAME))), a[2])))
    hub.prepare(NAME)
    # recorded once, and only once the converted file existed
    assert recorded == [(True, hashlib.sha256(official[0]).hexdigest())]


def test_cut_transfer_resumes_and_next_url_is_tried(server, cache, official, monkeypatch):
    data, expected = official
    server.faults['/b0.pth'] = ['cut']
    server.faults['/mirror.pth'] = ['500']
    serve(monkeypatch, server.url(), server.url('/mirror.pth'))
    with pytest.raises(DownloadError) as err:
        hub.prepare(NAME)
    msg = str(err.value)
    assert server.url() in msg and 'run again to resume' in msg
    assert server.url('/mirror.pth') in msg and 'HTTP 500' in msg  # the next URL was tried
    part = cache / 'official' / f'{NAME}.pth.part'
    assert 0 < part.stat().st_size < len(data)
    assert not (cache / 'official' / 'SHA256SUMS.json').exists()
    arrived, logs = part.stat().st_size, []
    path = hub.prepare(NAME, log=logs.append)
    assert gets(server)[-1][1] == f'bytes={arrived}-'  # only the rest was asked for
    assert any('resuming at' in line and f'({arrived} bytes)' in line for line in logs)
    assert (cache / 'official' / f'{NAME}.pth').read_bytes() == data
    assert record_of(cache) == hashlib.sha256(data).hexdigest()
    assert_expected(path, expected)
    _no_leftovers(cache)


@pytest.mark.parametrize('partial', ['complete', 'stale'])
def test_http_416_on_a_complete_or_stale_partial(server, cache, official, monkeypatch,
                                                 partial):
    data, expected = official
    serve(monkeypatch, server.url())
    part = cache / 'official' / f'{NAME}.pth.part'
    part.parent.mkdir(parents=True)
    # complete: all bytes already there (the server answers 416); stale: longer than
    # the file on the server (416 too), e.g. a partial of another version of the file
    part.write_bytes(data if partial == 'complete' else data + b'\0' * 4096)
    assert_expected(hub.prepare(NAME), expected)
    assert (cache / 'official' / f'{NAME}.pth').read_bytes() == data
    ranges = [r[1] for r in gets(server)]
    assert ranges == ([f'bytes={len(data)}-'] if partial == 'complete'
                      else [f'bytes={len(data) + 4096}-', None])
    _no_leftovers(cache)


@pytest.mark.parametrize('fault', ['500', 'cut', 'stall', 'html', 'html-as-binary',
                                   'ignore-range'])
def test_faults_are_download_errors_then_the_next_url(server, cache, official, monkeypatch,
                                                      fault):
    """Every fault of the first URL is a ``DownloadError`` naming it; the second URL then
    gives the file (``ignore-range``: a server answering a range request with the whole
    file, which must not be appended to the partial)."""
    data, expected = official
    monkeypatch.setattr(download, 'TIMEOUT_S', 1.0)
    server.faults['/b0.pth'] = [fault]
    serve(monkeypatch, server.url(), server.url('/mirror.pth'))
    if fault == 'ignore-range':
        part = cache / 'official' / f'{NAME}.pth.part'
        part.parent.mkdir(parents=True)
        part.write_bytes(data[:1000])
    logs = []
    path = hub.prepare(NAME, log=logs.append)
    failed = [line for line in logs if line.startswith('  failed:')]
    if fault == 'ignore-range':
        assert not failed and not gets(server, '/mirror.pth')
    else:
        assert len(failed) == 1 and server.url() in failed[0], logs
        assert len(gets(server, '/mirror.pth')) == 1
    assert (cache / 'official' / f'{NAME}.pth').read_bytes() == data
    assert_expected(path, expected)


def test_html_page_is_never_recorded(server, cache, monkeypatch):
    server.faults['/b0.pth'] = ['html']
    serve(monkeypatch, server.url())
    with pytest.raises(DownloadError, match=r'HTML page'):
        hub.prepare(NAME)
    assert sorted(os.listdir(cache / 'official')) == [f'{NAME}.lock']


def test_unreadable_download_is_removed_not_recorded(server, cache, official, monkeypatch):
    """A file that arrives whole but does not load (no Content-Length to catch it) is
    removed and never recorded; the next run downloads again."""
    data, expected = official
    server.files['/b0.pth'] = data[:len(data) // 2]
    serve(monkeypatch, server.url())
    with pytest.raises(Exception, match='removed: run again'):
        hub.prepare(NAME)
    assert not (cache / 'official' / f'{NAME}.pth').exists()
    assert not (cache / 'official' / 'SHA256SUMS.json').exists()
    server.files['/b0.pth'] = data
    assert_expected(hub.prepare(NAME), expected)
    assert record_of(cache) == hashlib.sha256(data).hexdigest()


def test_wrong_record_is_named_and_cleared_by_force(server, cache, official, monkeypatch):
    data, expected = official
    serve(monkeypatch, server.url())
    sums = cache / 'official' / 'SHA256SUMS.json'
    sums.parent.mkdir(parents=True)
    sums.write_text(json.dumps({NAME: dict(sha256='f' * 64, url='x', bytes=1)}))
    with pytest.raises(DownloadError) as err:
        hub.prepare(NAME)
    msg = str(err.value)
    assert str(sums) in msg and f'"{NAME}"' in msg and '--force' in msg
    assert not (cache / 'official' / f'{NAME}.pth').exists()  # refused: not installed
    # the hand-placed offline file is held to the same record
    (cache / 'official' / f'{NAME}.pth').write_bytes(data)
    with pytest.raises(DownloadError, match='differs from the recorded'):
        hub.prepare(NAME)
    # so is --from-file
    src = cache.parent / 'by_hand.pth'
    src.write_bytes(data)
    with pytest.raises(DownloadError, match='differs from the recorded'):
        hub.prepare(NAME, official_file=str(src))
    # force clears the record (and the file, and a partial), downloads and records again
    (cache / 'official' / f'{NAME}.pth.part').write_bytes(b'stale')
    assert_expected(hub.prepare(NAME, force=True), expected)
    assert record_of(cache) == hashlib.sha256(data).hexdigest()
    assert [r[1] for r in gets(server)] == [None, None]  # the stale partial was not resumed
    _no_leftovers(cache)


def test_from_file_with_force_records_its_sum(cache, official, monkeypatch):
    data, expected = official
    serve(monkeypatch, 'http://127.0.0.1:9/unused.pth')
    src = cache.parent / 'by_hand.pth'
    src.write_bytes(data)
    sums = cache / 'official' / 'SHA256SUMS.json'
    sums.parent.mkdir(parents=True)
    sums.write_text(json.dumps({NAME: dict(sha256='f' * 64, url='x', bytes=1)}))
    assert_expected(hub.prepare(NAME, official_file=str(src), force=True), expected)
    assert record_of(cache) == hashlib.sha256(data).hexdigest()


def test_converter_version_change_rebuilds_the_cache(server, cache, official, monkeypatch):
    data, expected = official
    serve(monkeypatch, server.url())
    path = hub.prepare(NAME)
    meta = torch.load(path, weights_only=True)['meta']
    assert meta['converter'] == 'quadtree-1' == hub.converter_version(
        zoo.get_official_weights(NAME))
    stamp = os.stat(path).st_mtime_ns
    assert hub.prepare(NAME) == path and os.stat(path).st_mtime_ns == stamp  # cache hit
    monkeypatch.setitem(hub.CONVERTER_VERSIONS, 'quadtree', 2)
    logs = []
    assert hub.prepare(NAME, log=logs.append) == path
    assert torch.load(path, weights_only=True)['meta']['converter'] == 'quadtree-2'
    assert any('converting it again with quadtree-2' in line for line in logs)
    assert len(gets(server)) == 1  # rebuilt from the kept official file, no download
    assert_expected(path, expected)


def test_an_older_conversion_is_used_loudly_when_the_official_file_is_out_of_reach(
        server, cache, official, monkeypatch):
    """Offline, with the official file gone: a file converted by an earlier converter (or
    by a release that recorded none) still loads, with a warning naming both versions,
    instead of failing where it worked before."""
    data, expected = official
    serve(monkeypatch, server.url())
    path = hub.prepare(NAME)
    os.remove(cache / 'official' / f'{NAME}.pth')
    serve(monkeypatch, 'http://127.0.0.1:9/offline.pth')
    monkeypatch.setitem(hub.CONVERTER_VERSIONS, 'quadtree', 2)
    with pytest.warns(RuntimeWarning, match='quadtree-1.*today: quadtree-2'):
        assert hub.prepare(NAME) == path
    assert_expected(path, expected)
    # without a converted file the error is the usual one
    os.remove(path)
    with pytest.raises(DownloadError, match='127.0.0.1:9'):
        hub.prepare(NAME)


def test_every_converter_has_a_version():
    from flatten_mm.checkpoints.converters import CONVERTERS
    assert set(CONVERTERS) | {'whole_model', 'classifier'} == set(hub.CONVERTER_VERSIONS)


def test_a_platform_without_file_locks_says_so(tmp_path, monkeypatch):
    """Without fcntl (Windows) the block runs unlocked, and the log says so."""
    monkeypatch.setattr(download, 'fcntl', None)
    logs, ran = [], []
    with download.file_lock(str(tmp_path / 'x.lock'), log=logs.append):
        ran.append(True)
    assert ran and len(logs) == 1 and 'no inter-process lock' in logs[0]


def test_two_threads_share_one_download(server, cache, official, monkeypatch):
    """The reviewer's reproduction: two threads of one process, one name, at once."""
    data, expected = official
    server.chunk, server.pace, server.pace_s = 1 << 18, threading.Event(), 0.02
    serve(monkeypatch, server.url())
    results, start = [], threading.Barrier(2, timeout=30)

    def work():
        start.wait()
        try:
            results.append(hub.prepare(NAME, log=lambda msg: None))
        except Exception as err:  # noqa: BLE001
            results.append(err)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == 2 and all(isinstance(r, str) for r in results), results
    assert len(gets(server)) == 1
    assert (cache / 'official' / f'{NAME}.pth').read_bytes() == data
    assert record_of(cache) == hashlib.sha256(data).hexdigest()
    assert_expected(results[0], expected)


# --- several processes -----------------------------------------------------------------


def _prepare_child(home, out, barrier):
    """Child process: prepare NAME into ``home`` at the same moment as its sibling."""
    os.environ[hub.HOME_ENV] = home
    try:
        barrier.wait(30)
        result = dict(path=hub.prepare(NAME, log=lambda msg: None))
    except Exception as err:  # noqa: BLE001
        result = dict(error=f'{type(err).__name__}: {err}', tb=traceback.format_exc())
    with open(out, 'w') as f:
        json.dump(result, f)


def _run(target, args_per_child):
    """Run children (fork: they inherit the patched catalogue), bounded in time."""
    ctx = multiprocessing.get_context('fork')
    procs = [ctx.Process(target=target, args=args) for args in args_per_child]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_S)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(10)
    assert not alive, 'a child process hung'
    assert [p.exitcode for p in procs] == [0] * len(procs)


def test_two_processes_share_one_download(server, cache, official, monkeypatch, tmp_path):
    data, expected = official
    server.chunk, server.pace, server.pace_s = 1 << 18, threading.Event(), 0.02
    serve(monkeypatch, server.url())
    barrier = multiprocessing.get_context('fork').Barrier(2)
    outs = [str(tmp_path / f'out{i}.json') for i in range(2)]
    _run(_prepare_child, [(str(cache), out, barrier) for out in outs])
    results = [json.load(open(out)) for out in outs]
    assert all('path' in r for r in results), results
    assert len(gets(server)) == 1  # one download; the other process waited and read it
    raw = (cache / 'official' / f'{NAME}.pth').read_bytes()
    assert raw == data and record_of(cache) == hashlib.sha256(data).hexdigest()
    assert_expected(results[0]['path'], expected)
    _no_leftovers(cache)


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _dist_child(rank, port, local_rank, home, out):
    """Rank ``rank`` of a 2-process gloo job loading ``flatten_mm://NAME``."""
    os.environ.update({hub.HOME_ENV: home, 'LOCAL_RANK': str(local_rank)})
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=25))
    start = time.monotonic()
    try:
        ckpt = hub.load_from_flatten_mm(f'flatten_mm://{NAME}', map_location='cpu')
        result = dict(ok=sorted(ckpt['state_dict'])[:3], sha=ckpt['meta']['sha256'])
    except Exception as err:  # noqa: BLE001
        result = dict(type=type(err).__name__, msg=str(err), tb=traceback.format_exc())
    result['elapsed'] = time.monotonic() - start
    with open(out, 'w') as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_distributed_preparer_failure_reaches_every_rank(server, cache, monkeypatch,
                                                         tmp_path):
    """Rank 0 (local rank 0) prepares and fails (HTTP 500); rank 1 waits for it: both raise
    the same DownloadError within seconds, not at the process group's 25 s timeout."""
    server.faults['/b0.pth'] = ['500'] * 4
    serve(monkeypatch, server.url())
    port, outs = _free_port(), [str(tmp_path / f'rank{r}.json') for r in range(2)]
    _run(_dist_child, [(r, port, r, str(cache), outs[r]) for r in range(2)])
    results = [json.load(open(out)) for out in outs]
    assert [r.get('type') for r in results] == ['DownloadError'] * 2, results
    assert results[0]['msg'] == results[1]['msg'] and server.url() in results[0]['msg']
    assert all(r['elapsed'] < 20 for r in results), [r['elapsed'] for r in results]
    assert len(gets(server)) == 1  # only the preparer tried


def test_distributed_nodes_without_shared_storage_each_prepare(server, tmp_path, official,
                                                               monkeypatch):
    """Two "nodes" (local rank 0 each, separate homes): each prepares its own copy."""
    data, _ = official
    monkeypatch.setattr(download, 'TIMEOUT_S', 5.0)
    serve(monkeypatch, server.url())
    homes = [tmp_path / f'node{r}' for r in range(2)]
    port, outs = _free_port(), [str(tmp_path / f'rank{r}.json') for r in range(2)]
    _run(_dist_child, [(r, port, 0, str(homes[r]), outs[r]) for r in range(2)])
    results = [json.load(open(out)) for out in outs]
    digest = hashlib.sha256(data).hexdigest()
    assert [r.get('sha') for r in results] == [digest] * 2, results
    for home in homes:
        assert (home / 'official' / f'{NAME}.pth').read_bytes() == data
        assert (home / f'{NAME}_in1k.pth').is_file()
    assert len(gets(server)) == 2
