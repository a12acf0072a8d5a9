"""Download official checkpoints and convert them (prefetch for ``flatten_mm://``).

    python tools/download_weights.py --list
    python tools/download_weights.py NAME [NAME ...] [--dir DIR] [--force]
    python tools/download_weights.py NAME --from-file PATH [--dir DIR]
    python tools/download_weights.py NAME --target classifier [--dir DIR]

NAME is a backbone with official ImageNet weights (``flatten-swin-t``,
``quadtree-b-pvt-v2-b0``, ...) or one of the 15 QuadTree detection / segmentation models,
named after the config that evaluates them (``mask-rcnn_quadtree-b-pvt-v2-b0_fpn_1x_coco``).
``--list`` prints every official file with its published numbers.

Configs load these files as ``flatten_mm://NAME``, which downloads and converts on first
use (``flatten_mm.models.hub``); this tool does the same ahead of time, into the same
cache (``$FLATTEN_MM_HOME``, by default ``flatten_mm`` in torch's hub directory) or, with
``--dir DIR``, into ``DIR`` (``DIR/NAME_in1k.pth``, whole models ``DIR/NAME.pth``, the
official file under ``DIR/official/``). The download resumes when interrupted, and
concurrent runs (or training jobs) wait for one download under a file lock. The SHA-256
of the official file is checked against the one published, else the one recorded once
a first file loaded and converted (``official/SHA256SUMS.json``); ``--force`` downloads
again and clears that record. ``--from-file`` converts a file you downloaded yourself
(e.g. from the Google Drive mirrors), checked against the same sums; putting it at
``official/NAME.pth`` of the cache does the same for ``flatten_mm://``. A converted file
made by an older converter version is converted again.
``--target classifier`` converts ImageNet weights to the whole mmpretrain classifier
(``NAME_in1k-classifier.pth``: backbone, the parts after it and the head), which the
``configs/mmpretrain`` config of the variant evaluates.
"""
import argparse
import os.path as osp
import sys

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from flatten_mm.checkpoints import CheckpointError  # noqa: E402
from flatten_mm.checkpoints.convert import ConversionError  # noqa: E402
from flatten_mm.checkpoints.download import DownloadError  # noqa: E402
from flatten_mm.models import hub, zoo  # noqa: E402


def check_whole_model(weights: zoo.OfficialWeights, path: str) -> None:
    """The converted whole model has exactly the keys and shapes of its config's model."""
    import torch
    from flatten_mm.apis.whole_model import build_config_model
    from flatten_mm.checkpoints.converters import key_mismatch_report
    config = osp.join(REPO_ROOT, weights.config)
    if not osp.isfile(config):  # (an installed package without the configs: nothing to check)
        return
    state_dict = torch.load(path, map_location='cpu', weights_only=True)['state_dict']
    problem = key_mismatch_report(state_dict, build_config_model(config).state_dict())
    if problem:
        raise ConversionError(f'{path} does not match the model of {weights.config}:\n{problem}')


def format_list() -> str:
    rows = [('name', 'kind', 'published', 'load as', 'configs', 'sha256')]
    for w in zoo.OFFICIAL_WEIGHTS:
        numbers = ', '.join(f'{k} {v}' for k, v in w.metrics)
        n_cfg = len(zoo.configs_using(w, REPO_ROOT))
        rows.append((w.name, w.kind, numbers, w.uri, str(n_cfg),
                     'published' if w.sha256 else 'unknown'))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ['  '.join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    released = set(zoo.imagenet_names())
    from flatten_mm.models.catalogue import backbone_catalogue
    none = [n for n in backbone_catalogue() if n not in released]
    lines += ['', f'{len(zoo.OFFICIAL_WEIGHTS)} official files (FLatten and QuadTree; SimA '
              'released none). No official weights exist for: ' + ', '.join(none) + '.',
              'Sources: ' + zoo.FLATTEN_SOURCE + '; ' + zoo.QUADTREE_SOURCE + '.',
              'sha256 "unknown": not published; recorded once a first download converts.',
              f'Cache of flatten_mm://: {hub.home()} (set {hub.HOME_ENV} to move it).']
    return '\n'.join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('names', nargs='*', metavar='NAME', help='official checkpoint name(s)')
    parser.add_argument('--list', action='store_true', help='print every official checkpoint')
    parser.add_argument('--dir', default=None,
                        help='output folder (default: the flatten_mm:// cache)')
    parser.add_argument('--from-file', metavar='PATH',
                        help='convert this already downloaded official file (one NAME)')
    parser.add_argument('--force', action='store_true',
                        help='download and convert again, overwriting the converted file and '
                        'clearing the recorded SHA-256')
    parser.add_argument('--trust-checkpoint', action='store_true',
                        help='allow full unpickling of the official file')
    parser.add_argument('--target', choices=('backbone', 'classifier'), default='backbone',
                        help='ImageNet weights as the dense backbone (default) or as the '
                        'whole classifier of configs/mmpretrain')
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
            dst = hub.converted_path(weights, args.dir, args.target)
            made_by = hub.cached_converter(dst)
            current = made_by == hub.converter_version(weights, args.target)
            if osp.exists(dst) and not args.force and (current or made_by is None):
                # (a file without a converter record is not ours to replace unasked)
                print(f'{dst} exists (pass --force to redo it)')
                continue
            if args.from_file and not osp.isfile(args.from_file):
                raise FileNotFoundError(f'--from-file {args.from_file} not found')
            dst = hub.prepare(name, args.dir, force=args.force, trust=args.trust_checkpoint,
                              official_file=args.from_file,
                              log=lambda msg: print(msg, file=sys.stderr), target=args.target)
            if weights.is_whole_model:
                check_whole_model(weights, dst)
                print(f'wrote {dst}; evaluate it: python tools/test.py {weights.config} '
                      + (weights.uri if args.dir is None else dst))
            elif args.target == 'classifier':
                print(f'wrote {dst}; evaluate it: mim test mmpretrain '
                      f'{zoo.pretraining_config(weights.name)} --checkpoint {dst}')
            else:
                print(f'wrote {dst}; configs load it as {weights.uri}'
                      if args.dir is None else f'wrote {dst}')
        except DownloadError as err:
            print(f'error: {name}: {err} (or convert it with --from-file PATH)', file=sys.stderr)
            status = 2
        except (ValueError, FileNotFoundError, FileExistsError, CheckpointError,
                ConversionError, KeyError) as err:
            print(f'error: {name}: {err}', file=sys.stderr)
            status = 2
    return status


if __name__ == '__main__':
    sys.exit(main())
