"""Download an official checkpoint, convert it and put it where the configs look for it.

    python tools/download_weights.py --list
    python tools/download_weights.py NAME [NAME ...] [--dir checkpoints] [--force]
    python tools/download_weights.py NAME --from-file PATH [--dir checkpoints]

NAME is a backbone name of ``tools/swap_backbone.py --list`` with official ImageNet
weights (``quadtree-b-pvt-v2-b0``, ``flatten-swin-t``, ...) or one of the 15 QuadTree
detection / segmentation models, named after the config that evaluates them
(``mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco``). ``--list`` prints every official file
with its published ImageNet top-1 / COCO AP / ADE20K mIoU (``flatten_mm.models.zoo``).

The official file is downloaded (progress on stderr; an interrupted download resumes from
``<dir>/official/<NAME>.pth.part``) to ``<dir>/official/<NAME>.pth``, its SHA-256 is
checked against the one published in ``flatten_mm.models.zoo`` where known and otherwise against
the one recorded at its first download (``<dir>/official/SHA256SUMS.json``), then it is
converted: ImageNet weights to ``<dir>/<NAME>_in1k.pth`` (the path of ``init_cfg`` in the
configs), whole models to ``<dir>/<NAME>.pth`` (checked against their config; evaluate
with ``tools/test.py CONFIG <dir>/<NAME>.pth``). ``--from-file`` converts a file you
downloaded yourself (e.g. from the Google Drive mirrors) the same way.
"""
import argparse
import hashlib
import json
import os
import os.path as osp
import sys
import time
import urllib.request
from typing import Optional

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from flatten_mm.models import zoo  # noqa: E402
from flatten_mm.checkpoints import (CheckpointError, load_foreign_checkpoint,  # noqa: E402
                              save_checkpoint_file)
from flatten_mm.checkpoints.convert import ConversionError, convert_checkpoint  # noqa: E402

CHUNK = 1 << 20


class DownloadError(RuntimeError):
    """A download failed or its SHA-256 does not match."""


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


def download(url: str, path: str) -> None:
    """Download ``url`` to ``path`` through ``path + '.part'``, resuming a partial file
    (HTTP range request; ``file://`` URLs skip the bytes already there).

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
            print(f'  resuming at {offset / 2**20:.1f} MiB ({offset} bytes)', file=sys.stderr)
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


def fetch_official(weights: zoo.OfficialWeights, folder: str, force: bool = False) -> str:
    """The official file of ``weights`` under ``folder/official``, downloaded unless
    already there, with its SHA-256 checked (published or recorded) or recorded."""
    raw = osp.join(folder, 'official', f'{weights.name}.pth')
    sums_path = osp.join(folder, 'official', 'SHA256SUMS.json')
    sums = _load_sums(sums_path)
    if force and osp.isfile(raw):
        os.remove(raw)
    if not osp.isfile(raw):
        errors = []
        for url in weights.urls:
            print(f'downloading {url}', file=sys.stderr)
            try:
                download(url, raw)
                break
            except DownloadError as err:
                errors.append(str(err))
        else:
            manual = ''.join(f'\n  {u}' for u in weights.manual_urls)
            raise DownloadError('; '.join(errors) + '. Download it by hand' +
                                (f' (official mirror:{manual}\n)' if manual else '') +
                                ' and convert it with --from-file PATH')
    digest = sha256_of(raw)
    expected = weights.sha256 or sums.get(weights.name, {}).get('sha256')
    if expected and digest != expected:
        where = 'published' if weights.sha256 else f'recorded in {sums_path} at the first download'
        raise DownloadError(f'{raw}: SHA-256 {digest} differs from the {where} {expected} '
                            '(corrupt or changed file); delete it (or pass --force) to download '
                            'it again')
    if weights.name not in sums:
        sums[weights.name] = dict(sha256=digest, url=weights.urls[0], bytes=osp.getsize(raw))
        with open(sums_path, 'w') as f:
            json.dump(sums, f, indent=1, sort_keys=True)
        if not weights.sha256:
            print(f'SHA-256 {digest} (no published sum; recorded in {sums_path} and checked on '
                  'later runs)', file=sys.stderr)
    else:
        print(f'SHA-256 {digest} ok', file=sys.stderr)
    return raw


def convert_official(weights: zoo.OfficialWeights, raw: str, dst: str, force: bool = False,
                     trust: bool = False, source: str = '') -> str:
    """Convert the official file ``raw`` of ``weights`` to ``dst``; returns a report line."""
    ckpt = load_foreign_checkpoint(raw, trust=trust)
    digest = sha256_of(raw)
    if weights.is_whole_model:
        from flatten_mm.apis.whole_model import convert_whole_checkpoint
        out, _, _ = convert_whole_checkpoint(ckpt, osp.join(REPO_ROOT, weights.config),
                                             family=weights.family, source=source or raw)
        out['meta'].update(name=weights.name, sha256=digest)
        save_checkpoint_file(out, dst, force=force)
        return (f'wrote {dst} ({weights.name}, {len(out["state_dict"])} tensors); evaluate it: '
                f'python tools/test.py {weights.config} {dst}')
    state_dict, _, family = convert_checkpoint(ckpt, weights.family, weights.arch)
    save_checkpoint_file(
        dict(state_dict=state_dict,
             meta=dict(source=source or raw, family=family, arch=weights.arch,
                       name=weights.name, sha256=digest)),
        dst, force=force)
    return f'wrote {dst} ({weights.name}, {len(state_dict)} tensors)'


def format_list(root: str = REPO_ROOT) -> str:
    rows = [('name', 'kind', 'published', 'converts to', 'configs', 'sha256')]
    for w in zoo.OFFICIAL_WEIGHTS:
        numbers = ', '.join(f'{k} {v}' for k, v in w.metrics)
        n_cfg = len(zoo.configs_using(w, root))
        rows.append((w.name, w.kind, numbers, w.target, str(n_cfg),
                     'published' if w.sha256 else 'unknown'))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ['  '.join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    released = set(zoo.imagenet_names())
    from flatten_mm.models.catalogue import backbone_catalogue
    none = [n for n in backbone_catalogue() if n not in released]
    lines += ['', f'{len(zoo.OFFICIAL_WEIGHTS)} official files (FLatten and QuadTree; SimA '
              'released none). No official weights exist for: ' + ', '.join(none) + '.',
              'Sources: ' + zoo.FLATTEN_SOURCE + '; ' + zoo.QUADTREE_SOURCE + '.',
              'sha256 "unknown": not published; the first download records it.']
    return '\n'.join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('names', nargs='*', metavar='NAME', help='official checkpoint name(s)')
    parser.add_argument('--list', action='store_true', help='print every official checkpoint')
    parser.add_argument('--dir', default='checkpoints', help='output folder (default: checkpoints)')
    parser.add_argument('--from-file', metavar='PATH',
                        help='convert this already downloaded official file (one NAME)')
    parser.add_argument('--force', action='store_true',
                        help='download again and overwrite the converted file')
    parser.add_argument('--trust-checkpoint', action='store_true',
                        help='allow full unpickling of the official file')
    args = parser.parse_args(argv)
    if args.list:
        print(format_list())
        return 0
    if not args.names:
        parser.error('give a NAME (see --list)')
    if args.from_file and len(args.names) != 1:
        parser.error('--from-file converts one file: give exactly one NAME')
    status = 0
    for name in args.names:
        try:
            weights = zoo.get_official_weights(name)
            dst = osp.join(args.dir, osp.basename(weights.target))
            if osp.exists(dst) and not args.force:
                print(f'{dst} exists (pass --force to redo it)')
                continue
            if args.from_file:
                if not osp.isfile(args.from_file):
                    raise FileNotFoundError(f'--from-file {args.from_file} not found')
                raw, source = args.from_file, args.from_file
            else:
                raw = fetch_official(weights, args.dir, force=args.force)
                source = weights.urls[0]
            print(convert_official(weights, raw, dst, force=args.force,
                                   trust=args.trust_checkpoint, source=source))
        except (ValueError, DownloadError, FileNotFoundError, FileExistsError, CheckpointError,
                ConversionError, KeyError) as err:
            print(f'error: {name}: {err}', file=sys.stderr)
            status = 2
    return status


if __name__ == '__main__':
    sys.exit(main())
