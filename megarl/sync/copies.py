"""The compiled copy list: where every piece a trainer rank sends lies in its own parameter, worked out once at plan
time so that an update only resolves each parameter's current storage and copies strided views of it.

A piece of an HF tensor (a move's box) is, in the megatron parameter it is cut from, a few row blocks, each a plain
strided view: the whole piece for plain, vocabulary and gate/up tensors; one block per KV group for q/k/v, whose rows
interleave in megatron's fused layout; one per row run for a rotary permutation. `compile_cuts` finds them by running
the bridge mapping once on a tensor of element positions instead of weights and reading back which positions land in
the piece, so the cut is exactly what `Mapping.shard_to_hf` would give, for every architecture, without a second
description of the layouts.

    cuts = compile_cuts(mapping, pieces)              # plan time: {(hf name, box): Cut}, once per move
    value = current_value(local, cut.param, values)   # every update: the parameter's storage as it is now
    cut.piece(value, out=destination)                 # its row blocks copied (or cut.piece(value): a view if one)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.sync.boxes import Box, box_shape, relative_slices


@dataclass(frozen=True)
class Strided:
    """A view of a contiguous tensor by element offset, sizes and strides (of that tensor's own storage)."""

    offset: int
    sizes: tuple
    strides: tuple

    def of(self, base: torch.Tensor) -> torch.Tensor:
        """This view of `base` (contiguous, laid out as the tensor the view was compiled against)."""
        return base.as_strided(self.sizes, self.strides, base.storage_offset() + self.offset)


@dataclass(frozen=True)
class Cut:
    """A piece of one megatron parameter: `param` (its name) and the piece's row blocks [(first row, end row,
    Strided)], rows counted from the piece's start along its first dimension; `shape`: the piece's shape."""

    param: str
    shape: tuple
    blocks: tuple

    def piece(self, source: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The piece from the parameter's current value `source`: a view where it is one block and no `out` is
        given, else copied into `out` (a fresh contiguous tensor of source's dtype when None)."""
        if not source.is_contiguous():  # the blocks are views of the C layout
            source = source.contiguous()
        if out is None and len(self.blocks) == 1:
            return self.blocks[0][2].of(source)
        if out is None:
            out = torch.empty(self.shape, dtype=source.dtype, device=source.device)
        for first, end, view in self.blocks:
            out[first:end].copy_(view.of(source))
        return out


@dataclass(frozen=True)
class Target:
    """Where a piece goes in a byte buffer (a bucket file): a strided view of the buffer read as `dtype`."""

    dtype: torch.dtype
    view: Strided

    def of(self, buf: torch.Tensor) -> torch.Tensor:
        return self.view.of(buf.view(self.dtype))


def region_target(offset: int, dtype: str, shape, box: Box) -> Target:
    """Piece `box` of a full-`shape` tensor laid out in C order at byte `offset` of a buffer (a bucket file's
    region, megarl.sync.wire), as a Target compiled once."""
    dt = getattr(torch, dtype)
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.insert(0, step)
        step *= int(n)
    first = offset // torch.empty((), dtype=dt).element_size() + sum(lo * st for (lo, _), st in zip(box, strides))
    return Target(dt, Strided(first, box_shape(box), tuple(strides)))


def current_value(local: dict, name: str, values: dict) -> torch.Tensor:
    """Parameter `name`'s value as it is now (local: {megatron name: LocalParam}; an offload may have moved it, LoRA
    merges into it), resolved once per bucket (`values` caches it) and contiguous: the cuts are views of its C
    layout."""
    value = values.get(name)
    if value is None:
        value = local[name].value()
        value = values[name] = value if value.is_contiguous() else value.contiguous()
    return value


def _fit(pos: torch.Tensor):
    """The (offset, strides) that give `pos` (element positions, any shape) as a strided view, or None."""
    flat = pos.reshape(-1)
    if flat.numel() == 0:
        return None
    offset = int(flat[0])
    strides = []
    for d, n in enumerate(pos.shape):
        if n == 1:
            strides.append(0)
            continue
        step = [0] * pos.dim()
        step[d] = 1
        strides.append(int(pos[tuple(step)]) - offset)
    expect = torch.full_like(pos, offset)
    for d, (n, st) in enumerate(zip(pos.shape, strides)):
        shape = [1] * pos.dim()
        shape[d] = n
        expect = expect + torch.arange(n, dtype=pos.dtype).view(shape) * st
    return (offset, tuple(strides)) if torch.equal(expect, pos) else None


def row_blocks(pos: torch.Tensor) -> tuple:
    """Element positions of a piece -> its fewest row blocks ((first, end, Strided), ...), rows along the first
    dimension: maximal runs of rows that lie at one stride from each other and share one layout."""
    if pos.numel() == 0:
        return ()
    whole = _fit(pos)
    if whole is not None:
        return ((0, int(pos.shape[0]), Strided(whole[0], tuple(pos.shape), whole[1])),)
    inner = _fit(pos[:1])
    starts = pos.reshape(pos.shape[0], -1)[:, 0]
    same_rows = torch.equal(pos - starts.view((-1,) + (1,) * (pos.dim() - 1)), (pos[:1] - starts[0]).expand_as(pos))
    if inner is None or not same_rows:
        raise ValueError(f"a piece of shape {tuple(pos.shape)} whose rows are not alike strided views of its parameter")
    starts = starts.tolist()
    blocks, first = [], 0
    while first < len(starts):
        end = first + 1
        step = starts[end] - starts[first] if end < len(starts) else 0
        while step >= 0 and end < len(starts) and starts[end] - starts[end - 1] == step:  # as_strided: no step < 0
            end += 1
        blocks.append((first, end, Strided(starts[first], (end - first,) + tuple(pos.shape[1:]),
                                           (step if end - first > 1 else 0,) + inner[1][1:])))
        first = end
    return tuple(blocks)


def compile_cuts(mapping, pieces) -> dict:
    """{(hf name, box): Cut} of this rank's pieces. pieces: [(hf name, box, holding, entry, parameter shape, tp rank,
    tp)] (box: the piece; holding: the HF chunk this rank's parameter holds, which the piece lies in). The mapping
    runs once per parameter, on a tensor of element positions."""
    by_param: dict = {}
    for piece in pieces:
        by_param.setdefault(piece[3].megatron, []).append(piece)
    cuts = {}
    for group in by_param.values():
        _, _, _, entry, shape, tp_rank, tp = group[0]
        numel = 1
        for n in shape:
            numel *= int(n)
        # the positions of the parameter's elements, cut exactly as its weights are (megarl.bridge.mapping)
        positions = torch.arange(numel, dtype=torch.int32 if numel < 2 ** 31 else torch.int64)  # half the memory
        chunks = dict(mapping.shard_to_hf(entry, positions.view(tuple(shape)), tp_rank, tp))
        for hf, box, holding, *_ in group:
            pos = chunks[hf][relative_slices(box, holding)]
            cuts[(hf, box)] = Cut(entry.megatron, tuple(pos.shape), row_blocks(pos))
    return cuts
