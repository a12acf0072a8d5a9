"""Convert an official FLatten / SimA / QuadTree checkpoint to flatten_mm keys.

    python tools/convert_checkpoint.py SRC DST [--family F] [--arch A] [--ema]
                                       [--force] [--trust-checkpoint]

The output is ``{'state_dict': ..., 'meta': ...}``, loadable by
``init_cfg=dict(type='Pretrained', checkpoint=DST)``. With ``--arch`` the converted
keys and shapes are checked against that backbone variant before anything is written.
Dropped keys (classification head, cls-token parts, buffers recomputed at run time)
are listed. An existing DST is never overwritten without ``--force``.
"""
import argparse
import sys
from collections import Counter

from flatten_mm.converters import CONVERTERS
from flatten_mm.utils import CheckpointError, load_foreign_checkpoint, save_checkpoint_file
from flatten_mm.utils.convert import ConversionError, convert_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('src', help='official checkpoint (.pth)')
    parser.add_argument('dst', help='output path')
    parser.add_argument('--family', choices=sorted(CONVERTERS),
                        help='checkpoint family (detected from the keys when omitted)')
    parser.add_argument('--arch', help='target variant (e.g. b0, tiny); enables the key check')
    parser.add_argument('--ema', action='store_true', help='convert the EMA weights')
    parser.add_argument('--force', action='store_true', help='overwrite DST if it exists')
    parser.add_argument('--trust-checkpoint', action='store_true',
                        help='allow full unpickling of SRC (only for files you trust)')
    args = parser.parse_args(argv)
    try:
        ckpt = load_foreign_checkpoint(args.src, trust=args.trust_checkpoint)
        state_dict, dropped, family = convert_checkpoint(ckpt, args.family, args.arch, args.ema)
        save_checkpoint_file(
            dict(state_dict=state_dict,
                 meta=dict(source=args.src, family=family, arch=args.arch, ema=args.ema)),
            args.dst, force=args.force)
    except (FileNotFoundError, FileExistsError, CheckpointError, ConversionError, KeyError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 2
    groups = Counter(k.split('.')[0] for k in dropped)
    print(f'converted {len(state_dict)} tensors ({family}) -> {args.dst}')
    if dropped:
        print(f'dropped {len(dropped)} keys not used by the dense backbone: '
              + ', '.join(f'{g}.* ({n})' for g, n in sorted(groups.items())))
    return 0


if __name__ == '__main__':
    sys.exit(main())
