"""Catalogue of the official checkpoints of the FLatten, QuadTree and SimA releases.

Every file the three official repositories published, with its download URL (copied from
the repository README or, where the README is wrong, from the official configs; never
guessed), what it converts to, the path our configs load it from and the published
numbers:

* FLatten ImageNet-1k (``LeapLabTHU/FLatten-Transformer`` README @ ``abdb115``):
  FLatten-PVT-T, FLatten-PVTv2-b0, FLatten-Swin-T/S/B/B-384, FLatten-CSwin-T;
* QuadTree ImageNet-1k, QuadTree-B b0..b4, and 15 detection / segmentation models
  (RetinaNet 1x, Mask R-CNN 1x, Semantic FPN 160k; ``Tangshitao/QuadTreeAttention``
  README @ ``549a1ef``);
* SimA: none (the repository links no weights).

Every other backbone variant of ``flatten_mm.models.catalogue`` has **no** official
weights; ``missing_weights_message`` says so when a config points at a checkpoint that
does not exist. SHA-256 sums of the files are not published; ``sha256=None`` means
unknown (``flatten_mm.checkpoints.download`` records the sum of the first file that
loads and converts next to it and checks later files against it).
"""
import difflib
import glob
import os
import os.path as osp
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .catalogue import backbone_catalogue

#: prefix of the checkpoint names of these files (``flatten_mm.models.hub`` resolves them)
SCHEME = 'flatten_mm://'
FLATTEN_SOURCE = 'LeapLabTHU/FLatten-Transformer README (commit abdb115)'
QUADTREE_SOURCE = 'Tangshitao/QuadTreeAttention README (commit 549a1ef)'
_QT = 'https://github.com/Tangshitao/QuadTreeAttention/releases/download'
_TSINGHUA = 'https://cloud.tsinghua.edu.cn/f/{}/?dl=1'


@dataclass(frozen=True)
class OfficialWeights:
    """One official checkpoint file.

    Attributes:
        name: download name: the backbone's catalogue name for ImageNet weights
            (``quadtree-b-pvt-v2-b0``), the config name for whole models
            (``retinanet_quadtree-b-pvt-v2-b0_fpn_1x_coco``).
        kind: ``'imagenet'``, ``'detection'`` or ``'segmentation'``.
        urls: direct download URLs, tried in order.
        family: converter family (``flatten_mm.checkpoints.converters.CONVERTERS``).
        arch: backbone arch of the family.
        target: the converted file as ``tools/download_weights.py --dir checkpoints``
            writes it (``checkpoints/<name>_in1k.pth`` for ImageNet weights,
            ``checkpoints/<name>.pth`` for whole models); the ``flatten_mm://`` cache uses
            the same file name. Configs load it as ``uri``.
        config: for whole models, the config that evaluates the converted file.
        metrics: published numbers, ``(('ImageNet top-1', 72.0), ...)``.
        sha256: SHA-256 of the official file, ``None`` when unknown.
        source: where the URL is documented.
        manual_urls: other official links that need a browser (Google Drive).
        note: anything a user must know about the file.
    """

    name: str
    kind: str
    urls: Tuple[str, ...]
    family: str
    arch: str
    target: str
    config: Optional[str] = None
    metrics: Tuple[Tuple[str, float], ...] = ()
    sha256: Optional[str] = None
    source: str = ''
    manual_urls: Tuple[str, ...] = ()
    note: str = ''

    @property
    def is_whole_model(self) -> bool:
        return self.kind != 'imagenet'

    @property
    def uri(self) -> str:
        """The name configs load it by: ``flatten_mm://<name>`` (``flatten_mm.models.hub``)."""
        return f'{SCHEME}{self.name}'


def _flatten(name, arch, family, key, top1, note=''):
    return OfficialWeights(name, 'imagenet', (_TSINGHUA.format(key), ), family, arch,
                           f'checkpoints/{name}_in1k.pth',
                           metrics=(('ImageNet top-1', top1), ), source=FLATTEN_SOURCE,
                           note=note)


_QT_CLS_DRIVE = ('13hBEBXXmTc3NI0WOqNE89Yd5GZf7wCJN', '1NB1Yu0R7QQPmo2pgQGxDbcElRx2Nc5xj',
                 '1MTexxhDpRE9idpxwswZOGsqAlt9q2L2h', '1Rx_JhGDKXKfOakY8n5HQgxuAyrjBA7jA',
                 '1AiPWGJYZdqz09PZER3JpZuMJYBR___MG')
_QT_RETINA_DRIVE = ('1EkzDVRqz6L_2ZzVkAj-byQIB4CCr3gNp', '1xqZoptlHj1nWEVvUBqSOiIlEiy1Y5gws',
                    '1n6Zyvgdf4slhKMsG4CpckGDCNbB_48oi', '1SVIWM9JFfW9a1jIjB8gdkpOaccSgKUGc',
                    '1nMUhg2N59FWqbIAbZcLwSe07L1OjPHiY')
_QT_MASK_DRIVE = ('1f_NGHygQC8Y-EVLeHE5T7UjZU5n6WJJs', '1916HZGGzdfHVL2osTUHOlKKH-88NkbhE',
                  '1KhKVbslAUw6tbSHDxb6vZXLGsY__gcQ_', '1_STW0pE1Gt-JrLdd-G1-skheb7XTHD3y',
                  '1jebBbBhtCHw3rmHM32Kf4Z8sDlCpaGr4')
_QT_SEG_DRIVE = ('1qTman3_vAnEJs8g_5CeOr8wtcCK2gvJM', '1SQKe9FmpmR__Fq0bNYEvO0T_5B--zs7b',
                 '1pyyJWvXPRxApNiCRaR4c73nVQf-yCKQ2', '1odZkr2c0Oa8jJxr3TUsgKrHaLwuMInfp',
                 '16ZBvzR51XUk3cpnJ6D1BgIvFS9oSzzh8')
_QT_TOP1 = (72.0, 80.0, 82.7, 83.8, 84.0)
_QT_RETINA_AP = (38.4, 42.6, 46.2, 47.3, 47.9)
_QT_MASK_AP = ((38.8, 36.5), (43.5, 40.1), (46.7, 42.4), (48.3, 43.3), (48.6, 43.6))
_QT_SEG_MIOU = (39.9, 44.7, 48.7, 50.0, 50.6)


def _drive(file_id: str) -> str:
    return f'https://drive.google.com/file/d/{file_id}/view?usp=sharing'


def _quadtree() -> List[OfficialWeights]:
    out = []
    for n in range(5):
        bb = f'quadtree-b-pvt-v2-b{n}'
        if n == 1:
            # the README's GitHub link of B-b1 points at b2.pth (a copy-paste slip); the
            # official detection configs load B-b1's ImageNet weights from this asset
            urls = (f'{_QT}/QuadTreeAttention/b1.pth', )
            note = ('the README\'s GitHub link for B-b1 points at QuadTreeAttention_cls/b2.pth '
                    '(the B-b2 file); the URL used here is the one of the official detection '
                    'configs (mask_rcnn_quadtree_b1_fpn_1x_coco.py); the Google Drive link is '
                    'the README\'s')
        else:
            urls = (f'{_QT}/QuadTreeAttention_cls/b{n}.pth', )
            note = ''
        out.append(OfficialWeights(
            bb, 'imagenet', urls, 'quadtree', f'b{n}', f'checkpoints/{bb}_in1k.pth',
            metrics=(('ImageNet top-1', _QT_TOP1[n]), ), source=QUADTREE_SOURCE,
            manual_urls=(_drive(_QT_CLS_DRIVE[n]), ), note=note))
    # the 15 whole models: (kind, config name template, release folder and file, config
    # folder, published metrics per variant, Google Drive ids)
    whole_models = (
        ('detection', 'retinanet_{}_fpn_1x_coco', 'QuadTreeAttention_detection/b{}.pth',
         'mmdet', [(('COCO box AP', ap), ) for ap in _QT_RETINA_AP], _QT_RETINA_DRIVE),
        ('detection', 'mask-rcnn_{}_fpn_1x_coco', 'QuadTreeAttention_maskrcnn/b{}_1x.pth',
         'mmdet', [(('COCO box AP', box), ('COCO mask AP', mask)) for box, mask in _QT_MASK_AP],
         _QT_MASK_DRIVE),
        ('segmentation', 'fpn_{}_8xb2-160k_ade20k-512x512', 'QuadTreeAttention_seg/b{}.pth',
         'mmseg', [(('ADE20K mIoU', miou), ) for miou in _QT_SEG_MIOU], _QT_SEG_DRIVE),
    )
    for kind, name_tpl, file_tpl, toolbox, metrics, drive in whole_models:
        for n in range(5):
            name = name_tpl.format(f'quadtree-b-pvt-v2-b{n}')
            out.append(OfficialWeights(
                name, kind, (f'{_QT}/{file_tpl.format(n)}', ), 'quadtree', f'b{n}',
                f'checkpoints/{name}.pth', config=f'configs/{toolbox}/quadtree_pvt_v2/{name}.py',
                metrics=metrics[n], source=QUADTREE_SOURCE, manual_urls=(_drive(drive[n]), )))
    return out


OFFICIAL_WEIGHTS: Tuple[OfficialWeights, ...] = tuple([
    _flatten('flatten-pvt-t', 't', 'flatten_pvt', '3ab1d773f19d45648690', 77.8),
    _flatten('flatten-pvt-v2-b0', 'b0', 'flatten_pvt_v2', '5d1f01532b104da28e7b', 71.1),
    _flatten('flatten-swin-t', 't', 'flatten_swin', 'e1518e76703e4e57a7f2', 82.1),
    _flatten('flatten-swin-s', 's', 'flatten_swin', '94188e52af354bf4a88b', 83.5),
    _flatten('flatten-swin-b', 'b', 'flatten_swin', '7a9e5186bad04e7fb3a9', 83.8),
    _flatten('flatten-swin-b-384', 'b-384', 'flatten_swin', '0d0330cf2e5249f1abb6', 85.0),
    _flatten('flatten-cswin-t', 't', 'flatten_cswin', '48ba765ba8b0451d9d5a', 83.1,
             note='trained with EMA (main_ema.py); which weights the released file holds '
             'is not documented: the plain model weights are converted (pass --ema to '
             'tools/convert_checkpoint.py for the EMA copy if the file has one)'),
] + _quadtree())


def official_weights() -> Dict[str, OfficialWeights]:
    """Every official checkpoint by name (ImageNet first, then detection, segmentation)."""
    return {w.name: w for w in OFFICIAL_WEIGHTS}


def get_official_weights(name: str) -> OfficialWeights:
    """The entry called ``name``.

    Raises:
        ValueError: ``name`` has no official checkpoint; the message says whether it is a
            backbone variant without released weights and lists close names.
    """
    zoo = official_weights()
    key = name.strip().lower()
    if key in zoo:
        return zoo[key]
    if key in backbone_catalogue():
        raise ValueError(unreleased_message(key))
    close = difflib.get_close_matches(key, list(zoo), n=4, cutoff=0.5)
    hint = f' Did you mean: {", ".join(close)}?' if close else ''
    raise ValueError(f'no official checkpoint is called {name!r}.{hint} '
                     '`python tools/download_weights.py --list` prints all of them.')


_DISPLAY_PREFIXES = (
    ('flatten-pvt-v2-', 'FLatten-PVTv2-'), ('flatten-pvt-', 'FLatten-PVT-'),
    ('flatten-swin-', 'FLatten-Swin-'), ('flatten-cswin-', 'FLatten-CSwin-'),
    ('quadtree-b-pvt-v2-', 'QuadTree-B-'), ('quadtree-a-pvt-v2-', 'QuadTree-A-'),
    ('sima-xcit-', 'SimA-XCiT-'), ('pvt-v2-', 'PVTv2-'))


def display_name(name: str) -> str:
    """Paper-style name of a catalogue name: ``flatten-pvt-v2-b1`` -> ``FLatten-PVTv2-b1``."""
    for prefix, shown in _DISPLAY_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return shown + (rest.upper() if 'swin' in prefix or prefix == 'flatten-pvt-'
                            else rest)
    return name


def imagenet_names() -> List[str]:
    """Catalogue names of the backbone variants with official ImageNet weights."""
    return [w.name for w in OFFICIAL_WEIGHTS if w.kind == 'imagenet']


def identify_backbone(module) -> Optional[str]:
    """Catalogue name of a built backbone (class + variant settings), or ``None`` for a
    custom arch / unknown class."""
    settings = getattr(module, 'arch_settings', None)
    cls = type(module)
    if settings is None:
        return None
    for spec in backbone_catalogue().values():
        if spec.cls_name != cls.__name__:
            continue
        zoo = getattr(cls, 'arch_zoo', {})
        if zoo.get(spec.arch) != settings:
            continue
        patch = dict(spec.kwargs).get('patch_size')
        if patch is not None and getattr(module, 'patch_size', None) != patch:
            continue
        return spec.name
    return None


def _name_from_path(path: str) -> Optional[str]:
    """``checkpoints/flatten-pvt-v2-b1_in1k.pth`` -> ``flatten-pvt-v2-b1`` when that is a
    catalogue name (the naming every config under ``configs/`` uses)."""
    m = re.fullmatch(r'(.+?)_in1k(?:[._-].*)?\.pth', osp.basename(str(path)))
    if m and m.group(1).lower() in backbone_catalogue():
        return m.group(1).lower()
    return None


def _config_roots() -> List[str]:
    """Where the configs are: the source checkout next to the package, or the ``.mim``
    copy of an installed package."""
    package = osp.dirname(osp.dirname(osp.abspath(__file__)))
    return [osp.join(osp.dirname(package), 'configs'), osp.join(package, '.mim', 'configs')]


def pretraining_config(name: str) -> str:
    """The ImageNet-1k pretraining config of the catalogue variant ``name``
    (``configs/mmpretrain/<family>/<name>_<gpus>xb<batch>_in1k[-<size>px].py``), relative
    to the repository root. Raises ``ValueError`` for a name outside the catalogue."""
    spec = backbone_catalogue().get(name)
    if spec is None:
        raise ValueError(f'{name!r} is not a catalogue backbone name')
    folder = osp.join('mmpretrain', spec.family)
    for root in _config_roots():
        found = sorted(glob.glob(osp.join(root, folder, f'{name}_*in1k*.py')))
        if found:
            return 'configs/' + osp.relpath(found[0], root).replace(os.sep, '/')
    return f'configs/{folder}/{name}_8xb128_in1k.py'.replace(os.sep, '/')


def unreleased_message(name: str, dst: Optional[str] = None) -> str:
    """The variant ``name`` has no official ImageNet weights: say so and the ways on --
    pretrain it with its mmpretrain config, convert a training of the official code, or
    train from scratch (``dst``: where the config expects the file,
    ``checkpoints/<name>_in1k.pth`` by default)."""
    dst = dst or f'checkpoints/{name}_in1k.pth'
    what = (f'no official ImageNet weights were released for {display_name(name)} ({name})'
            if not name.startswith('pvt-v2-') else
            f'no official weights of the FLatten / QuadTree / SimA releases exist for '
            f'{display_name(name)} ({name}, the plain / hybrid PVTv2 built here)')
    return (f'{what}; the official repositories publish ImageNet weights only for '
            f'{", ".join(display_name(n) for n in imagenet_names())}. Three ways on: '
            f'pretrain it on ImageNet with {pretraining_config(name)} (mmpretrain; see '
            'docs/user_guides/pretrain.md) and put the trained checkpoint at '
            f'{dst} (or point init_cfg.checkpoint at it); convert a training of the official '
            f'code with `python tools/convert_checkpoint.py SRC {dst}`; or train from scratch '
            'with `--cfg-options model.backbone.init_cfg=None`.')


def missing_weights_message(path: str, module=None) -> str:
    """Why the pretrained checkpoint ``path`` is missing and what to do.

    The variant is read from the file name (``<name>_in1k.pth``, the configs' naming) or,
    failing that, from ``module`` (the backbone being initialised). Released weights get
    the download command; variants without released weights get ``unreleased_message``.
    """
    name = _name_from_path(path)
    if name is None and module is not None:
        name = identify_backbone(module)
    head = f'pretrained checkpoint {path} not found'
    if name is None:
        return (f'{head}. Point init_cfg at a converted checkpoint (tools/convert_checkpoint.py), '
                'or train from scratch with `--cfg-options model.backbone.init_cfg=None`.')
    zoo = official_weights()
    if name in zoo:
        return (f"{head}. Official ImageNet weights of {display_name(name)} exist: "
                f"checkpoint='{zoo[name].uri}' downloads, converts and caches them on first "
                'use (an official file downloaded by hand can also be given as it is: it is '
                'converted in memory).')
    return f'{head}: {unreleased_message(name, str(path))}'


def config_checkpoint(path: str) -> Optional[str]:
    """The backbone checkpoint a config file names, read from its text: its own
    ``checkpoint='...'`` (none after ``backbone=dict(init_cfg=None)``), else the one its
    local ``_base_`` files name (the configs under ``configs/`` inherit e.g. a 3x recipe
    from the 1x config)."""
    with open(path, encoding='utf-8') as f:
        text = f.read()
    own = re.findall(r"checkpoint='([^']+)'", text)
    if own:
        return own[-1]
    if re.search(r'backbone=dict\([^)]*init_cfg=None', text):  # (trains from scratch)
        return None
    base = re.search(r'^_base_\s*=\s*(\[[^\]]*\]|\'[^\']*\')', text, re.M)
    for rel in re.findall(r"'([^']+)'", base.group(1)) if base else []:
        local = osp.normpath(osp.join(osp.dirname(path), rel))
        if '::' not in rel and osp.isfile(local):
            found = config_checkpoint(local)
            if found:
                return found
    return None


def configs_using(weights: OfficialWeights, root: str = '.') -> List[str]:
    """Configs under ``root/configs`` whose backbone loads ``weights`` (its ``uri``, named
    in the config or inherited from its ``_base_``), plus the whole-model entry's own
    config."""
    found = []
    cfg_dir = osp.join(root, 'configs')
    if weights.config:
        found.append(weights.config)
    elif osp.isdir(cfg_dir):
        for dirpath, _, files in os.walk(cfg_dir):
            for fname in files:
                path = osp.join(dirpath, fname)
                if (fname.endswith('.py') and '_base_' not in path.split(os.sep)
                        and config_checkpoint(path) == weights.uri):
                    found.append(osp.relpath(path, root))
    return sorted(found)
