"""Convert an official FLatten / SimA / QuadTree checkpoint to flatten_mm keys.

    python tools/convert_checkpoint.py SRC DST [--family F] [--arch A] [--ema]
                                       [--force] [--trust-checkpoint]
    python tools/convert_checkpoint.py SRC DST --config CONFIG [--cfg-options k=v ...]
                                       [--family F] [--force] [--trust-checkpoint]

ImageNet (backbone) checkpoints: the output is ``{'state_dict': ..., 'meta': ...}``,
loadable by ``init_cfg=dict(type='Pretrained', checkpoint=DST)``. With ``--target
classifier`` the whole official classifier converts instead (backbone, the parts after
it, and the head) to the mmpretrain classifier of ``configs/mmpretrain`` (``mim test
mmpretrain CONFIG --checkpoint DST`` evaluates it). With ``--arch`` the
converted keys and shapes are checked against that backbone variant before anything is
written. Dropped keys (classification head, cls-token parts, buffers recomputed at run
time) are listed.

Whole detector / segmentor checkpoints (official mmdet 2.x RetinaNet / Mask R-CNN or
mmseg 0.x Semantic FPN files: ``backbone.`` plus ``neck.`` / ``*_head.`` keys) are
converted whole, automatically, for the mmdet 3.x / mmseg 1.x ``--config`` they are
meant for: the backbone through its family converter, neck and heads with mmdet 3 /
mmseg 1's renames, every key and shape checked against the config's model, class names
moved to ``meta['dataset_meta']``; ``tools/test.py CONFIG DST`` then evaluates it.
``--backbone-only`` keeps only the backbone of such a file instead.

An existing DST is never overwritten without ``--force``.
"""
import argparse
import sys
from collections import Counter

from mmengine.config import DictAction

from flatten_mm.checkpoints.converters import CONVERTERS
from flatten_mm.checkpoints import CheckpointError, load_foreign_checkpoint, save_checkpoint_file
from flatten_mm.checkpoints.convert import (TARGETS, ConversionError, convert_checkpoint,
                                            convert_classifier_checkpoint)
from flatten_mm.models.classification import classifier_state_dict
from flatten_mm.apis.whole_model import (checkpoint_is_whole_model, convert_whole_checkpoint,
                                          summarize_dropped)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('src', help='official checkpoint (.pth)')
    parser.add_argument('dst', help='output path')
    parser.add_argument('--family', choices=sorted(CONVERTERS),
                        help='(backbone) checkpoint family (detected from the keys when omitted)')
    parser.add_argument('--arch', help='target variant (e.g. b0, tiny); enables the key check')
    parser.add_argument('--ema', action='store_true', help='convert the EMA weights')
    parser.add_argument('--target', choices=TARGETS, default='backbone',
                        help='ImageNet checkpoints: the dense backbone (default; for init_cfg) '
                        'or the whole classifier (for the configs/mmpretrain configs)')
    parser.add_argument('--config', help='mmdet 3.x / mmseg 1.x config a whole detector / '
                        'segmentor checkpoint is converted for (keys checked against its model)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='overrides of --config, as in tools/test.py')
    parser.add_argument('--whole-model', action='store_true',
                        help='require a whole-model checkpoint (automatic when SRC has neck / '
                        'head keys)')
    parser.add_argument('--backbone-only', action='store_true',
                        help='of a whole-model checkpoint, keep only the backbone')
    parser.add_argument('--force', action='store_true', help='overwrite DST if it exists')
    parser.add_argument('--trust-checkpoint', action='store_true',
                        help='allow full unpickling of SRC (only for files you trust)')
    args = parser.parse_args(argv)
    if '://' in args.dst:
        name = args.dst.split('://', 1)[1]
        parser.error(f'DST {args.dst!r} is a name, not a file: flatten_mm:// names are read '
                     f'from the weights cache, which `python tools/download_weights.py {name} '
                     f'--from-file {args.src}` fills with an official file you downloaded')
    return args


def convert_file(src, dst, family=None, arch=None, ema=False, config=None, cfg_options=None,
                 whole_model=False, backbone_only=False, force=False, trust=False,
                 target='backbone'):
    """Convert ``src`` into ``dst`` (see the module doc); returns the report lines.

    Raises:
        FileNotFoundError, FileExistsError, CheckpointError, ConversionError, KeyError.
    """
    if whole_model and backbone_only:
        raise ConversionError('--whole-model and --backbone-only exclude each other')
    ckpt = load_foreign_checkpoint(src, trust=trust)
    whole = checkpoint_is_whole_model(ckpt)
    if whole_model and not whole:
        raise ConversionError(f'{src} is not a whole detector / segmentor checkpoint (no '
                              'backbone. keys with neck. / *_head. keys); drop --whole-model '
                              'to convert ImageNet weights')
    if whole and not backbone_only:
        if config is None:
            raise ConversionError(
                f'{src} holds a whole detector / segmentor (backbone, neck and heads). Pass '
                '--config CONFIG (the mmdet 3.x / mmseg 1.x config it is for, e.g. '
                'configs/mmdet/quadtree_pvt_v2/retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco.py) '
                'to convert it whole, or --backbone-only to keep only the backbone')
        if ema or arch:
            raise ConversionError('--ema / --arch apply to backbone checkpoints; a whole model '
                                  'is checked against --config')
        out, dropped, family = convert_whole_checkpoint(ckpt, config, cfg_options, family,
                                                        source=src)
        save_checkpoint_file(out, dst, force=force)
        lines = [f'converted {len(out["state_dict"])} tensors (whole model, {family} backbone, '
                 f'checked against {config}) -> {dst}']
        if dropped:
            lines.append(f'dropped {len(dropped)} keys: {summarize_dropped(dropped)}')
        classes = out['meta'].get('dataset_meta', {}).get('classes')
        if classes:
            lines.append(f'dataset_meta: {len(classes)} classes')
        return lines
    if config is not None and not whole:
        raise ConversionError(f'--config is for whole detector / segmentor checkpoints; {src} '
                              'holds only a backbone (convert it with --arch)')
    if target == 'classifier':
        state_dict, dropped, family = convert_classifier_checkpoint(
            ckpt, family, arch, ema, expected=classifier_state_dict)
    else:
        state_dict, dropped, family = convert_checkpoint(ckpt, family, arch, ema)
    save_checkpoint_file(
        dict(state_dict=state_dict,
             meta=dict(source=src, family=family, arch=arch, ema=ema, target=target)),
        dst, force=force)
    groups = Counter(k.split('.')[0] for k in dropped)
    what = 'the mmpretrain classifier' if target == 'classifier' else 'the dense backbone'
    lines = [f'converted {len(state_dict)} tensors ({family}, {target}) -> {dst}']
    if dropped:
        lines.append(f'dropped {len(dropped)} keys not used by {what}: '
                     + ', '.join(f'{g}.* ({n})' for g, n in sorted(groups.items())))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        lines = convert_file(args.src, args.dst, args.family, args.arch, args.ema, args.config,
                             args.cfg_options, args.whole_model, args.backbone_only, args.force,
                             args.trust_checkpoint, args.target)
    except (FileNotFoundError, FileExistsError, CheckpointError, ConversionError, KeyError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 2
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main())
