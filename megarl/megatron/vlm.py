"""Qwen2.5-VL and Qwen3-VL on megatron-core: the vision towers and patch mergers, M-RoPE positions, and the forward
that joins them.

    model = build_gpt_model(spec)            # spec.vision set: a GPTModel with M-RoPE, `vision_model` on stage 0
    logits = vl_logits(model, input_ids, pixel_values, image_grid_thw)     # [B, S, padded vocab / TP]

The language model is megatron-core's GPTModel with position_embedding_type "mrope" (MultimodalRotaryEmbedding: each
head's rotary frequency pairs split in `mrope_section` sections that rotate by the temporal, height and width
position). The vision tower (`Qwen25VisionTower`, attached to the GPTModel of the first pipeline stage as
`vision_model`) is replicated on every tensor-parallel rank: every rank computes the same image embeddings.

The tower, as Qwen2.5-VL defines it: a patch embedding (a Conv3d whose kernel equals its stride: one matrix product
with each flattened 3 x 2 x 14 x 14 patch), `depth` pre-norm blocks (RMSNorm, attention with q/k/v bias and a 2D
rotary embedding, RMSNorm, SwiGLU MLP with biases) and the patch merger (RMSNorm, then the 2 x 2 neighbouring patches
of a merged token concatenated and sent through Linear-GELU-Linear to the language model's width). Attention runs
within windows of window_size pixels (blocks not in fullatt_block_indexes) or over each whole frame; the patches are
reordered window by window before the blocks and the merged tokens put back in raster order after the merger.

Qwen3-VL's tower (`Qwen3VisionTower`) differs: the patch embedding has a bias and adds a learned position embedding
(a side x side table resampled bilinearly, corners aligned, to each image's patch grid); its blocks use LayerNorm and a
GELU MLP (linear_fc1, linear_fc2) and attend over each whole frame (no windows); its mergers use LayerNorm, and the
DeepStack mergers (LayerNorm after the 2 x 2 patches are joined) turn the output of blocks deepstack_visual_indexes
into features added to the output of language-model layers 0, 1, ... at the image tokens (deepstack_added). Its
language model rotates by interleaved M-RoPE (InterleavedMRoPE).

Positions (mrope_positions, the same for both on images): text tokens count up on all three axes; the merged tokens of
an image of t x h x w merged cells starting at position p get (p + frame, p + row, p + column), and the text after it
resumes at p + max(h, w).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megarl.bridge.hf_config import VisionSpec


# ---- positions --------------------------------------------------------------------------------------------------
def mrope_positions(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], vision: VisionSpec
                    ) -> torch.Tensor:
    """M-RoPE positions [3, B, S] (temporal, height, width) of input_ids [B, S] whose image placeholder runs hold
    t*h*w / merge**2 tokens for the images of image_grid_thw [images, 3] (patch grids), taken in row-major order.

    ValueError when the placeholders and the grids disagree (a shifted or missing placeholder would otherwise put
    image embeddings on the wrong tokens)."""
    b, s = input_ids.shape
    m = vision.spatial_merge_size
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw.tolist()]
    out = torch.empty(3, b, s, dtype=torch.long)
    used = 0
    for row in range(b):
        ids = input_ids[row].tolist()
        if vision.video_token_id in ids:
            raise ValueError(f"row {row}: video placeholders (token {vision.video_token_id}) are not supported yet")
        pos, i = 0, 0
        while i < s:
            if ids[i] != vision.image_token_id:
                out[:, row, i] = pos
                pos += 1
                i += 1
                continue
            if used == len(grids):
                raise ValueError(f"row {row}, column {i}: an image placeholder beyond the {len(grids)} images of "
                                 "image_grid_thw")
            t, h, w = grids[used][0], grids[used][1] // m, grids[used][2] // m
            n = t * h * w
            if ids[i:i + n] != [vision.image_token_id] * n:
                raise ValueError(f"row {row}, column {i}: image {used} has {n} merged tokens ({t} x {h} x {w}) but "
                                 f"the placeholder run there is shorter")
            frame, r, c = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            out[:, row, i:i + n] = torch.stack([frame, r, c]).reshape(3, n) + pos
            pos += max(h, w)
            i += n
            used += 1
    if used != len(grids):
        raise ValueError(f"input_ids hold placeholders for {used} images but image_grid_thw describes {len(grids)}")
    return out


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) [N, 2] of each patch in pixel_values' order: per image and frame, merged cells in raster order,
    the merge x merge patches of a cell in raster order within it."""
    out = []
    for t, h, w in grid_thw.tolist():
        cell_r, cell_c, r, c = torch.meshgrid(torch.arange(h // merge), torch.arange(w // merge), torch.arange(merge),
                                              torch.arange(merge), indexing="ij")
        rc = torch.stack([cell_r * merge + r, cell_c * merge + c], dim=-1).reshape(-1, 2)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def window_order(grid_thw: torch.Tensor, vision: VisionSpec) -> tuple:
    """(order [cells], window lengths in patches): the merged cells window by window (per image and frame, windows of
    k x k cells in raster order, k = window_size // patch_size // merge, cut short at the right and bottom edges; the
    cells of a window in raster order), and each window's patch count."""
    m = vision.spatial_merge_size
    k = vision.window_size // vision.patch_size // m
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        cells = torch.arange(t * gh * gw).reshape(t, gh, gw) + offset
        for f in range(t):
            for r0 in range(0, gh, k):
                for c0 in range(0, gw, k):
                    window = cells[f, r0:r0 + k, c0:c0 + k].reshape(-1)
                    order.append(window)
                    lengths.append(window.numel() * vision.merge_unit)
        offset += t * gh * gw
    return torch.cat(order), lengths


def frame_lengths(grid_thw: torch.Tensor) -> list:
    """Patches of each frame of each image: the full-attention segments."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


# ---- the vision towers --------------------------------------------------------------------------------------------
def _vision_inv_freq(v: VisionSpec) -> torch.Tensor:
    d = v.head_dim // 2  # rows take half of each head's rotary pairs, columns the other half
    return 1.0 / (v.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _patch_angles(grid_thw: torch.Tensor, v: VisionSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary angles [N, head_dim] of the patches in pixel_values' order: rows' angles then columns', twice (halves)."""
    angles = patch_positions(grid_thw, v.spatial_merge_size).to(inv_freq.device, torch.float32)[..., None] * inv_freq
    angles = angles.reshape(angles.shape[0], -1)  # [N, head_dim / 2]
    return torch.cat([angles, angles], dim=-1)


def _check_pixels(pixel_values: torch.Tensor, grid_thw: torch.Tensor, v: VisionSpec) -> None:
    if pixel_values.shape != (int(grid_thw.prod(-1).sum()), v.patch_dim):
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; image_grid_thw {grid_thw.tolist()} "
                         f"implies ({int(grid_thw.prod(-1).sum())}, {v.patch_dim})")


class _RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Holder(torch.nn.Module):
    """A parameter holder (the patch embedding's Conv3d weight, kept in its checkpoint shape)."""

    def __init__(self, shape: tuple, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype))


class _Attention(torch.nn.Module):
    def __init__(self, v: VisionSpec, dtype):
        super().__init__()
        self.heads, self.head_dim = v.num_heads, v.head_dim
        self.qkv = torch.nn.Linear(v.hidden_size, 3 * v.hidden_size, bias=True, dtype=dtype)
        self.proj = torch.nn.Linear(v.hidden_size, v.hidden_size, bias=True, dtype=dtype)

    def forward(self, x, cos, sin, segments):
        """x [N, hidden], cos/sin [N, head_dim], segments: lengths of the runs of x that attend among themselves."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)  # each [N, heads, head_dim]
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        outs = []
        for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments)):
            o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                               scale=self.head_dim ** -0.5)
            outs.append(o.transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


def _rotate(t, cos, sin):
    """Rotary embedding over halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); t [N, heads, d], cos/sin [N, d]."""
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos[:, None] + rotated * sin[:, None]


class _MLP(torch.nn.Module):
    def __init__(self, v: VisionSpec, dtype):
        super().__init__()
        self.gate_proj = torch.nn.Linear(v.hidden_size, v.intermediate_size, bias=True, dtype=dtype)
        self.up_proj = torch.nn.Linear(v.hidden_size, v.intermediate_size, bias=True, dtype=dtype)
        self.down_proj = torch.nn.Linear(v.intermediate_size, v.hidden_size, bias=True, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _GeluMLP(torch.nn.Module):
    """Qwen3-VL's vision MLP: linear_fc1, GELU (tanh approximation for gelu_pytorch_tanh), linear_fc2."""

    def __init__(self, v: VisionSpec, dtype):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(v.hidden_size, v.intermediate_size, bias=True, dtype=dtype)
        self.linear_fc2 = torch.nn.Linear(v.intermediate_size, v.hidden_size, bias=True, dtype=dtype)
        self.approximate = "tanh" if v.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class _Block(torch.nn.Module):
    """Pre-norm attention and MLP; RMSNorm and SwiGLU (Qwen2.5-VL) or LayerNorm and GELU (Qwen3-VL)."""

    def __init__(self, v: VisionSpec, dtype):
        super().__init__()
        if v.tower == "qwen3_vl":
            self.norm1, self.norm2 = (torch.nn.LayerNorm(v.hidden_size, eps=v.norm_eps, dtype=dtype) for _ in range(2))
            self.attn, self.mlp = _Attention(v, dtype), _GeluMLP(v, dtype)
        else:
            self.norm1, self.norm2 = (_RMSNorm(v.hidden_size, v.norm_eps, dtype) for _ in range(2))
            self.attn, self.mlp = _Attention(v, dtype), _MLP(v, dtype)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _Merger(torch.nn.Module):
    def __init__(self, v: VisionSpec, dtype):
        super().__init__()
        width = v.hidden_size * v.merge_unit
        self.ln_q = _RMSNorm(v.hidden_size, v.norm_eps, dtype)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, width, dtype=dtype), torch.nn.GELU(),
                                       torch.nn.Linear(width, v.out_hidden_size, dtype=dtype))
        self.width = width

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


def _patch_embed(v: VisionSpec, dtype, bias: bool) -> torch.nn.Module:
    """The towers' patch embedding: `proj` a [hidden, channels, temporal patch, patch, patch] convolution weight held
    as a plain tensor (applied as one matmul over flattened patches), with a bias in Qwen3-VL."""
    embed = torch.nn.Module()
    embed.proj = _Holder((v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size), dtype)
    if bias:
        embed.proj.bias = torch.nn.Parameter(torch.zeros(v.hidden_size, dtype=dtype))
    torch.nn.init.normal_(embed.proj.weight, std=0.02)
    return embed


class Qwen25VisionTower(torch.nn.Module):
    """Qwen2.5-VL's vision encoder and patch merger (module docstring); parameter names follow the checkpoint's
    `visual.*` below `vision_model.` (megarl.bridge.mapping)."""

    def __init__(self, vision: VisionSpec, dtype: torch.dtype = torch.float32):
        super().__init__()
        v = self.spec = vision
        self.patch_embed = _patch_embed(v, dtype, bias=False)
        self.blocks = torch.nn.ModuleList(_Block(v, dtype) for _ in range(v.depth))
        self.merger = _Merger(v, dtype)
        self.register_buffer("inv_freq", _vision_inv_freq(v), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, patch_dim] (the image processor's flattened patches), grid_thw [images, 3] -> merged token
        embeddings [N / merge**2, out_hidden_size] in the images' order, each image's tokens in raster order."""
        v = self.spec
        unit = v.merge_unit
        _check_pixels(pixel_values, grid_thw, v)
        weight = self.patch_embed.proj.weight
        x = F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1))  # [N, hidden]
        n = x.shape[0]
        order, windows = window_order(grid_thw, v)
        angles = _patch_angles(grid_thw, v, self.inv_freq)

        def by_window(t):
            return t.reshape(n // unit, unit, -1)[order.to(t.device)].reshape(n, -1)

        x, angles = by_window(x), by_window(angles)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        frames = frame_lengths(grid_thw)  # windows never cross frames: the reordered patches keep frame order
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in v.fullatt_block_indexes else windows)
        merged = self.merger(x)
        return merged[torch.argsort(order.to(merged.device))]

    def images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple:
        """(merged token embeddings, DeepStack features: none)."""
        return self(pixel_values, grid_thw), []


class _Qwen3Merger(torch.nn.Module):
    """LayerNorm (over each patch, or over the joined merge x merge patches: postshuffle), then Linear-GELU-Linear."""

    def __init__(self, v: VisionSpec, dtype, postshuffle: bool):
        super().__init__()
        self.width, self.postshuffle = v.hidden_size * v.merge_unit, postshuffle
        self.norm = torch.nn.LayerNorm(self.width if postshuffle else v.hidden_size, eps=1e-6, dtype=dtype)
        self.linear_fc1 = torch.nn.Linear(self.width, self.width, dtype=dtype)
        self.linear_fc2 = torch.nn.Linear(self.width, v.out_hidden_size, dtype=dtype)

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.width) if self.postshuffle else x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def resampled_positions(table: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """Qwen3-VL's learned position embeddings [N, hidden] of the patches in pixel_values' order: the side x side table
    [side**2, hidden] resampled bilinearly (corners aligned) to each image's h x w patch grid, the same for each of its
    t frames."""
    side = math.isqrt(table.shape[0])
    grid = table.t().reshape(1, -1, side, side)
    out = []
    for t, h, w in grid_thw.tolist():
        image = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
        rc = patch_positions(torch.tensor([[t, h, w]]), merge).to(table.device)
        out.append(image[:, rc[:, 0], rc[:, 1]].t())
    return torch.cat(out)


class Qwen3VisionTower(torch.nn.Module):
    """Qwen3-VL's vision encoder, patch merger and DeepStack mergers (module docstring); parameter names follow the
    checkpoint's `model.visual.*` below `vision_model.` (megarl.bridge.mapping)."""

    def __init__(self, vision: VisionSpec, dtype: torch.dtype = torch.float32):
        super().__init__()
        v = self.spec = vision
        self.patch_embed = _patch_embed(v, dtype, bias=True)
        self.pos_embed = torch.nn.Embedding(v.num_position_embeddings, v.hidden_size, dtype=dtype)
        self.blocks = torch.nn.ModuleList(_Block(v, dtype) for _ in range(v.depth))
        self.merger = _Qwen3Merger(v, dtype, postshuffle=False)
        self.deepstack_merger_list = torch.nn.ModuleList(
            _Qwen3Merger(v, dtype, postshuffle=True) for _ in v.deepstack_visual_indexes)
        self.register_buffer("inv_freq", _vision_inv_freq(v), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple:
        """pixel_values [N, patch_dim], grid_thw [images, 3] -> (merged token embeddings [N / merge**2, out_hidden],
        DeepStack features: one such tensor per deepstack_visual_indexes entry, in the order the blocks produce them,
        feeding language-model layers 0, 1, ...)."""
        v = self.spec
        _check_pixels(pixel_values, grid_thw, v)
        proj = self.patch_embed.proj
        x = F.linear(pixel_values.to(proj.weight.dtype), proj.weight.reshape(proj.weight.shape[0], -1), proj.bias)
        x = x + resampled_positions(self.pos_embed.weight, grid_thw, v.spatial_merge_size).to(x.dtype)
        angles = _patch_angles(grid_thw, v, self.inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        frames = frame_lengths(grid_thw)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in v.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[v.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack

    def images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple:
        """(merged token embeddings, DeepStack features): the forward's."""
        return self(pixel_values, grid_thw)


VISION_TOWERS = {"qwen2_5_vl": Qwen25VisionTower, "qwen3_vl": Qwen3VisionTower}


def vision_tower(vision: VisionSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The vision tower of a VisionSpec (by its tower kind)."""
    return VISION_TOWERS[vision.tower](vision, dtype)


# ---- Qwen3-VL's language-model side ---------------------------------------------------------------------------------
def interleaved_axes(mrope_section, pairs: int) -> torch.Tensor:
    """Qwen3-VL's position axis [pairs] (0 temporal, 1 height, 2 width) of each rotary frequency pair: pair i takes
    height when i % 3 == 1 and i < 3 x section[1], width when i % 3 == 2 and i < 3 x section[2], else temporal."""
    i = torch.arange(pairs)
    axes = torch.zeros(pairs, dtype=torch.long)
    axes[(i % 3 == 1) & (i < 3 * mrope_section[1])] = 1
    axes[(i % 3 == 2) & (i < 3 * mrope_section[2])] = 2
    return axes


class InterleavedMRoPE(torch.nn.Module):
    """Stands in for megatron-core's MultimodalRotaryEmbedding (whose sections are contiguous runs of frequency
    pairs) in a Qwen3-VL GPTModel: the same call and output [S, B, 1, head_dim], each pair rotating by the position
    axis interleaved_axes gives it; the frequencies are the wrapped embedding's."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
        from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

        inv_freq = self.inner.inv_freq
        freqs = position_ids.to(inv_freq.device, torch.float32)[..., None] * inv_freq  # [3, B, S, pairs]
        axes = interleaved_axes(mrope_section, inv_freq.numel()).to(freqs.device)
        freqs = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]  # [B, S, pairs]
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [S, B, 1, head_dim]
        cp_group = cp_group if cp_group is not None else self.inner.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


# ---- the joined forward --------------------------------------------------------------------------------------------
def vl_embeddings(model, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
                  image_grid_thw: Optional[torch.Tensor], placeholders: Optional[torch.Tensor] = None) -> tuple:
    """(the decoder input [S, B, hidden] of a first-stage chunk: token embeddings with each image placeholder's
    embedding replaced by its merged image token (images and their tokens in row-major order), the DeepStack features
    [image tokens, hidden] for language-model layers 0, 1, ... (none for Qwen2.5-VL or without images)).
    placeholders [B, S] bool: which tokens are placeholders (default: every image token; a response may hold image
    tokens the model sampled, which are text)."""
    from megarl.bridge.sharding import unwrap

    chunk = unwrap(model)[0]
    if chunk.config.sequence_parallel:
        raise ValueError("vision-language models run without sequence parallelism for now (the image embeddings "
                         "are placed into the whole sequence on every TP rank)")
    emb = chunk.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
    if pixel_values is None:
        return emb, []
    vision = chunk.megarl_spec.vision
    image, deepstack = chunk.vision_model.images(pixel_values, image_grid_thw)
    mask = input_ids == vision.image_token_id if placeholders is None else placeholders  # [B, S]
    if int(mask.sum()) != image.shape[0]:
        raise ValueError(f"input_ids hold {int(mask.sum())} image placeholders but the images give {image.shape[0]} "
                         "merged tokens")
    rows = emb.transpose(0, 1).clone()  # [B, S, H]: placeholders are filled row by row, as the images come
    rows[mask] = image.to(rows.dtype)
    return rows.transpose(0, 1).contiguous(), deepstack


@contextlib.contextmanager
def deepstack_added(model, mask: torch.Tensor, features: list):
    """While inside: the output hidden states [S, B, H] of global language-model layer i (i < len(features)) of this
    first-stage chunk get features[i] [image tokens, H] added at the image tokens mask [B, S], as Qwen3-VL's DeepStack
    does. ValueError when some of those layers are on a later pipeline stage (only the first holds the vision tower)."""
    from megarl.bridge.sharding import unwrap

    if not features:
        yield
        return
    chunk = unwrap(model)[0]
    layers = {layer.layer_number - 1: layer for layer in chunk.decoder.layers}
    if any(i not in layers for i in range(len(features))):
        raise ValueError(f"DeepStack feeds language-model layers 0..{len(features) - 1}, but this first pipeline "
                         f"stage holds layers {sorted(layers)}; put at least {len(features)} layers on it")

    def hook(feature):
        def add(module, inputs, output):
            hidden, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
            rows = hidden.transpose(0, 1).clone()  # [B, S, H]
            rows[mask] = rows[mask] + feature.to(rows.dtype)
            hidden = rows.transpose(0, 1).contiguous()
            return hidden if rest is None else (hidden, *rest)
        return add

    handles = [layers[i].register_forward_hook(hook(f)) for i, f in enumerate(features)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def vl_logits(model, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
              image_grid_thw: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None
              ) -> Optional[torch.Tensor]:
    """Logits [B, S, padded vocab / TP] (this TP rank's vocabulary shard) on the last pipeline stage (None on the
    others) of unpadded rows input_ids [B, S] with their images, one micro-batch through megatron's pipeline schedule
    (forward only); positions [3, B, S] default to mrope_positions. Call on every rank of the model-parallel group.

    Every stage computes the rotary embedding from the same positions; the first stage builds the decoder input from
    the token embeddings and the vision tower's image embeddings (vl_embeddings) and adds Qwen3-VL's DeepStack
    features after its first layers (deepstack_added)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.bridge.sharding import unwrap
    from megarl.megatron.layer_spec import mark_causal
    from megarl.megatron.parallel import schedule_args

    chunks = unwrap(model)
    if len(chunks) > 1:
        raise ValueError("vision-language models run without virtual pipeline stages for now")
    chunk = chunks[0]
    vision = chunk.megarl_spec.vision
    device = chunk.decoder.final_layernorm.weight.device if chunk.post_process else next(chunk.parameters()).device
    input_ids = input_ids.to(device)
    if positions is None:
        positions = mrope_positions(input_ids.cpu(), image_grid_thw, vision)
    positions = positions.to(device)
    pixels = None if pixel_values is None else pixel_values.to(device)
    s = input_ids.shape[1]  # the causal mask megarl.megatron.forward.causal_inputs makes (that module imports this)
    mask = mark_causal(torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s))

    def step(data_iterator, m):
        next(data_iterator)
        decoder_input, deepstack = vl_embeddings(chunk, input_ids, pixels, image_grid_thw) if chunk.pre_process \
            else (None, [])
        with deepstack_added(chunk, input_ids == vision.image_token_id, deepstack):
            out = m(input_ids=input_ids, position_ids=positions, attention_mask=mask, decoder_input=decoder_input)
        return out, lambda output: (torch.zeros((), device=output.device), {"out": output.detach()})

    chunk.config.variable_seq_lengths = False
    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=step, **schedule_args(chunks, [None]), num_microbatches=1, forward_only=True,
            seq_length=input_ids.shape[1], micro_batch_size=input_ids.shape[0])
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return results[0]["out"]


# ---- packed micro-batches (the trainer's THD path) ----------------------------------------------------------------
def row_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> tuple:
    """(pixel_values [patches, patch_dim] of every image of the rows in row order, image_grid_thw [images, 3],
    per-row grids: a list of [k_r, 3]) from the batch's per-row padded tensors pixel_values [b, P_max, patch_dim] and
    image_grid_thw [b, I_max, 3] (a row's images first, grid rows of zeros after them; its patches first, zeros
    after them)."""
    pixels, grids = [], []
    for r in range(image_grid_thw.shape[0]):
        g = image_grid_thw[r]
        g = g[g[:, 0] > 0]
        grids.append(g)
        pixels.append(pixel_values[r, :int(g.prod(-1).sum())])
    return torch.cat(pixels), torch.cat(grids), grids


def row_placeholders(ids: torch.Tensor, grids: Optional[torch.Tensor], vision: VisionSpec) -> torch.Tensor:
    """[n] bool: the image placeholders of one row's tokens ids [n]: its first t*h*w / merge**2 image tokens per
    image of grids [k, 3] (None: none). Image tokens after them are text (a response may sample the token)."""
    count = 0 if grids is None else int(grids.prod(-1).sum()) // vision.merge_unit
    image = ids == vision.image_token_id
    return image & (image.long().cumsum(0) <= count)


def row_mrope_positions(ids: torch.Tensor, grids: Optional[torch.Tensor], vision: VisionSpec) -> torch.Tensor:
    """M-RoPE positions [3, n] of one row's tokens ids [n] with its images' grids [k, 3] (None: none): mrope_positions
    up to the row's last image placeholder (row_placeholders), text positions counting on after it, the tokens the
    model sampled (image or video tokens among them) included."""
    n = ids.shape[0]
    marks = row_placeholders(ids, grids, vision).nonzero()
    if not len(marks):
        return torch.arange(n).expand(3, -1).clone()
    cut = int(marks[-1]) + 1
    head = mrope_positions(ids[None, :cut], grids, vision)[:, 0]
    tail = torch.arange(n - cut) + int(head.max()) + 1
    return torch.cat([head, tail.expand(3, -1)], dim=1)


def packed_mrope_positions(pack, grids: Optional[list], vision: VisionSpec) -> torch.Tensor:
    """M-RoPE positions [3, 1, P] of a pack (megarl.megatron.packing.Pack, context-parallel size 1, no shared
    prefixes): each row's row_mrope_positions over its real tokens with its own image grids (grids: one [k_r, 3] per
    row, None: no images), counting from 0 at its start as if alone; the end padding counts from 0 on all axes."""
    if pack.cp > 1 or pack.links:
        raise ValueError("vision-language packs run at context-parallel size 1 without shared prefixes")
    ids = pack.ids[0].cpu()
    out, at = [], 0
    for r, n in enumerate(pack.lengths):
        g = None if grids is None or not len(grids[r]) else grids[r].cpu()
        out.append(row_mrope_positions(ids[at:at + n], g, vision))
        at += pack.segments[r]
    if pack.pad:
        out.append(torch.arange(pack.pad).expand(3, -1))
    return torch.cat(out, dim=1).unsqueeze(1).to(pack.ids.device)


def packed_placeholders(pack, grids: Optional[list], vision: VisionSpec) -> torch.Tensor:
    """[1, P] bool: the image placeholders of a pack (row_placeholders of each row)."""
    ids = pack.ids[0].cpu()
    out = torch.zeros(ids.shape[0], dtype=torch.bool)
    at = 0
    for r, n in enumerate(pack.lengths):
        g = None if grids is None or not len(grids[r]) else grids[r].cpu()
        out[at:at + n] = row_placeholders(ids[at:at + n], g, vision)
        at += pack.segments[r]
    return out.unsqueeze(0).to(pack.ids.device)


def packed_vl_forward(model, pack, params, pixel_values: Optional[torch.Tensor] = None,
                      image_grid_thw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One pack through a vision-language GPTModel chunk (megarl.megatron.forward.packed_forward's counterpart):
    its M-RoPE positions per row (packed_mrope_positions), the first stage's decoder input with the rows' images in
    place of their placeholders (vl_embeddings over the pack: rows end to end, so the images in row order fill the
    placeholders in pack order), DeepStack features added at the image tokens. pixel_values [b, P_max, patch_dim] and
    image_grid_thw [b, I_max, 3] are the pack's rows' padded image tensors (row_images); None: text rows.
    params: megatron's PackedSeqParams of the pack."""
    from megarl.bridge.sharding import unwrap

    chunk = unwrap(model)[0]
    vision = chunk.megarl_spec.vision
    pixels = grid = grids = None
    if image_grid_thw is not None and bool((image_grid_thw[..., 0] > 0).any()):
        pixels, grid, grids = row_images(pixel_values, image_grid_thw.cpu())
        pixels = pixels.to(pack.ids.device)
    positions = packed_mrope_positions(pack, grids, vision)
    marks = packed_placeholders(pack, grids, vision)
    ids = pack.ids
    decoder_input, deepstack = vl_embeddings(chunk, ids, pixels, grid, marks) if chunk.pre_process else (None, [])
    with deepstack_added(chunk, marks, deepstack):
        return model(ids, positions, None, decoder_input=decoder_input, packed_seq_params=params)
