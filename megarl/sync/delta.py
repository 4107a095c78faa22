"""Delta weight updates for engines reached over the network (megarl.sync.transports.remote): only the elements that
changed.

After an optimizer step in bf16 most elements of a weight round to the value they had (a step moves them by far less
than one bf16 ulp), so the engine already holds them. The sender keeps what it last sent of each piece, in the wire
dtype (the engine's); at the next update it sends, per piece, either the flat indices and values of the elements whose
bits changed or the whole piece, whichever is fewer bytes. The receiver keeps the same copy (its mirror), writes the
changes into it and hands the whole piece to its workers as in a full update, so the engine's weights are bit for bit
those of a full update. Both sides compare bits, not values: -0.0 vs 0.0 and NaN payloads count as changes.

A full update (every piece whole) comes first, every `full_every` updates after it, and whenever the sender is told
to (after an engine restart, whose mirror is gone).

    kind, payload = encode(piece, last)     # sender: DENSE (piece) or SPARSE (indices, values)
    apply_sparse(mirror, indices, values)   # receiver
    checksum(piece) == checksum(mirror)     # both sides after every delta update
"""
from __future__ import annotations

from typing import Optional

import torch

DENSE = -1  # a header entry: the piece follows whole; >= 0: that many (index, value) pairs follow

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements reinterpreted as integers of the same width, flat [numel] (bitwise equality)."""
    return t.reshape(-1).view(_SAME_WIDTH_INT[t.element_size()])


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices where they fit (half the bytes), else int64."""
    return torch.int32 if numel < 2 ** 31 else torch.int64


def changed_indices(piece: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Flat indices [k] of the elements of `piece` whose bits differ from `last` (same shape and dtype)."""
    if piece.shape != last.shape or piece.dtype != last.dtype:
        raise ValueError(f"delta of a piece {tuple(piece.shape)} {piece.dtype} against {tuple(last.shape)} "
                         f"{last.dtype}: the sync plan changed without a full update")
    return torch.nonzero(bits(piece) != bits(last)).reshape(-1).to(index_dtype(piece.numel()))


def pair_bytes(numel: int, element_size: int) -> int:
    """Bytes of one (index, value) pair of a piece of `numel` elements of `element_size` bytes."""
    return torch.empty((), dtype=index_dtype(numel)).element_size() + element_size


def sparse_bytes(count: int, piece: torch.Tensor) -> int:
    """Bytes of `count` (index, value) pairs of `piece`."""
    return count * pair_bytes(piece.numel(), piece.element_size())


def encode(piece: torch.Tensor, last: Optional[torch.Tensor]) -> tuple:
    """(header entry, tensors to send): (DENSE, [piece]) without a `last` or when the changes take at least as many
    bytes as the piece, else (k, [indices [k], values [k]]) (k = 0: nothing to send)."""
    if last is None:
        return DENSE, [piece]
    idx = changed_indices(piece, last)
    if sparse_bytes(idx.numel(), piece) >= piece.numel() * piece.element_size():
        return DENSE, [piece]
    if idx.numel() == 0:
        return 0, []
    return idx.numel(), [idx, piece.reshape(-1)[idx.long()].contiguous()]


def apply_sparse(mirror: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Write values [k] at flat indices [k] of the contiguous `mirror`, in place."""
    mirror.view(-1)[indices.long()] = values


def checksum(t: torch.Tensor) -> int:
    """An order-sensitive checksum of a contiguous tensor's bits: sum of bits x (position mod 65521 + 1), int64 with
    wrap-around (the same on both sides of a sync)."""
    b = bits(t).to(torch.int64)
    weights = torch.arange(b.numel(), dtype=torch.int64, device=b.device) % 65521 + 1
    return int((b * weights).sum())
