"""Focused Linear Attention (FLA), the operator of FLatten Transformer.

Paper: Han et al., "FLatten Transformer: Vision Transformer using Focused Linear
Attention", ICCV 2023, https://arxiv.org/abs/2308.00442.
Upstream: https://github.com/LeapLabTHU/FLatten-Transformer @ abdb115 (MIT licence);
this is an independent re-implementation of the post-May-2024 numerics
(``K^T V / n`` and the mean-of-K normaliser), see ``shared/spec/attention.md`` §1.

Per token, with ``phi_p(x) = ||x|| / ||x^p|| * x^p`` applied to
``ReLU(x) + 1e-6`` divided by ``softplus(scale)``::

    out_i = sum_j (phi(q_i) . phi(k_j)) v_j / (sum_j phi(q_i) . phi(k_j) + n * 1e-6)
            + DWC(V)_i

The kernel (steps ReLU ... normaliser) always runs in float32, also under autocast:
``(Q/s)^3`` overflows fp16 and the ``1e-6`` floor underflows it (FLatten#15, #32).
No ``N x N`` tensor is formed: cost and memory are linear in the token count.

On CUDA the kernel + linear attention run as fused Triton kernels (forward and backward,
``ops.fla_triton``), chosen by ``ops.dispatch`` (gates, then a first-use check against the
PyTorch path below, which stays the fallback); ``use_triton=False`` (operator argument)
or ``FLATTEN_MM_TRITON=0`` (environment) selects the PyTorch path. With the kernels,
``FocusedLinearAttention`` without key reduction also recomputes K, V from its input in
the backward rather than keeping them, and ``FocusedLinearAttentionQKV`` Q, K, V
(``fla_projected_triton``).
"""
import contextlib
import functools
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import dispatch
from ..ops import specialisation as spec
from ..ops.autograd_paths import recomputed_when_saved, recorded_eagerly, register_reference
from ..ops.layout import map_as_tokens, tokens_as_map
from .conv import depthwise_conv, repeat_depthwise, token_conv
from .focused_linear_function import FocusedLinearCore, core_forward
from .kv_reduction import KVReductionMixin
from .pos_embed import resize_loaded_pos_table, resize_pos_table
from .window import (crop_padding, effective_shift, pad_to_multiple, window_partition,
                     window_reverse)


def _kernels():
    """The Triton kernel module (imported only once ``ops.dispatch`` said it imports; a
    plain import, which ``torch.compile`` traces without a graph break)."""
    from ..ops import fla_triton  # late: imports triton, only after the dispatch said it imports
    return fla_triton


def _fla_key(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             focusing_factor: int, k_pos: Optional[torch.Tensor],
             residual: Optional[torch.Tensor], *extra) -> tuple:
    """The first-use key of an FLA kernel call: the op and all that selects its compiled
    specialisation (output dtype, matmul precision, channels, heads, power, and the
    ``specialisation.layout`` -- dtype, alignment, size and stride classes -- of every
    input)."""
    return (op, _dt(v), dispatch.precision_name(torch.float32), int(q.shape[-1]),
            int(num_heads), int(focusing_factor), spec.layout(q), spec.layout(k),
            spec.layout(v), spec.layout(k_pos), spec.layout(residual)) + tuple(extra)


def _use_fla_triton(use_triton: Optional[bool], q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, scale: torch.Tensor, num_heads: int,
                    focusing_factor: int, k_pos: Optional[torch.Tensor],
                    residual: Optional[torch.Tensor] = None) -> bool:
    """Whether ``focused_linear_core`` runs the fused Triton kernels (``ops.dispatch``:
    ``FLATTEN_MM_TRITON=0`` or ``use_triton=False`` never; ``None`` on CUDA after the gates
    and the first-use check; ``True`` always, else an error saying why not; CPU tensors
    need ``TRITON_INTERPRET=1``, the tests' way to run the kernels without a GPU)."""
    def why_not():
        return _kernels().check_inputs(
            q, k, v, scale, num_heads, focusing_factor, k_pos, residual)

    return dispatch.use_kernels(
        use_triton, 'fla', q, why_not,
        lambda: _fla_key('fla_core', q, k, v, num_heads, focusing_factor, k_pos, residual))


def focused_feature_map(x: torch.Tensor, scale: torch.Tensor,
                        focusing_factor: int) -> torch.Tensor:
    """The focused kernel ``phi_p`` on full-channel tokens (float32).

    Args:
        x: ``(B, N, C)`` queries or keys (positional encoding already added).
        scale: raw learnable scale ``(1, 1, C)``; ``softplus`` is applied here.
        focusing_factor: the power ``p``.

    Returns:
        ``(B, N, C)`` non-negative features whose per-token L2 norm equals that of
        ``(ReLU(x) + 1e-6) / softplus(scale)``.
    """
    x = (F.relu(x) + 1e-6) / F.softplus(scale)
    norm = x.norm(dim=-1, keepdim=True)
    x = x ** focusing_factor
    return x / x.norm(dim=-1, keepdim=True) * norm


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Normalised linear attention ``Q (K^T V / n) / (Q . mean(K) + 1e-6)``.

    Args:
        q: ``(B, h, N, d)`` non-negative query features.
        k: ``(B, h, n, d)`` non-negative key features.
        v: ``(B, h, n, d)`` values.

    Returns:
        ``(B, h, N, d)``.
    """
    n = k.shape[-2]
    z = 1.0 / (q @ k.mean(dim=-2, keepdim=True).transpose(-2, -1) + 1e-6)
    kv = (k.transpose(-2, -1) * n ** -0.5) @ (v * n ** -0.5)
    return (q @ kv) * z


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, N, C)`` -> ``(B, h, N, C/h)`` with head-major channels."""
    B, N, C = x.shape
    return x.reshape(B, N, num_heads, C // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, h, N, d)`` -> ``(B, N, h*d)``."""
    B, h, N, d = x.shape
    return x.transpose(1, 2).reshape(B, N, h * d)


def focused_linear_core_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  scale: torch.Tensor, num_heads: int,
                                  focusing_factor: int) -> torch.Tensor:
    """Unfused ``focused_linear_core``: the formula step by step (``focused_feature_map``
    then ``linear_attention``), float32. Kept as the reference of the fused path (tests)."""
    out_dtype = v.dtype
    with torch.autocast(device_type=q.device.type, enabled=False):
        # at least float32 (float64 inputs stay float64)
        dt = torch.promote_types(v.dtype, torch.float32)
        q = focused_feature_map(q.to(dt), scale.to(dt), focusing_factor)
        k = focused_feature_map(k.to(dt), scale.to(dt), focusing_factor)
        out = linear_attention(split_heads(q, num_heads), split_heads(k, num_heads),
                               split_heads(v.to(dt), num_heads))
    return merge_heads(out).to(out_dtype)


def _core_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                    k_pos: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                    num_heads: int, focusing_factor: int) -> torch.Tensor:
    """``focused_linear_core`` op by op (``focused_linear_core_reference`` with the
    positional table and the residual): what a double backward differentiates."""
    out = focused_linear_core_reference(q, k if k_pos is None else k + k_pos, v, scale,
                                        num_heads, focusing_factor)
    return out if residual is None else out + residual.to(out.dtype)


register_reference('fla_core', _core_reference)


def focused_linear_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: torch.Tensor, num_heads: int,
                        focusing_factor: int,
                        k_pos: Optional[torch.Tensor] = None,
                        use_triton: Optional[bool] = None,
                        residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Kernel + linear attention on full-channel tokens, computed in float32.

    Fused form of ``focused_linear_core_reference`` (same maths, rounding-level
    differences): with ``phi_p(x) = r(x) * y(x)`` (``y`` the powered base, ``r`` a
    per-token scalar, see ``focused_linear_function.kernel_parts``), the query factor ``r_q`` cancels in
    ``phi(q) KV / (phi(q) . mean(phi(K)) + 1e-6)`` except in the epsilon, which becomes
    ``1e-6 / r_q``; so ``phi(q)`` is never materialised. Without autograd the kernel
    runs in place on one buffer per side, keys first (their features are freed before
    the query side starts): peak memory is about two ``(B, N, C)`` float32 buffers.

    Args:
        q: ``(B, N, C)`` queries.
        k: ``(B, n, C)`` keys.
        v: ``(B, n, C)`` values.
        scale: raw ``(1, 1, C)`` scale parameter.
        num_heads: heads ``h`` (``C % h == 0``).
        focusing_factor: power ``p``.
        k_pos: optional positional encoding ``(1, n, C)`` added to the keys first.
        use_triton: ``None`` (auto: the fused Triton kernels on CUDA), ``True`` (force
            them; an error if impossible) or ``False`` (this PyTorch path); see
            ``_use_fla_triton``. ``FLATTEN_MM_TRITON=0`` turns them off everywhere.
        residual: optional ``(B, N, C)`` tensor added to the output (the operators' DWC
            branch): here ``out + residual`` in the dtype of ``v``; the Triton kernels add
            it in float32 inside their output pass (no extra kernel; one rounding).

    Returns:
        ``(B, N, C)`` attention output in the dtype of ``v`` (plus ``residual``).
    """
    if residual is not None and residual.shape != q.shape:
        raise ValueError(f'residual {tuple(residual.shape)} must have the shape of q '
                         f'{tuple(q.shape)}')
    if _use_fla_triton(use_triton, q, k, v, scale, num_heads, focusing_factor, k_pos,
                       residual):
        return dispatch.guarded(
            'fla', _fla_key('fla_core', q, k, v, num_heads, focusing_factor, k_pos, residual),
            q.device, use_triton is True,
            lambda: _kernels().fla_core_triton(
                q, k, v, scale, num_heads, focusing_factor, k_pos=k_pos, residual=residual),
            lambda: _focused_linear_core_torch(q, k, v, scale, num_heads, focusing_factor,
                                               k_pos, residual))
    return _focused_linear_core_torch(q, k, v, scale, num_heads, focusing_factor, k_pos,
                                      residual)


def _focused_linear_core_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               scale: torch.Tensor, num_heads: int, focusing_factor: int,
                               k_pos: Optional[torch.Tensor],
                               residual: Optional[torch.Tensor]) -> torch.Tensor:
    """The PyTorch path of ``focused_linear_core`` (the reference of the kernels): under
    autograd ``FocusedLinearCore``, which keeps only its inputs for the backward; without
    it, ``core_forward`` (in place on one buffer per side)."""
    out_dtype = v.dtype
    with torch.autocast(device_type=q.device.type, enabled=False):
        # at least float32 (float64 inputs stay float64)
        dt = torch.promote_types(v.dtype, torch.float32)
        tracked = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, scale, k_pos))
        if tracked:  # training: the backward recomputes the features instead of keeping them
            out = FocusedLinearCore.apply(q, k, v, scale, k_pos, num_heads, focusing_factor)
            return out if residual is None else out + residual.to(out_dtype)
        inv_scale = 1.0 / F.softplus(scale.to(dt))
        out = core_forward(q, k, v, inv_scale, k_pos, num_heads, focusing_factor, dt)[0]
    out = out.to(out_dtype)
    return out if residual is None else out + residual.to(out_dtype)


def _table_recomputed(pe: torch.Tensor, again) -> contextlib.AbstractContextManager:
    """Around the core: a positional table resized in this forward (``pe``, ``(1, n, C)``,
    as large as the keys) is not kept for the backward, whose key gradient needs it; the
    backward resizes it again (``again()``, from the parameter: the same values). The
    stored table itself (the pretraining grid) is a parameter, kept anyway."""
    if torch.compiler.is_compiling() or pe.grad_fn is None or not recorded_eagerly(pe):
        return contextlib.nullcontext()  # (under torch.compile nothing is recomputed)
    return recomputed_when_saved(pe, again)


def _projection_recomputed(qkv: torch.Tensor, x: torch.Tensor,
                           layer: nn.Linear) -> contextlib.AbstractContextManager:
    """Around the attention of ``qkv = layer(x)``: q, k, v are not kept for the backward
    (the core and the DWC would keep them, three ``(B, N, C)`` activations); the backward
    projects ``x`` again (kept by ``layer`` anyway, or recomputed by the block) -- what the
    Triton path's ``fla_projected_triton`` does on CUDA -- for one projection more."""
    if not recorded_eagerly(qkv):
        return contextlib.nullcontext()
    return recomputed_when_saved(qkv, F.linear, x, layer.weight, layer.bias)


def _projected_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the projection of ``x`` runs in (autocast's, inside a region)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _projected_key(q: Optional[torch.Tensor], x: torch.Tensor, num_heads: int,
                   focusing_factor: int, k_pos: Optional[torch.Tensor], linear: nn.Linear,
                   conv: nn.Conv2d) -> tuple:
    """The first-use key of ``fla_projected_triton`` (see ``_fla_key``; ``x`` as the
    projection takes it, cast under autocast)."""
    dt = _projected_dtype(x)
    return (('fla_projected', _dt(dt), dispatch.precision_name(torch.float32),
             int(x.shape[-1]), int(num_heads), int(focusing_factor), spec.layout(q),
             spec.layout(x, dt), spec.layout(k_pos), int(conv.kernel_size[0]),
             linear.bias is not None, conv.bias is not None))


def _dt(t) -> Optional[str]:
    """``'float32'`` for a float32 tensor or dtype (``None`` stays ``None``)."""
    if t is None:
        return None
    return str(t if isinstance(t, torch.dtype) else t.dtype).replace('torch.', '')


def _projected_path(use_triton: Optional[bool], q: Optional[torch.Tensor], x: torch.Tensor,
                    scale: torch.Tensor, num_heads: int, focusing_factor: int,
                    k_pos: Optional[torch.Tensor], linear: nn.Linear,
                    conv: nn.Conv2d) -> bool:
    """Whether an FLA layer without key reduction runs ``fla_projected_triton`` (its
    packed projection ``linear``, DWC ``conv`` and core in one function): the FLA kernels
    apply (``ops.dispatch``, first-use check of this configuration included; with
    ``use_triton=True`` an error says why not), the DWC is a same-padding odd square kernel
    and, outside autocast, ``x`` and the parameters share a dtype (metadata only: no
    tensor is made to decide)."""
    k = conv.kernel_size[0]
    if (conv.kernel_size != (k, k) or k % 2 == 0 or conv.stride != (1, 1)
            or conv.dilation != (1, 1) or conv.padding != (k // 2, k // 2)
            or conv.padding_mode != 'zeros'):
        return False
    if not (torch.is_autocast_enabled(x.device.type)
            or x.dtype == linear.weight.dtype == conv.weight.dtype):
        return False

    def why_not():
        return _kernels().check_inputs(
            x if q is None else q, x, x, scale, num_heads, focusing_factor, k_pos)

    return dispatch.use_kernels(
        use_triton, 'fla', x, why_not,
        lambda: _projected_key(q, x, num_heads, focusing_factor, k_pos, linear, conv))


def _run_projected(use_triton: Optional[bool], q: Optional[torch.Tensor], x: torch.Tensor,
                   scale: torch.Tensor, num_heads: int, focusing_factor: int,
                   hw_shape: Tuple[int, int], k_pos: Optional[torch.Tensor],
                   linear: nn.Linear, conv: nn.Conv2d) -> Optional[torch.Tensor]:
    """``fla_projected_triton`` of a layer, or ``None`` if the kernels raised (auto mode,
    eagerly: warned once; the caller then takes its unfused path)."""
    return dispatch.guarded(
        'fla', _projected_key(q, x, num_heads, focusing_factor, k_pos, linear, conv),
        x.device, use_triton is True,
        lambda: _kernels().fla_projected_triton(
            q, x, linear.weight, linear.bias, scale, num_heads, focusing_factor, hw_shape,
            *repeat_depthwise(conv, num_heads), k_pos=k_pos),
        lambda: None)


class FocusedLinearAttention(KVReductionMixin, nn.Module):
    """FLA with PVT-style projections (``q``, ``kv``), as in FLatten-PVT / -PVTv2.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h``; the DWC is shared by all heads (``C/h`` channels).
        qkv_bias: bias of ``q`` and ``kv``.
        attn_drop: accepted for interface uniformity; must be 0 (FLA has no
            attention matrix to drop; ``build_attention`` does not pass a backbone's
            ``attn_drop_rate`` to FLA, as the official FLA modules ignore it).
        proj_drop: dropout after ``proj``.
        sr_ratio: spatial reduction of keys/values (strided conv + LayerNorm).
        linear: PVTv2-li reduction (adaptive 7x7 pooling, 1x1 conv, LayerNorm, GELU)
            instead of ``sr_ratio``.
        focusing_factor: focusing power ``p``.
        kernel_size: DWC kernel size ``k``.
        pretrain_hw_shape: stage grid ``(H, W)`` at the pretraining resolution; the
            stored ``positional_encoding`` covers the key grid of that resolution
            (``H*W // sr^2`` tokens, or 49 with ``linear``) and is resized to the
            actual key grid at run time.
        pe_interp_mode: ``'bilinear'`` or ``'bicubic'`` resizing of the table.
        use_triton: fused Triton kernels of the FLA core: ``None`` auto (on CUDA),
            ``True`` forced, ``False`` off (see ``focused_linear_core``).
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 sr_ratio: int = 1,
                 linear: bool = False,
                 focusing_factor: int = 3,
                 kernel_size: int = 5,
                 pretrain_hw_shape: Tuple[int, int] = (56, 56),
                 pe_interp_mode: str = 'bilinear',
                 use_triton: Optional[bool] = None) -> None:
        super().__init__()
        self.use_triton = dispatch.check_use_triton(use_triton)
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        if attn_drop != 0:
            raise NotImplementedError(
                f'FocusedLinearAttention has no attention-map dropout (got attn_drop={attn_drop} '
                "in its attn_cfg); a backbone's attn_drop_rate only reaches operators with one")
        if sr_ratio < 1:
            raise ValueError(f'sr_ratio must be >= 1, got {sr_ratio}')
        if pe_interp_mode not in ('bilinear', 'bicubic'):
            raise ValueError(f"pe_interp_mode must be 'bilinear' or 'bicubic', got {pe_interp_mode!r}")
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.focusing_factor = focusing_factor
        self.pe_interp_mode = pe_interp_mode

        self.q = nn.Linear(embed_dims, embed_dims, bias=qkv_bias)
        self.kv = nn.Linear(embed_dims, 2 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)
        self._init_kv_reduction(embed_dims, sr_ratio, linear)
        # the official table has num_patches // sr^2 tokens: the key grid at pretraining
        self.pe_hw_shape = (pretrain_hw_shape[0] // sr_ratio, pretrain_hw_shape[1] // sr_ratio)
        if linear and self.pe_hw_shape != (7, 7):
            raise ValueError('linear=True reduces keys to a 7x7 grid, so the positional encoding '
                             f'must have 49 tokens; pretrain_hw_shape={pretrain_hw_shape} with '
                             f'sr_ratio={sr_ratio} gives {self.pe_hw_shape}')
        self.scale = nn.Parameter(torch.zeros(1, 1, embed_dims))
        self.positional_encoding = nn.Parameter(
            torch.zeros(1, self.pe_hw_shape[0] * self.pe_hw_shape[1], embed_dims))
        self.dwc = nn.Conv2d(self.head_dims, self.head_dims, kernel_size=kernel_size,
                             groups=self.head_dims, padding=kernel_size // 2)

    @classmethod
    def has_attention_dropout(cls, cfg: dict) -> bool:
        """No attention matrix, so no attention dropout (``build_attention`` does not pass
        a backbone's ``attn_drop_rate``)."""
        return False

    def resize_loaded_tables(self, state_dict: dict, prefix: str) -> list:
        """Resize, in ``state_dict``, a ``positional_encoding`` stored for another square
        pretraining grid (e.g. a 384 fine-tuned checkpoint) to this module's
        ``pe_hw_shape`` (bicubic, as FLatten's own 224 -> 384 loader does; see
        ``resize_loaded_pos_table``). Called before loading (``_load_from_state_dict``,
        and by ``flatten_mm.models.pretrained`` before its checks). Returns the
        ``(key, old shape, new shape)`` of each resized table."""
        done = resize_loaded_pos_table(state_dict, prefix + 'positional_encoding',
                                       self.positional_encoding, self.pe_hw_shape, 'bicubic')
        return [done] if done else []

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the run-time resize then starts from this module's grid
        self.resize_loaded_tables(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        B, N, C = x.shape
        q = self.q(x)
        x_kv, kv_hw = self.reduce_kv_input(x, hw_shape)
        # resized from the parameter in every call, never cached (see pos_embed)
        pe = resize_pos_table(self.positional_encoding, self.pe_hw_shape, kv_hw,
                              self.pe_interp_mode)
        if x_kv is x and _projected_path(self.use_triton, q, x, self.scale, self.num_heads,
                                         self.focusing_factor, pe, self.kv, self.dwc):
            # no key reduction (the released models): kv projection, DWC and core as one
            # function, whose backward recomputes k, v instead of keeping them
            out = _run_projected(self.use_triton, q, x, self.scale, self.num_heads,
                                 self.focusing_factor, hw_shape, pe, self.kv, self.dwc)
            if out is not None:
                return self.proj_drop(self.proj(out))
        k, v = self.kv(x_kv).chunk(2, dim=-1)
        # rank restoration: depthwise conv on V, shared by the heads
        n = v.shape[1]
        if n == N:
            dwc = token_conv(self.dwc, v, hw_shape, repeat=self.num_heads)
        else:  # reduced keys: V is resized along the token sequence first (official)
            h, d = self.num_heads, self.head_dims
            v_img = v.reshape(B, n, h, d).permute(0, 2, 3, 1).reshape(B * h, d, n)
            v_img = F.interpolate(v_img, size=N, mode='linear', align_corners=False)
            v_img = v_img.reshape(B * h, d, hw_shape[0], hw_shape[1])
            dwc = depthwise_conv(self.dwc, v_img).reshape(B, C, N).transpose(1, 2)
        with _table_recomputed(pe, functools.partial(
                resize_pos_table, self.positional_encoding, self.pe_hw_shape, kv_hw,
                self.pe_interp_mode)):
            out = focused_linear_core(q, k, v, self.scale, self.num_heads,
                                      self.focusing_factor, k_pos=pe, use_triton=self.use_triton,
                                      residual=dwc)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'sr_ratio={self.sr_ratio}, linear={self.linear}, p={self.focusing_factor}, '
                f'pe_grid={self.pe_hw_shape}')


# ----------------------------------------------------------------------------------------
# FLA on q/k/v tokens: FLatten-Swin (one ``qkv`` projection, global or windowed) and
# FLatten-CSwin (q/k/v come from the block's ``qkv``; LePE on V).


def depthwise_conv_heads(conv: nn.Conv2d, v: torch.Tensor, hw_shape: Tuple[int, int],
                         num_heads: int) -> torch.Tensor:
    """FLA rank restoration: a depth-wise conv shared by all heads, applied to V.

    Args:
        conv: conv with ``C/h`` channels (``groups = C/h``).
        v: ``(B, N, C)`` values of the ``hw_shape`` grid, head-major channels.
        hw_shape: ``(H, W)``.
        num_heads: ``h``.

    Returns:
        ``(B, N, C)`` (heads folded into the batch for the conv, merged back head-major).
    """
    B, N, C = v.shape
    H, W = hw_shape
    d = C // num_heads
    img = v.reshape(B, N, num_heads, d).permute(0, 2, 3, 1).reshape(B * num_heads, d, H, W)
    return depthwise_conv(conv, img).reshape(B, C, N).transpose(1, 2)


class _FocusedLinearRegion(nn.Module):
    """Parameters and maths of FLA on given q, k, v tokens of one region (no projections).

    The region is the whole map, a window or a stripe; ``hw_shape`` is its grid::

        out = FLA(q, k + PE, v) + DWC(v) [+ LePE(v)]

    ``PE`` (``positional_encoding``) is stored for the region grid at pretraining and
    resized to ``hw_shape`` at run time (the stored table is used as is at that grid).
    Shared by ``FocusedLinearQKV`` (a FLatten-CSwin branch) and
    ``FocusedLinearAttentionQKV`` (FLatten-Swin), so both keep the official parameter
    names (``scale``, ``positional_encoding``, ``dwc``, ``get_v``).

    Args:
        embed_dims: channels ``Cm`` of q, k, v.
        num_heads: heads ``h``; the kernel normalises over all ``Cm`` channels, the
            linear attention is per head; ``dwc`` has ``Cm/h`` channels, shared by heads.
        focusing_factor: focusing power ``p``.
        kernel_size: DWC kernel size.
        pretrain_hw_shape: grid of the region at the pretraining resolution (size of
            the stored positional table).
        lepe: add CSWin's locally-enhanced positional encoding ``get_v`` (3x3 depth-wise
            conv with bias on the V map of the region).
        pe_interp_mode: ``'bilinear'`` or ``'bicubic'`` resizing of the table.
        use_triton: fused Triton kernels of the FLA core: ``None`` auto (on CUDA),
            ``True`` forced, ``False`` off (see ``focused_linear_core``).
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 focusing_factor: int = 3,
                 kernel_size: int = 5,
                 pretrain_hw_shape: Tuple[int, int] = (56, 56),
                 lepe: bool = False,
                 pe_interp_mode: str = 'bilinear',
                 use_triton: Optional[bool] = None) -> None:
        super().__init__()
        self.use_triton = dispatch.check_use_triton(use_triton)
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        if pe_interp_mode not in ('bilinear', 'bicubic'):
            raise ValueError("pe_interp_mode must be 'bilinear' or 'bicubic', "
                             f'got {pe_interp_mode!r}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.focusing_factor = focusing_factor
        self.pe_interp_mode = pe_interp_mode
        self.pe_hw_shape = (int(pretrain_hw_shape[0]), int(pretrain_hw_shape[1]))
        self.scale = nn.Parameter(torch.zeros(1, 1, embed_dims))
        self.positional_encoding = nn.Parameter(
            torch.zeros(1, self.pe_hw_shape[0] * self.pe_hw_shape[1], embed_dims))
        self.dwc = nn.Conv2d(self.head_dims, self.head_dims, kernel_size=kernel_size,
                             groups=self.head_dims, padding=kernel_size // 2)
        self.get_v = nn.Conv2d(embed_dims, embed_dims, kernel_size=3, padding=1,
                               groups=embed_dims) if lepe else None

    @classmethod
    def has_attention_dropout(cls, cfg: dict) -> bool:
        """No attention matrix, so no attention dropout."""
        return False

    def resize_loaded_tables(self, state_dict: dict, prefix: str) -> list:
        """Resize, in ``state_dict``, a square ``positional_encoding`` of another
        pretraining grid (e.g. 224 weights in a 384 model) bicubically to this module's
        ``pe_hw_shape``, like FLatten's loader (see ``resize_loaded_pos_table``). Returns
        the ``(key, old shape, new shape)`` of each resized table."""
        done = resize_loaded_pos_table(state_dict, prefix + 'positional_encoding',
                                       self.positional_encoding, self.pe_hw_shape, 'bicubic')
        return [done] if done else []

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.resize_loaded_tables(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def region_pos_table(self, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """The positional table of a region grid: resized from the parameter in every
        call, never cached (see pos_embed)."""
        return resize_pos_table(self.positional_encoding, self.pe_hw_shape, hw_shape,
                                self.pe_interp_mode)

    def attend_region(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      hw_shape: Tuple[int, int],
                      pe: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Args: q, k, v ``(B, N, Cm)`` tokens of a region with grid ``hw_shape``; ``pe``
        its ``region_pos_table`` if already made. Returns ``(B, N, Cm)``."""
        N = q.shape[1]
        if N != hw_shape[0] * hw_shape[1]:
            raise ValueError(f'token count {N} does not match hw_shape {tuple(hw_shape)}')
        if pe is None:
            pe = self.region_pos_table(hw_shape)
        dwc = token_conv(self.dwc, v, hw_shape, repeat=self.num_heads)
        with _table_recomputed(pe, functools.partial(self.region_pos_table, hw_shape)):
            out = focused_linear_core(q, k, v, self.scale, self.num_heads,
                                      self.focusing_factor, k_pos=pe, use_triton=self.use_triton,
                                      residual=dwc)
        if self.get_v is not None:
            out = out + token_conv(self.get_v, v, hw_shape).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'p={self.focusing_factor}, pe_grid={self.pe_hw_shape}, '
                f'lepe={self.get_v is not None}')


class FocusedLinearQKV(_FocusedLinearRegion):
    """Focused linear attention on given q, k, v tokens of one region: a FLatten-CSwin
    branch (``lepe=True``), see ``lepe_attention.CrossShapedAttention``.

    Arguments as ``_FocusedLinearRegion``: ``embed_dims, num_heads, focusing_factor,
    kernel_size, pretrain_hw_shape`` (region grid at pretraining), ``lepe``,
    ``pe_interp_mode``.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: q, k, v ``(B, N, Cm)`` tokens of a region with grid ``hw_shape``.
        Returns ``(B, N, Cm)`` (before the block's projection)."""
        return self.attend_region(q, k, v, hw_shape)


class FocusedLinearAttentionQKV(_FocusedLinearRegion):
    """FLA with one ``qkv`` projection (FLatten-Swin's linear blocks), global or windowed.

    * ``window_size=None`` (default; the released models at 224/384, where the
      linear-attention window covers the whole stage): global attention over all tokens
      of the unpadded ``(H, W)`` map; the positional table (stage grid at pretraining,
      ``pretrain_hw_shape``) is resized to ``(H, W)``.
    * ``window_size=w``: FLA inside ``w x w`` windows (map zero-padded at the
      bottom/right to multiples of ``w``; padded tokens take part). With ``shift`` the
      map is cyclically shifted by ``w // 2`` along each axis holding more than one
      window, **without** a mask, as in the official code (``shared/spec/attention.md``
      §1.3.2). The table covers one window (``w x w``) and is used as is.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``h``.
        qkv_bias: bias of ``qkv``.
        attn_drop: must be 0 (FLA has no attention matrix to drop; a backbone's
            ``attn_drop_rate`` is not passed, see ``build_attention``).
        proj_drop: dropout after ``proj``.
        window_size: ``None`` (global) or the window side.
        shift: shifted windows (odd blocks); a single window (always the case for
            ``window_size=None``) is never shifted.
        focusing_factor: focusing power ``p``.
        kernel_size: DWC kernel size.
        pretrain_hw_shape: stage grid at the pretraining resolution (global mode).
        pe_interp_mode: ``'bilinear'`` or ``'bicubic'``.
        use_triton: fused Triton kernels (``None`` auto, ``True``, ``False``).
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 window_size: Optional[int] = None,
                 shift: bool = False,
                 focusing_factor: int = 3,
                 kernel_size: int = 5,
                 pretrain_hw_shape: Tuple[int, int] = (56, 56),
                 pe_interp_mode: str = 'bilinear',
                 use_triton: Optional[bool] = None) -> None:
        if attn_drop != 0:
            raise NotImplementedError(
                'FocusedLinearAttentionQKV has no attention-map dropout '
                f'(got attn_drop={attn_drop} '
                "in its attn_cfg); a backbone's attn_drop_rate only reaches operators with one")
        if window_size is not None and (not isinstance(window_size, int) or window_size < 1):
            raise ValueError(f'window_size must be None or a positive int, got {window_size!r}')
        region = pretrain_hw_shape if window_size is None else (window_size, window_size)
        super().__init__(embed_dims, num_heads, focusing_factor=focusing_factor,
                         kernel_size=kernel_size, pretrain_hw_shape=region, lepe=False,
                         pe_interp_mode=pe_interp_mode, use_triton=use_triton)
        self.window_size = window_size
        self.shift = shift
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def attend(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """``qkv`` -> FLA -> ``proj`` on tokens ``(B, N, C)`` of one region ``hw_shape``."""
        pe = self.region_pos_table(hw_shape)
        out = None
        if x.shape[1] == hw_shape[0] * hw_shape[1] and _projected_path(
                self.use_triton, None, x, self.scale, self.num_heads, self.focusing_factor, pe,
                self.qkv, self.dwc):
            # the qkv projection, DWC and core as one function, whose backward recomputes
            # q, k, v instead of keeping them
            out = _run_projected(self.use_triton, None, x, self.scale, self.num_heads,
                                 self.focusing_factor, hw_shape, pe, self.qkv, self.dwc)
        if out is None:
            qkv = self.qkv(x)
            with _projection_recomputed(qkv, x, self.qkv):
                q, k, v = qkv.chunk(3, dim=-1)
                out = self.attend_region(q, k, v, hw_shape, pe)
        return self.proj_drop(self.proj(out))

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        """Args: x ``(B, N, C)`` tokens of the ``hw_shape=(H, W)`` map. Returns ``(B, N, C)``."""
        B, N, C = x.shape
        H, W = hw_shape
        if N != H * W:
            raise ValueError(f'token count {N} does not match hw_shape {tuple(hw_shape)}')
        if self.window_size is None:
            return self.attend(x, (H, W))
        w = (self.window_size, self.window_size)
        x, pads = pad_to_multiple(x.reshape(B, H, W, C), w)
        padded = (x.shape[1], x.shape[2])
        shift = effective_shift(padded, w, (self.window_size // 2, ) * 2 if self.shift else (0, 0))
        if any(shift):
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        x = window_reverse(self.attend(window_partition(x, w), w), w, padded)
        if any(shift):
            x = torch.roll(x, shifts=shift, dims=(1, 2))
        return crop_padding(x, pads).reshape(B, N, C)

    def extra_repr(self) -> str:
        return super().extra_repr() + f', window_size={self.window_size}, shift={self.shift}'


# ----------------------------------------------------------------------------------------
# first-use check of the FLA kernels (ops.dispatch): a kernel configuration is used in auto
# mode only after its forward and backward matched this module's PyTorch path once


def _first_use_check(key: tuple, device: torch.device) -> None:
    """Run the kernels of ``key`` (``_fla_key`` / ``_projected_key``) forward and backward
    on a tiny input of the key's layouts (``specialisation.like``) spanning two token tiles
    and a ragged tail, against the PyTorch path; raise ``dispatch.KernelMismatch`` (or the
    kernels' error) if they differ."""
    fla = _kernels()
    gen = dispatch.check_generator()
    op, out_dt, prec, C, h, p = key[:6]
    tol = max(dispatch.TOLERANCES[out_dt], dispatch.TOLERANCES['tf32'] if prec == 'tf32' else 0)
    tokens = 2 * fla.tile_tokens(C, C // h) + 5  # (at least: two tiles and a ragged tail)
    scale = (0.5 * torch.randn(1, 1, C, generator=gen)).to(device).requires_grad_()
    if op == 'fla_core':
        layouts = key[6:11]  # q, k, v, k_pos, residual
        lq, lk = layouts[:2]
        B = spec.sized_like(lq[2][0], 2)
        N, n = spec.sized_like(lq[2][1], tokens), spec.sized_like(lk[2][1], tokens)
        shapes = [(B, N, C), (B, n, C), (B, n, C), (1, n, C), (B, N, C)]
        (q, k, v, pos, res), storages = spec.check_leaves(layouts, shapes, device, gen,
                                                          scales=(1, 1, 1, 0.1, 1))

        def run(use_triton):
            qq, kk, vv, pp, rr = spec.views_of((q, k, v, pos, res), storages)
            if use_triton:
                return fla.fla_core_triton(qq, kk, vv, scale, h, p, k_pos=pp, residual=rr)
            return _focused_linear_core_torch(qq, kk, vv, scale, h, p, pp, rr)
    elif op == 'fla_projected':
        lq, lx, lpos = key[6:9]
        ks, has_bias, has_dwc_bias = key[9:]
        B = spec.sized_like(lx[2][0], 2)
        # the map: 5 rows (odd, so the token count has the width's class) of a width that
        # gives two tiles and a ragged tail
        n_cls = lx[2][1]
        hw = (1, 1) if n_cls == 'one' else (5, spec.sized_like(n_cls, -(-tokens // 5)))
        N = hw[0] * hw[1]
        m = 3 if lq is None else 2
        (q, x, pos), storages = spec.check_leaves(
            (lq, lx, lpos), [(B, N, C), (B, N, C), (1, N, C)], device, gen, scales=(1, 1, 0.1))
        dt = getattr(torch, out_dt)

        def param(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device, dt).requires_grad_()

        w, dw = param(m * C, C, scale=C**-0.5), param(C, 1, ks, ks, scale=0.2)
        b = param(m * C, scale=0.1) if has_bias else None
        db = param(C, scale=0.1) if has_dwc_bias else None
        storages += [t for t in (w, b, dw, db) if t is not None]

        def run(use_triton):
            qq, xx, pp = spec.views_of((q, x, pos), storages)
            if use_triton:
                return fla.fla_projected_triton(qq, xx, w, b, scale, h, p, hw, dw, db,
                                                k_pos=pp)
            parts = F.linear(xx, w, b).split(C, dim=-1)
            img = tokens_as_map(parts[-1], hw)
            res = map_as_tokens(F.conv2d(img, dw, db, 1, ks // 2, 1, C))
            return _focused_linear_core_torch(parts[0] if qq is None else qq, parts[-2],
                                              parts[-1], scale, h, p, pp, res)
    else:
        raise ValueError(f'unknown FLA kernel op {op!r}')
    dispatch.compare_paths(op, run, storages + [scale], gen, tol)



dispatch.register_first_use_check('fla', _first_use_check)

