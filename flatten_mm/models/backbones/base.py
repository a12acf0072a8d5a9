"""Shared pieces of the dense backbones: arch tables, argument checks, per-stage attention
configs, freezing, and the plumbing of the doubling-width four-stage backbones."""
import copy
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_

from ...utils.pretrained import load_pretrained


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


def check_frozen_stages(frozen_stages: int, num_stages: int, owner: str) -> int:
    """Validate ``frozen_stages`` (-1 = nothing frozen)."""
    if not -1 <= frozen_stages < num_stages:
        raise ValueError(f'{owner}: frozen_stages must be in [-1, {num_stages - 1}], '
                         f'got {frozen_stages}')
    return frozen_stages


def freeze(module: nn.Module) -> None:
    """Put ``module`` in eval mode and stop its gradients."""
    module.eval()
    for p in module.parameters():
        p.requires_grad = False


def expand_per_stage(cfg, num_stages: int, name: str) -> list:
    """A per-stage list from one value (dict/scalar) or a sequence of ``num_stages``."""
    if isinstance(cfg, (list, tuple)):
        if len(cfg) != num_stages:
            raise ValueError(f'{name} has {len(cfg)} entries, expected {num_stages}')
        return [copy.deepcopy(c) for c in cfg]
    return [copy.deepcopy(cfg) for _ in range(num_stages)]



def init_weights_or_load(model: nn.Module, init_cfg, conv_fan_out: bool = False) -> bool:
    """Initialise a backbone: the ``Pretrained`` checkpoint of ``init_cfg`` (checked, see
    ``load_pretrained``: a wrong family / variant is refused), else the transformer
    initialisation -- truncated-normal (std 0.02) linears with zero bias, unit
    LayerNorm / GroupNorm and, with ``conv_fan_out``, PVT's fan-out normal convs.
    Returns whether a checkpoint was loaded."""
    if isinstance(init_cfg, dict) and init_cfg.get('type') == 'Pretrained':
        load_pretrained(model, init_cfg)
        return True
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
    return False


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


class DoublingStageBackbone(StridePyramidOutputs, BaseModule):
    """Plumbing shared by the four-stage backbones whose stage widths double
    (``C, 2C, 4C, 8C``; strides 4, 8, 16, 32) and whose dense outputs pass through new
    LayerNorms (FLatten-Swin, FLatten-CSwin): arch tables with optional geometry keys,
    argument checks, the output contract, Swin-style init or ``Pretrained`` loading,
    freezing, gradient checkpointing and the forward over ``iter_stages``.

    A subclass sets the class attributes, calls ``_setup``, builds ``self.stages``, then
    ``_add_output_norms`` and ``_freeze_stages``, and implements ``iter_stages``.
    """

    arch_zoo: Dict[str, dict] = {}
    arch_keys = ('embed_dims', 'depths', 'num_heads')
    #: optional arch keys and their defaults (e.g. ``pretrain_img_size``, ``window_size``)
    arch_geometry: Dict[str, Any] = {}
    default_attn_cfg: tuple = ()
    num_stages = 4
    #: the output norm of stage ``i`` is ``norm{i + norm_offset}``
    norm_offset = 0
    #: modules before the stages frozen with ``frozen_stages >= 0`` (e.g. a shared stem)
    stem_names: Tuple[str, ...] = ()

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
        self.frozen_stages = check_frozen_stages(frozen_stages, self.num_stages, name)
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

    def _freeze_stages(self) -> None:
        if self.frozen_stages >= 0:
            for name in self.stem_names:
                freeze(getattr(self, name))
        for i in range(self.frozen_stages + 1):
            freeze(self.stages[i])
            if i in self.out_indices:
                freeze(getattr(self, self.norm_name(i)))

    def train(self, mode: bool = True) -> 'DoublingStageBackbone':
        super().train(mode)
        self._freeze_stages()
        return self

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
        return [tokens.transpose(1, 2).reshape(tokens.shape[0], -1, *hw)
                for _, tokens, hw in self.iter_stages(x)]

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Args: x ``(B, C_in, H, W)``, any ``H, W``. Returns the maps of ``out_indices``,
        ``(B, out_channels[k], ceil(H / s), ceil(W / s))`` for ``s = out_strides[k]``."""
        outs = []
        for i, tokens, hw in self.iter_stages(x, last=max(self.out_indices)):
            if i in self.out_indices:
                tokens = getattr(self, self.norm_name(i))(tokens)
                outs.append(tokens.transpose(1, 2).reshape(tokens.shape[0], -1, *hw))
        return tuple(outs)
