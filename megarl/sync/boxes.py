"""Boxes: a part of a tensor as one (start, stop) pair per dimension, the unit of every weight sync plan (what a
trainer rank holds, what an engine worker reads, what one copy moves) and of the placed-write records. Pure."""
from __future__ import annotations

from typing import Optional, Sequence

Box = tuple  # ((start, stop), ...) per dimension


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def range_box(shape: Sequence[int], rng: Optional[tuple]) -> Box:
    """The box of `(dim, start, stop)` in a tensor of `shape` (None: the whole tensor)."""
    box = list(full_box(shape))
    if rng is not None:
        dim, start, stop = rng
        box[dim] = (int(start), int(stop))
    return tuple(box)


def intersect(a: Box, b: Box) -> Optional[Box]:
    # plain loops: `megarl plan` of a 235B MoE layout calls this about a million times
    out = []
    for (x0, x1), (y0, y1) in zip(a, b):
        lo, hi = (x0 if x0 > y0 else y0), (x1 if x1 < y1 else y1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def box_shape(box: Box) -> tuple:
    return tuple(hi - lo for lo, hi in box)


def relative_slices(box: Box, origin: Box) -> tuple:
    """Slices that select `box` from a tensor covering `origin` (box inside origin)."""
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(box, origin))


def split_rows(box: Box, max_numel: int) -> list:
    """Cut `box` along its first dimension longer than one into blocks of at most max_numel elements (at least one
    row each)."""
    dim = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), 0)
    lo, hi = box[dim]
    row = box_numel(box) // (hi - lo)
    step = max(1, max_numel // max(1, row))
    return [box[:dim] + ((s, min(s + step, hi)),) + box[dim + 1:] for s in range(lo, hi, step)]
