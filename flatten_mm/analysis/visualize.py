"""What a query token attends to, for each attention family.

* FLA (FLatten): the *effective* attention of focused linear attention. Its output for
  query ``i`` is ``sum_j a_ij v_j + DWC(V)_i`` with
  ``a_ij = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j')`` (per head, ``phi`` the
  focused kernel incl. the positional encoding added to K) -- ``fla_query_map`` returns
  ``a_i`` averaged over heads. ``fla_rank_matrices`` returns the ``N x N`` matrix ``A``
  of one head and ``A + D_c``, where ``D_c`` is the token-mixing matrix of the depth-wise
  conv for channel ``c`` (the paper's "feature diversity" figure: ``rank(A) <= d``,
  ``A + D_c`` is full rank).
* SimA: row ``i`` of ``n1(Q) n1(K)^T`` (signed; averaged over heads) and the per-token
  l2 norms of the L1-normalised queries and keys (the norm maps of the SimA paper;
  our reading of the figure, the spec has no SimA figures).
* QuadTree: the cells each level keeps for the query -- all keys of the coarsest level
  are scored, ``topk`` of them survive, their 4 children are scored at the next level,
  and so on (``quadtree_selection``, a per-query re-implementation of the selection in
  ``quadtree_attention_core``).

``visualize_attention`` runs a backbone on an image, captures the input of the chosen
attention layer and writes PNG overlays of the original image's size.
"""
import os
import os.path as osp
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.catalogue import get_backbone_spec
from ..models.layers import (CrossShapedAttention, FocusedLinearAttention,
                             FocusedLinearAttentionQKV, FocusedLinearQKV, QuadTreeAttention,
                             SimAAttention)
from ..models.layers.focused_linear_attention import focused_feature_map
from ..models.layers.pos_embed import resize_pos_table
from ..models.pretrained import load_pretrained

IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


# ------------------------------------------------------------------------------ layers
@dataclass
class AttentionLayer:
    """An attention operator of a backbone: its module name, 0-based stage and block."""

    name: str
    module: nn.Module
    stage: int
    block: int

    @property
    def kind(self) -> str:
        """``'fla'``, ``'sima'``, ``'quadtree'`` or ``'other'``."""
        if _fla_parts(self.module) is not None:
            return 'fla'
        if isinstance(self.module, SimAAttention):
            return 'sima'
        if isinstance(self.module, QuadTreeAttention):
            return 'quadtree'
        return 'other'


def find_attention_layers(backbone: nn.Module) -> List[AttentionLayer]:
    """Attention operators ``stages.<i>.blocks.<j>.attn`` (or ``blocks.<j>.attn`` for
    single-stage backbones such as SimA-XCiT, stage 0) in forward order."""
    layers = []
    for name, module in backbone.named_modules():
        m = re.fullmatch(r'(?:.*\.)?stages\.(\d+)\.blocks\.(\d+)\.attn', name)
        if m:
            layers.append(AttentionLayer(name, module, int(m.group(1)), int(m.group(2))))
            continue
        m = re.fullmatch(r'(?:.*\.)?blocks\.(\d+)\.attn', name)
        if m:
            layers.append(AttentionLayer(name, module, 0, int(m.group(1))))
    return layers


def capture_inputs(model: nn.Module, inputs: torch.Tensor,
                   modules: Sequence[nn.Module]) -> Dict[int, Tuple[torch.Tensor, tuple]]:
    """Run ``model(inputs)`` and return, per ``id(module)``, the ``(x, hw_shape)`` of its
    first call."""
    store: Dict[int, Tuple[torch.Tensor, tuple]] = {}

    def hook(mod, args, kwargs):
        if id(mod) not in store:
            x = args[0] if args else kwargs['x']
            hw = args[1] if len(args) > 1 else kwargs.get('hw_shape')
            store[id(mod)] = (x.detach(), tuple(hw))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in handles:
            h.remove()
    return store


# ------------------------------------------------------------------------------ FLA
def _fla_parts(module: nn.Module):
    """``(kind, region)`` for FLA operators over a whole map (None otherwise)."""
    if isinstance(module, FocusedLinearAttention):
        return 'pvt', module
    if isinstance(module, FocusedLinearAttentionQKV) and module.window_size is None:
        return 'qkv', module
    if (isinstance(module, CrossShapedAttention) and module.split_size is None
            and isinstance(module.branches[0], FocusedLinearQKV)):
        return 'cswin', module.branches[0]
    return None


@torch.no_grad()
def fla_features(module: nn.Module, x: torch.Tensor, hw: Tuple[int, int]):
    """``phi(Q)``, ``phi(K + PE)`` (float32, ``(B, N, C)`` / ``(B, n, C)``), ``V``, the
    key grid and the module holding ``scale`` / ``dwc`` / ``num_heads``."""
    parts = _fla_parts(module)
    if parts is None:
        raise NotImplementedError(f'{type(module).__name__} is not a global FLA operator '
                                  '(FocusedLinearAttention, FocusedLinearAttentionQKV with '
                                  'window_size=None, CrossShapedAttention(split_size=None) with '
                                  'a FocusedLinearQKV branch)')
    kind, region = parts
    if kind == 'pvt':
        q = module.q(x)
        x_kv, kv_hw = module.reduce_kv_input(x, hw)
        k, v = module.kv(x_kv).chunk(2, dim=-1)
    else:
        q, k, v = module.qkv(x).chunk(3, dim=-1)
        kv_hw = tuple(hw)
    pe = resize_pos_table(region.positional_encoding, region.pe_hw_shape, kv_hw,
                          region.pe_interp_mode)
    p = region.focusing_factor
    scale = region.scale.float()
    return (focused_feature_map(q.float(), scale, p),
            focused_feature_map((k + pe).float(), scale, p), v.float(), tuple(kv_hw), region)


@torch.no_grad()
def fla_query_map(module: nn.Module, x: torch.Tensor, hw: Tuple[int, int],
                  query: int) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """Effective attention of query token ``query`` (row-major index in ``hw``) over the
    key grid, averaged over heads (sums to 1). Returns ``(Hk, Wk)`` weights and the grid."""
    phi_q, phi_k, _, kv_hw, region = fla_features(module, x[:1], hw)
    h = region.num_heads
    d = phi_q.shape[-1] // h
    qi = phi_q[0, query].view(h, d)
    kh = phi_k[0].view(-1, h, d).transpose(0, 1)  # (h, n, d)
    w = torch.einsum('hnd,hd->hn', kh, qi)
    w = w / w.sum(dim=-1, keepdim=True)
    return w.mean(0).view(*kv_hw), kv_hw


def dwc_matrix(weight: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    """``N x N`` token-mixing matrix of a ``k x k`` kernel (zero padding ``k // 2``) on an
    ``(H, W)`` grid: ``(D v)_i = conv(v)_i``."""
    H, W = hw
    k = weight.shape[-1]
    r = k // 2
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    D = torch.zeros(H * W, H * W, dtype=weight.dtype)
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            yy, xx = ys + dy, xs + dx
            ok = (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
            D[torch.arange(H * W)[ok], (yy * W + xx)[ok]] = weight[dy + r, dx + r]
    return D


@torch.no_grad()
def fla_rank_matrices(module: nn.Module, x: torch.Tensor, hw: Tuple[int, int],
                      head: int = 0, channel: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``A`` (row-normalised ``phi(Q_h) phi(K_h)^T``, ``N x N``) of one head and
    ``A + D_c`` (the DWC of head channel ``channel`` as a token-mixing matrix), float64.

    Raises:
        NotImplementedError: keys on a reduced grid (``sr_ratio > 1``), where DWC acts on
            interpolated values.
    """
    phi_q, phi_k, _, kv_hw, region = fla_features(module, x[:1], hw)
    if tuple(kv_hw) != tuple(hw):
        raise NotImplementedError('rank matrices need keys on the query grid (sr_ratio 1)')
    h = region.num_heads
    d = phi_q.shape[-1] // h
    q = phi_q[0].view(-1, h, d)[:, head].double()
    k = phi_k[0].view(-1, h, d)[:, head].double()
    A = q @ k.T
    A = A / A.sum(dim=-1, keepdim=True)
    D = dwc_matrix(region.dwc.weight[channel, 0].double(), hw)
    return A, A + D


# ------------------------------------------------------------------------------ SimA
@torch.no_grad()
def sima_normalised_qk(module: SimAAttention, x: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """L1-normalised (over tokens) ``Q``, ``K`` of the first image, ``(h, N, d)``."""
    B, N, C = x.shape
    qkv = module.qkv(x[:1].float()).reshape(1, N, 3, module.num_heads, module.head_dims)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4)[:, 0].unbind(0)
    return F.normalize(q, p=1.0, dim=-2), F.normalize(k, p=1.0, dim=-2)


def sima_query_map(module: SimAAttention, x: torch.Tensor, hw: Tuple[int, int],
                   query: int) -> torch.Tensor:
    """Row ``query`` of ``n1(Q) n1(K)^T`` averaged over heads, ``(H, W)`` (signed)."""
    q, k = sima_normalised_qk(module, x)
    return torch.einsum('hd,hnd->hn', q[:, query], k).mean(0).view(*hw)


def sima_norm_maps(module: SimAAttention, x: torch.Tensor, hw: Tuple[int, int]
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token l2 norms of the L1-normalised queries and keys (mean over heads)."""
    q, k = sima_normalised_qk(module, x)
    return q.norm(dim=-1).mean(0).view(*hw), k.norm(dim=-1).mean(0).view(*hw)


# ------------------------------------------------------------------------------ QuadTree
@dataclass
class LevelSelection:
    """Cells of one pyramid level for one query.

    Attributes:
        level: 0 = coarsest.
        grid: ``(h_l, w_l)`` of the level.
        cell: size of a level cell in stage-map tokens (``2 ** (S - 1 - level)``).
        candidates: ``(heads, M)`` flat indices scored at this level (all keys at level 0).
        weights: ``(heads, M)`` attention weights of the candidates.
        selected: ``(heads, K)`` indices passed on to the next level (``None`` at the
            finest level, where every candidate is attended).
    """

    level: int
    grid: Tuple[int, int]
    cell: int
    candidates: torch.Tensor
    weights: torch.Tensor
    selected: Optional[torch.Tensor]


@torch.no_grad()
def quadtree_selection(module: QuadTreeAttention, x: torch.Tensor, hw: Tuple[int, int],
                       query_yx: Tuple[int, int]) -> List[LevelSelection]:
    """Coarse-to-fine key selection of QuadTree attention for one query of the stage map.

    Args:
        module: the operator.
        x: ``(B, N, C)`` its input tokens (first image used).
        hw: ``(H, W)`` of the map.
        query_yx: query position on the (unpadded) map.

    Returns:
        One ``LevelSelection`` per level, coarsest first.
    """
    B, N, C = x.shape
    H, W = hw
    S, h = module.num_levels, module.num_heads
    d = C // h
    f = module.size_divisor
    x_map = x[:1].float().transpose(1, 2).reshape(1, C, H, W)
    x_map = F.pad(x_map, (0, (-W) % f, 0, (-H) % f))
    q = F.conv2d(x_map, module.q_proj.weight.float(), _bias(module.q_proj))
    k = F.conv2d(x_map, module.k_proj.weight.float(), _bias(module.k_proj))
    qs, ks = [q], [k]
    for _ in range(S - 1):
        qs.append(F.avg_pool2d(qs[-1], 2, 2))
        ks.append(F.avg_pool2d(ks[-1], 2, 2))
    qs, ks = qs[::-1], ks[::-1]  # coarsest first
    temp = d**-0.5
    y, xq = query_yx
    out: List[LevelSelection] = []
    prev_sel = prev_score = None
    for lvl in range(S):
        hl, wl = qs[lvl].shape[-2:]
        shift = S - 1 - lvl
        anc = (y >> shift) * wl + (xq >> shift)  # the query's ancestor at this level
        qv = qs[lvl][0].reshape(h, d, hl * wl)[:, :, anc]  # (h, d)
        keys = ks[lvl][0].reshape(h, d, hl * wl).transpose(1, 2)  # (h, L, d)
        if lvl == 0:
            cand = torch.arange(hl * wl).expand(h, -1)
            scores = torch.einsum('hd,hld->hl', qv, keys) * temp
            weights = scores.softmax(-1)
        else:
            pw = wl // 2
            py, px = prev_sel // pw, prev_sel % pw
            base = 2 * py * wl + 2 * px  # (h, Kp)
            offs = torch.tensor([0, 1, wl, wl + 1])
            cand = (base[..., None] + offs).reshape(h, -1)  # parent-major, child-minor
            scores = torch.einsum('hd,hmd->hm', qv,
                                  keys.gather(1, cand[..., None].expand(-1, -1, d))) * temp
            if module.attn_type == 'B':
                weights = scores.softmax(-1)
            else:  # A: softmax over each parent's 4 children, times the parent's score
                weights = (scores.view(h, -1, 4).softmax(-1) * prev_score[..., None]).view(h, -1)
        final = lvl == S - 1
        sel = None
        if not final or (S == 1 and module.attn_type == 'A'):
            topk = min(module.topks[lvl], weights.shape[-1])
            prev_score, idx = weights.topk(topk, dim=-1)
            sel = cand.gather(1, idx)
            prev_sel = sel
        out.append(LevelSelection(lvl, (hl, wl), 2**shift, cand, weights, sel))
    return out


def _bias(conv: nn.Conv2d):
    return None if conv.bias is None else conv.bias.float()


# ------------------------------------------------------------------------------ rendering
def load_image(path: str, size: int = 448) -> Tuple[np.ndarray, torch.Tensor]:
    """Read an RGB image; returns it (``uint8 (H0, W0, 3)``) and the normalised model
    input ``(1, 3, h, w)``: short side resized to ``size``, both sides rounded to a
    multiple of 32."""
    from PIL import Image
    img = np.array(Image.open(path).convert('RGB'))
    return img, image_to_input(img, size)


def image_to_input(img: np.ndarray, size: int) -> torch.Tensor:
    H0, W0 = img.shape[:2]
    s = size / min(H0, W0)
    h = max(32, int(round(H0 * s / 32)) * 32)
    w = max(32, int(round(W0 * s / 32)) * 32)
    t = torch.from_numpy(img).permute(2, 0, 1)[None].float()
    t = F.interpolate(t, size=(h, w), mode='bilinear', align_corners=False)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (t - mean) / std


def overlay(img: np.ndarray, heat: torch.Tensor, cmap: str = 'jet', alpha: float = 0.5,
            signed: bool = False, marker: Optional[Tuple[float, float]] = None,
            boxes: Sequence[Tuple[float, float, float, float, float]] = ()) -> np.ndarray:
    """Blend a heat map (any grid; stretched over the whole image) onto ``img``.

    Args:
        img: ``uint8 (H0, W0, 3)``.
        heat: ``(h, w)`` values.
        cmap: matplotlib colormap.
        alpha: heat-map opacity.
        signed: centre the colour scale at 0 (diverging maps).
        marker: ``(x, y)`` image position of the query, drawn as a cross.
        boxes: ``(x0, y0, x1, y1, strength)`` rectangles (image pixels) outlined.

    Returns:
        ``uint8 (H0, W0, 3)``.
    """
    import matplotlib
    H0, W0 = img.shape[:2]
    hmap = F.interpolate(heat.float()[None, None], size=(H0, W0), mode='nearest')[0, 0]
    if signed:
        m = float(hmap.abs().max()) or 1.0
        hmap = (hmap / m + 1) / 2
    else:
        lo, hi = float(hmap.min()), float(hmap.max())
        hmap = (hmap - lo) / (hi - lo) if hi > lo else torch.zeros_like(hmap)
    colours = matplotlib.colormaps[cmap](hmap.numpy())[..., :3] * 255
    out = (1 - alpha) * img.astype(np.float64) + alpha * colours
    for x0, y0, x1, y1, strength in boxes:
        _rectangle(out, x0, y0, x1, y1, (255 * strength, 255, 255 * (1 - strength)))
    if marker is not None:
        _cross(out, marker)
    return np.clip(out, 0, 255).astype(np.uint8)


def _rectangle(arr: np.ndarray, x0, y0, x1, y1, colour, width: int = 2) -> None:
    H, W = arr.shape[:2]
    x0, x1 = int(max(0, x0)), int(min(W - 1, x1))
    y0, y1 = int(max(0, y0)), int(min(H - 1, y1))
    arr[y0:y0 + width, x0:x1 + 1] = colour
    arr[max(y1 - width + 1, 0):y1 + 1, x0:x1 + 1] = colour
    arr[y0:y1 + 1, x0:x0 + width] = colour
    arr[y0:y1 + 1, max(x1 - width + 1, 0):x1 + 1] = colour


def _cross(arr: np.ndarray, xy: Tuple[float, float], size: int = 8) -> None:
    H, W = arr.shape[:2]
    x, y = int(round(xy[0])), int(round(xy[1]))
    for c, w in (((255, 255, 255), 3), ((0, 0, 0), 1)):
        arr[max(0, y - w // 2):y + w // 2 + 1, max(0, x - size):min(W, x + size + 1)] = c
        arr[max(0, y - size):min(H, y + size + 1), max(0, x - w // 2):x + w // 2 + 1] = c


def save_png(arr: np.ndarray, path: str) -> str:
    from PIL import Image
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    Image.fromarray(arr).save(path, format='PNG')
    return path


def rank_plot(A: torch.Tensor, AD: torch.Tensor, path: str, title: str = '') -> str:
    """Three panels: ``A``, ``A + D`` (as images) and their normalised singular values,
    with the numerical ranks."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    sa = torch.linalg.svdvals(A)
    sd = torch.linalg.svdvals(AD)
    ra, rd = int(torch.linalg.matrix_rank(A)), int(torch.linalg.matrix_rank(AD))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, M, name in ((axes[0], A, f'FLA without DWC (rank {ra})'),
                        (axes[1], AD, f'FLA with DWC (rank {rd})')):
        ax.imshow(M.numpy(), cmap='viridis')
        ax.set_title(name)
        ax.set_xlabel('key token')
        ax.set_ylabel('query token')
    axes[2].semilogy((sa / sa[0]).numpy(), label=f'without DWC, rank {ra}')
    axes[2].semilogy((sd / sd[0]).numpy(), label=f'with DWC, rank {rd}')
    axes[2].set_title(f'singular values ({A.shape[0]} tokens)')
    axes[2].set_xlabel('index')
    axes[2].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fig.savefig(path, format='png', dpi=80)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ driver
def _query_token(query_xy: Tuple[float, float], img_hw: Tuple[int, int],
                 input_hw: Tuple[int, int], grid: Tuple[int, int]) -> Tuple[int, int]:
    """Token ``(y, x)`` of the ``grid`` that covers image pixel ``query_xy``."""
    (H0, W0), (h, w) = img_hw, input_hw
    stride_y, stride_x = h / grid[0], w / grid[1]
    y = int(query_xy[1] * h / H0 / stride_y)
    x = int(query_xy[0] * w / W0 / stride_x)
    return min(max(y, 0), grid[0] - 1), min(max(x, 0), grid[1] - 1)


def build_backbone(backbone: Union[str, nn.Module], checkpoint: Optional[str] = None
                   ) -> nn.Module:
    """A catalogue backbone by name (or a module as is), optionally with a checkpoint
    converted by ``tools/convert_checkpoint.py`` (checked like ``init_cfg``: a file of
    another family / variant raises ``ValueError``)."""
    if isinstance(backbone, str):
        backbone = get_backbone_spec(backbone).build()
        backbone.init_weights()
    if checkpoint:
        load_pretrained(backbone, dict(type='Pretrained', checkpoint=checkpoint))
    return backbone.eval()


def visualize_attention(image: Union[str, np.ndarray], backbone: Union[str, nn.Module],
                        out_dir: str, checkpoint: Optional[str] = None, stage: int = 1,
                        block: int = 0, query_xy: Optional[Tuple[float, float]] = None,
                        size: int = 448, rank_size: Optional[int] = None) -> List[str]:
    """Write the PNGs for the attention layer ``(stage, block)`` (1-based stage; SimA-XCiT
    has a single stage) of ``backbone`` on ``image``.

    Args:
        image: path or ``uint8 (H0, W0, 3)`` RGB array.
        backbone: catalogue name or a built backbone.
        out_dir: output folder (created).
        checkpoint: converted checkpoint to load into a named backbone.
        stage: 1-based stage of the layer.
        block: 0-based block in the stage (negative counts from the end).
        query_xy: query pixel ``(x, y)`` of the original image (default: centre).
        size: short side of the model input.
        rank_size: side of the square input of the rank plot (FLA); default
            ``14 * stride``, i.e. a 14x14 token grid (196 tokens, the size of the
            paper's figure).

    Returns:
        Paths of the written PNGs (all of the original image's size, except the rank
        plot, a matplotlib figure).
    """
    if isinstance(image, str):
        from PIL import Image
        image = np.array(Image.open(image).convert('RGB'))
    model = build_backbone(backbone, checkpoint)
    layers = [la for la in find_attention_layers(model) if la.stage == stage - 1]
    if not layers:
        stages = sorted({la.stage + 1 for la in find_attention_layers(model)})
        raise ValueError(f'no attention layers in stage {stage}; stages: {stages}')
    layer = layers[block]
    H0, W0 = image.shape[:2]
    query_xy = query_xy or (W0 / 2, H0 / 2)
    inputs = image_to_input(image, size)
    x, hw = capture_inputs(model, inputs, [layer.module])[id(layer.module)]
    input_hw = tuple(inputs.shape[-2:])
    qy, qx = _query_token(query_xy, (H0, W0), input_hw, hw)
    query = qy * hw[1] + qx
    tag = f's{stage}b{layer.block}'
    os.makedirs(out_dir, exist_ok=True)
    written = []
    kind = layer.kind
    if kind == 'fla':
        heat, _ = fla_query_map(layer.module, x, hw, query)
        written.append(save_png(overlay(image, heat, marker=query_xy),
                                osp.join(out_dir, f'fla_map_{tag}.png')))
        stride = round(input_hw[0] / hw[0])
        rank_size = rank_size or 14 * stride
        small = F.interpolate(inputs, size=(rank_size, rank_size), mode='bilinear',
                              align_corners=False)  # square: a 14x14 grid by default
        xs, hws = capture_inputs(model, small, [layer.module])[id(layer.module)]
        A, AD = fla_rank_matrices(layer.module, xs, hws)
        written.append(rank_plot(A, AD, osp.join(out_dir, f'fla_rank_{tag}.png'),
                                 title=f'{layer.name}, head 0, DWC channel 0'))
    elif kind == 'sima':
        written.append(save_png(
            overlay(image, sima_query_map(layer.module, x, hw, query), cmap='bwr', signed=True,
                    marker=query_xy), osp.join(out_dir, f'sima_map_{tag}.png')))
        qn, kn = sima_norm_maps(layer.module, x, hw)
        written.append(save_png(overlay(image, qn), osp.join(out_dir, f'sima_qnorm_{tag}.png')))
        written.append(save_png(overlay(image, kn), osp.join(out_dir, f'sima_knorm_{tag}.png')))
    elif kind == 'quadtree':
        sy, sx = H0 / hw[0], W0 / hw[1]  # image pixels per stage token
        for sel in quadtree_selection(layer.module, x, hw, (qy, qx)):
            heat = torch.zeros(sel.grid[0] * sel.grid[1])
            heat.scatter_reduce_(0, sel.candidates.reshape(-1), sel.weights.reshape(-1),
                                 reduce='amax')
            kept = sel.selected if sel.selected is not None else sel.candidates
            boxes = []
            cell_y, cell_x = sel.cell * sy, sel.cell * sx
            for idx in kept.unique().tolist():
                cy, cx = divmod(idx, sel.grid[1])
                boxes.append((cx * cell_x, cy * cell_y, (cx + 1) * cell_x - 1,
                              (cy + 1) * cell_y - 1, 1.0))
            written.append(save_png(
                overlay(image, heat.view(*sel.grid), marker=query_xy, boxes=boxes),
                osp.join(out_dir, f'quadtree_level{sel.level}_{tag}.png')))
    else:
        raise NotImplementedError(f'{type(layer.module).__name__} ({layer.name}): maps are '
                                  'implemented for FLA, SimA and QuadTree attention')
    return written
