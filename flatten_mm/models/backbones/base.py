"""Shared pieces of the dense backbones: arch tables, argument checks, per-stage attention
configs, freezing, and the plumbing of the doubling-width four-stage backbones."""
import copy
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from mmengine.model import BaseModule
from mmengine.model.weight_init import (PretrainedInit, _initialize_override, initialize,
                                        trunc_normal_)

from ..ops import dispatch
from ..pretrained import load_pretrained


def resolve_arch(arch: Union[str, dict], arch_zoo: Dict[str, dict],
                 required_keys: Iterable[str], owner: str) -> dict:
    """Pick a variant from ``arch_zoo`` (aliases allowed) or validate a custom dict.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or a custom dict
            whose keys differ from ``required_keys``.
    """
    required = set(required_keys)
    if isinstance(arch, str):
        key = arch.lower()
        if key not in arch_zoo:
            names = ', '.join(sorted(arch_zoo))
            raise ValueError(f'{owner}: unknown arch {arch!r}; valid archs: {names}')
        return copy.deepcopy(arch_zoo[key])
    if not isinstance(arch, dict):
        raise TypeError(f'{owner}: arch must be a name or a dict, got {type(arch).__name__}')
    missing = required - set(arch)
    unknown = set(arch) - required
    if missing or unknown:
        raise ValueError(f'{owner}: custom arch dict must have exactly the keys '
                         f'{sorted(required)}; missing {sorted(missing)}, unexpected {sorted(unknown)}')
    return copy.deepcopy(arch)


def check_out_indices(out_indices: Sequence[int], num_stages: int, owner: str) -> Tuple[int, ...]:
    """Validate ``out_indices`` (negative indices count from the end)."""
    if isinstance(out_indices, int):
        out_indices = (out_indices, )
    result = []
    for i in out_indices:
        j = i + num_stages if i < 0 else i
        if not 0 <= j < num_stages:
            raise ValueError(f'{owner}: out_indices entry {i} is out of range for '
                             f'{num_stages} stages (valid 0..{num_stages - 1})')
        result.append(j)
    if len(set(result)) != len(result):
        raise ValueError(f'{owner}: out_indices {tuple(out_indices)} has duplicates')
    return tuple(sorted(result))


def check_frozen_stages(frozen_stages: int, num_units: int, owner: str) -> int:
    """Validate ``frozen_stages``: ``-1`` (nothing frozen) to ``num_units - 1``, where
    ``num_units`` counts what can be frozen, the stem plus the stages (``k`` freezes
    ``k + 1`` units, so ``num_units - 1`` = the number of stages freezes everything)."""
    if not isinstance(frozen_stages, int) or not -1 <= frozen_stages < num_units:
        raise ValueError(f'{owner}: frozen_stages must be in [-1, {num_units - 1}], '
                         f'got {frozen_stages!r}')
    return frozen_stages


def freeze(part: Union[nn.Module, nn.Parameter]) -> None:
    """Stop the gradients of ``part``, a module (also put in eval mode) or a parameter."""
    if isinstance(part, nn.Parameter):
        part.requires_grad = False
        return
    part.eval()
    for p in part.parameters():
        p.requires_grad = False


def expand_per_stage(cfg, num_stages: int, name: str) -> list:
    """A per-stage list from one value (dict/scalar) or a sequence of ``num_stages``."""
    if isinstance(cfg, (list, tuple)):
        if len(cfg) != num_stages:
            raise ValueError(f'{name} has {len(cfg)} entries, expected {num_stages}')
        return [copy.deepcopy(c) for c in cfg]
    return [copy.deepcopy(cfg) for _ in range(num_stages)]



def set_use_triton(model: nn.Module, use_triton: Optional[bool]) -> None:
    """The backbone-wide kernel switch (the ``use_triton`` argument of every backbone):
    ``False`` / ``True`` / ``None`` is given to every operator of ``model`` that has fused
    kernels (a ``use_triton`` attribute: FLA, QuadTree); operators without kernels (softmax,
    SimA) have nothing to switch. ``None`` (the default) keeps each operator's own setting
    (``attn_cfg``), i.e. automatic. ``FLATTEN_MM_TRITON=0`` wins over both
    (``flatten_mm.models.ops.dispatch``)."""
    if use_triton is None:
        return
    use_triton = dispatch.check_use_triton(use_triton)
    for module in model.modules():
        if module is not model and hasattr(module, 'use_triton'):
            module.use_triton = use_triton


def is_pretrained_cfg(cfg: Mapping) -> bool:
    """Whether an init config is mmengine's ``Pretrained`` (by name or class)."""
    return cfg.get('type') == 'Pretrained' or cfg.get('type') is PretrainedInit


def split_init_cfg(init_cfg, owner: str = 'init_cfg') -> Tuple[List[dict], List[dict]]:
    """``init_cfg`` (``None``, one dict or a list of dicts, as mmengine's ``BaseModule``
    takes) as ``(other_cfgs, pretrained_cfgs)`` in their original order.

    Raises:
        TypeError: ``init_cfg`` or an entry of it is not a dict.
        ValueError: an entry without ``type``, or a ``Pretrained`` one without
            ``checkpoint``.
    """
    if init_cfg is None:
        return [], []
    cfgs = [init_cfg] if isinstance(init_cfg, Mapping) else init_cfg
    if not isinstance(cfgs, (list, tuple)):
        raise TypeError(f'{owner}: init_cfg must be a dict or a list of dicts, '
                        f'got {type(init_cfg).__name__}')
    others, pretrained = [], []
    for cfg in cfgs:
        if not isinstance(cfg, Mapping):
            raise TypeError(f'{owner}: every init_cfg entry must be a dict, got {cfg!r}')
        if 'type' not in cfg:
            raise ValueError(f'{owner}: init_cfg entry without type: {dict(cfg)}')
        if is_pretrained_cfg(cfg):
            if not cfg.get('checkpoint'):
                raise ValueError(f'{owner}: init_cfg Pretrained needs a checkpoint: {dict(cfg)}')
            pretrained.append(cfg)
        else:
            others.append(cfg)
    return others, pretrained


def transformer_init(model: nn.Module, conv_fan_out: bool = False) -> None:
    """The default initialisation: truncated-normal (std 0.02) linears with zero bias,
    unit LayerNorm / GroupNorm and, with ``conv_fan_out``, PVT's fan-out normal convs."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif conv_fan_out and isinstance(m, nn.Conv2d):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
            nn.init.normal_(m.weight, 0, (2.0 / fan_out)**0.5)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def init_weights_or_load(model: nn.Module, init_cfg, conv_fan_out: bool = False,
                         default_init: Optional[Callable[[], None]] = None) -> bool:
    """Initialise a backbone from ``init_cfg`` the way mmengine's
    ``BaseModule.init_weights`` orders it, with checked checkpoint loading:

    1. the default initialisation (``transformer_init``, then ``default_init`` if given),
       which stands for what mmengine modules get at construction;
    2. every non-``Pretrained`` entry of ``init_cfg`` (a dict or a list, e.g.
       ``dict(type='TruncNormal', layer='Linear', std=.02)``, with ``override``), in
       order, by mmengine's ``initialize``;
    3. every ``Pretrained`` entry, in order, last (mmengine gives it priority): loaded
       by ``load_pretrained`` (a wrong family / variant is refused, ``prefix`` selects a
       sub-model, positional tables of another grid are resized); its ``override``, if
       any, is applied afterwards by mmengine as ``initialize`` does.

    Returns:
        Whether a checkpoint was loaded.
    """
    others, pretrained = split_init_cfg(init_cfg, type(model).__name__)
    transformer_init(model, conv_fan_out)
    if default_init is not None:
        default_init()
    if others:
        initialize(model, [dict(c) for c in others])
    for cfg in pretrained:
        cfg = copy.deepcopy(dict(cfg))
        override = cfg.pop('override', None)
        load_pretrained(model, cfg)
        if override is not None:
            cfg.pop('layer', None)
            _initialize_override(model, override, cfg)
    return bool(pretrained)


def merge_stage_cfgs(defaults: Union[dict, Sequence[dict]], user, num_stages: int,
                     name: str = 'attn_cfg') -> List[dict]:
    """Per-stage attention configs: ``user`` (one dict or one per stage) over ``defaults``.

    A user dict with ``type`` replaces the default of its stage; one without ``type``
    updates it (same operator, other arguments).
    """
    base = expand_per_stage(defaults, num_stages, f'default {name}')
    if user is None:
        return base
    cfgs = []
    for d, u in zip(base, expand_per_stage(user, num_stages, name)):
        u = dict(u)
        if 'type' in u:
            cfgs.append(u)
        else:
            d.update(u)
            cfgs.append(d)
    return cfgs


def check_input(x: torch.Tensor, in_channels: int, owner: str,
                size_note: Optional[str] = 'any size is padded') -> None:
    """Validate an image batch ``(B, C_in, H, W)``: four dimensions, ``in_channels``
    channels and, unless ``size_note`` is ``None`` (the backbone checks its own minimum),
    ``H, W >= 1`` (``size_note`` says why any size works)."""
    if x.dim() != 4:
        raise ValueError(f'{owner} expects a (B, C, H, W) tensor, got shape {tuple(x.shape)}')
    if x.shape[1] != in_channels:
        raise ValueError(f'{owner} was built for {in_channels} input channels, '
                         f'got an input with {x.shape[1]}')
    if size_note is not None and (x.shape[2] < 1 or x.shape[3] < 1):
        raise ValueError(f'{owner} needs an input of at least 1x1 pixels ({size_note}), '
                         f'got {x.shape[2]}x{x.shape[3]}')


class StridePyramidOutputs:
    """Output contract of the four-stage pyramids (PVT, Swin, CSwin): stage ``i`` returns
    ``embed_dims[i]`` channels at stride ``4 * 2**i``; needs ``embed_dims`` and
    ``out_indices`` attributes."""

    @property
    def out_channels(self) -> Tuple[int, ...]:
        """Channels of each returned map."""
        return tuple(self.embed_dims[i] for i in self.out_indices)

    @property
    def out_strides(self) -> Tuple[int, ...]:
        """Stride (w.r.t. the input) of each returned map."""
        return tuple(4 * 2**i for i in self.out_indices)


Part = Union[nn.Module, nn.Parameter]


class StageFreezing:
    """``frozen_stages`` with mmdet's convention, and the stages that are never run.

    ``frozen_stages`` (as mmdet's Swin and ResNet):

    * ``-1``: nothing is frozen;
    * ``0``: the stem -- the patch embedding in front of stage 0 and what is applied to
      its tokens before the first block (an absolute position table and its dropout);
    * ``k >= 1``: the stem and stages ``0..k-1``, each with everything the backbone
      groups into it (its blocks, its own patch embedding or the down-sampling that
      follows it, its norm) and its output norm;
    * ``num_stages``: everything.

    Frozen parameters have ``requires_grad=False`` and frozen modules stay in eval mode
    after every ``train()`` (dropout off, as mmdet's frozen ``drop_after_pos``).

    Stages after the deepest of ``out_indices`` are never run (``forward`` stops there).
    Their parameters are kept, so full checkpoints still load, and frozen the same way:
    without this, distributed training without ``find_unused_parameters`` (mmdet's and
    mmseg's ``tools/train.py``) would wait for gradients that never come and fail at the
    second iteration. ``unused_parts`` lists them.

    A subclass provides ``stages``, ``num_stages``, ``out_indices``, ``frozen_stages``,
    the class attribute ``stem_names`` (dotted paths of modules or parameters; absent or
    ``None`` ones are skipped) and optionally ``output_norm``.
    """

    #: dotted paths of the stem (modules or parameters) frozen with ``frozen_stages >= 0``
    stem_names: Tuple[str, ...] = ()

    def _part(self, path: str) -> Optional[Part]:
        obj = self
        for name in path.split('.'):  # ModuleList entries are attributes '0', '1'...
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj

    def output_norm(self, i: int) -> Optional[nn.Module]:
        """The norm applied to the returned map of stage ``i`` outside the stage (if any)."""
        return None

    def stem_parts(self) -> List[Part]:
        """Frozen with ``frozen_stages >= 0``."""
        return [p for p in (self._part(n) for n in self.stem_names) if p is not None]

    def stage_parts(self, i: int) -> List[Part]:
        """Stage ``i`` and its output norm (frozen with ``frozen_stages > i``)."""
        norm = self.output_norm(i) if i in self.out_indices else None
        return [self.stages[i]] + ([norm] if norm is not None else [])

    def unused_parts(self) -> List[Part]:
        """What ``forward`` never runs: the stages after the deepest of ``out_indices``."""
        return [self.stages[i] for i in range(max(self.out_indices) + 1, self.num_stages)]

    def frozen_parts(self) -> List[Part]:
        """Everything ``_freeze_stages`` freezes (``frozen_stages`` and unused stages)."""
        parts = list(self.stem_parts()) if self.frozen_stages >= 0 else []
        for i in range(min(self.frozen_stages, self.num_stages)):
            parts += self.stage_parts(i)
        return parts + self.unused_parts()

    def _freeze_stages(self) -> None:
        for part in self.frozen_parts():
            freeze(part)

    def train(self, mode: bool = True):
        """``nn.Module.train``; frozen parts stay in eval mode."""
        super().train(mode)
        self._freeze_stages()
        return self


class DoublingStageBackbone(StageFreezing, StridePyramidOutputs, BaseModule):
    """Plumbing shared by the four-stage backbones whose stage widths double
    (``C, 2C, 4C, 8C``; strides 4, 8, 16, 32) and whose dense outputs pass through new
    LayerNorms (FLatten-Swin, FLatten-CSwin): arch tables with optional geometry keys,
    argument checks, the output contract, Swin-style init or ``Pretrained`` loading,
    freezing, gradient checkpointing and the forward over ``iter_stages``.

    A subclass sets the class attributes (``stem_names``: see ``StageFreezing``), calls
    ``_setup``, builds ``self.stages``, then ``_add_output_norms`` and ``_freeze_stages``,
    and implements ``iter_stages``.
    """

    arch_zoo: Dict[str, dict] = {}
    arch_keys = ('embed_dims', 'depths', 'num_heads')
    #: optional arch keys and their defaults (e.g. ``pretrain_img_size``, ``window_size``)
    arch_geometry: Dict[str, Any] = {}
    default_attn_cfg: tuple = ()
    num_stages = 4
    #: the output norm of stage ``i`` is ``norm{i + norm_offset}``
    norm_offset = 0

    def _setup(self, arch: Union[str, dict], in_channels: int, attn_cfg,
               pretrain_img_size: Optional[Union[int, Tuple[int, int]]],
               out_indices: Sequence[int], frozen_stages: int, with_cp: bool) -> dict:
        """Resolve ``arch``, check the arguments and set the common attributes
        (``embed_dims``, ``depths``, ``num_heads``, ``pretrain_img_size``,
        ``out_indices``, ``frozen_stages``, ``attn_cfgs``...). Returns the arch settings."""
        name = type(self).__name__
        settings = self._resolve_arch(arch)
        C = int(settings['embed_dims'])
        self.depths = tuple(settings['depths'])
        self.num_heads = tuple(settings['num_heads'])
        for key, val in (('depths', self.depths), ('num_heads', self.num_heads)):
            if len(val) != self.num_stages:
                raise ValueError(f'{name}: arch {key} needs {self.num_stages} entries, got {val}')
        if pretrain_img_size is None:
            pretrain_img_size = settings['pretrain_img_size']
        if isinstance(pretrain_img_size, int):
            pretrain_img_size = (pretrain_img_size, pretrain_img_size)
        self.pretrain_img_size = tuple(pretrain_img_size)
        self.arch_settings = settings
        self.embed_dims = tuple(C * 2**i for i in range(self.num_stages))
        self.out_indices = check_out_indices(out_indices, self.num_stages, name)
        self.frozen_stages = check_frozen_stages(frozen_stages, self.num_stages + 1, name)
        self.with_cp = with_cp
        self.in_channels = in_channels
        self.attn_cfgs = merge_stage_cfgs(self.default_attn_cfg, attn_cfg, self.num_stages)
        return settings

    def _resolve_arch(self, arch: Union[str, dict]) -> dict:
        if isinstance(arch, dict):
            arch = dict(arch)
            geometry = {k: arch.pop(k, v) for k, v in self.arch_geometry.items()}
            settings = resolve_arch(arch, self.arch_zoo, self.arch_keys, type(self).__name__)
        else:
            settings = resolve_arch(arch, self.arch_zoo, self.arch_keys, type(self).__name__)
            geometry = {k: settings.pop(k, v) for k, v in self.arch_geometry.items()}
        settings.update(geometry)
        return settings

    def stage_grid(self, i: int) -> Tuple[int, int]:
        """Token grid of stage ``i`` at ``pretrain_img_size`` (the positional tables)."""
        stride = 4 * 2**i
        return self.pretrain_img_size[0] // stride, self.pretrain_img_size[1] // stride

    def norm_name(self, i: int) -> str:
        """Name of the output norm of stage ``i``."""
        return f'norm{i + self.norm_offset}'

    def _add_output_norms(self) -> None:
        for i in self.out_indices:  # new output norms (not in classification checkpoints)
            self.add_module(self.norm_name(i), nn.LayerNorm(self.embed_dims[i]))

    # ------------------------------------------------------------------ contract
    def min_input_size(self) -> Tuple[int, int]:
        """Smallest input ``(H, W)`` accepted: ``(1, 1)``, any size is padded."""
        return 1, 1

    # ------------------------------------------------------------------ init / freezing
    def init_weights(self) -> None:
        """Swin-style initialisation, or the ``Pretrained`` checkpoint of ``init_cfg``."""
        init_weights_or_load(self, self.init_cfg)

    def output_norm(self, i: int) -> Optional[nn.Module]:
        """The output norm of stage ``i`` (exists for ``i`` in ``out_indices``)."""
        return getattr(self, self.norm_name(i), None)

    # ------------------------------------------------------------------ forward
    def _run_block(self, block: nn.Module, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(block, x, hw, use_reentrant=False)
        return block(x, hw)

    def iter_stages(self, x: torch.Tensor, last: Optional[int] = None
                    ) -> Iterator[Tuple[int, torch.Tensor, Tuple[int, int]]]:
        """Yield ``(i, tokens (B, H_i*W_i, C_i), (H_i, W_i))`` of each stage ``0..last``
        (the output of its last block, before the output norm)."""
        raise NotImplementedError

    def forward_raw(self, x: torch.Tensor) -> List[torch.Tensor]:
        """Un-normalised maps ``(B, C_i, H_i, W_i)`` of all four stages (the official
        classification model's stage outputs; used by the parity checks)."""
        return [tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], *hw)
                for _, tokens, hw in self.iter_stages(x)]

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Args: x ``(B, C_in, H, W)``, any ``H, W``. Returns the maps of ``out_indices``,
        ``(B, out_channels[k], ceil(H / s), ceil(W / s))`` for ``s = out_strides[k]``."""
        outs = []
        for i, tokens, hw in self.iter_stages(x, last=max(self.out_indices)):
            if i in self.out_indices:
                tokens = getattr(self, self.norm_name(i))(tokens)
                outs.append(tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], *hw))
        return tuple(outs)
