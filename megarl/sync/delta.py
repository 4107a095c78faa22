"""Delta weight updates for engines reached over the network (megarl.sync.transports.remote): only the elements that
changed.

After an optimizer step in bf16 most elements of a weight round to the value they had (a step moves them by far less
than one bf16 ulp), so the engine already holds them. The sender keeps what it last sent of each piece, in the wire
dtype (the engine's), on the device or in host memory (rollout.delta_kept_on); the diff runs where that copy is. At
the next update each piece travels in whichever of these takes the fewest bytes (n elements of e bytes, k changed in
r runs, i index bytes):

    SAME     nothing changed                               0
    DENSE    the piece whole                               n e
    INDICES  flat indices [k] and values [k]               k (i + e)      few scattered changes
    MASK     a bitmask [ceil(n / 8)] and values [k]        n / 8 + k e    many scattered changes (pays up to 15/16 of
                                                                          bf16 elements changed, INDICES up to 1/3)
    RUNS     run starts [r], lengths [r] and values [k]    2 r i + k e    changes in contiguous stretches (a row)

The receiver decodes (`apply`) into its mirror, which its workers then load whole as in a full update; the sender
copies the piece into its kept copy (in place: one extra copy of what it sends, never two). A checksum of both after
the update proves the decoding gave the piece bit for bit. Bits are compared, not values: -0.0 vs 0.0 and NaN
payloads count as changes. On CPU the masks, gathers and scatters run in numpy over the same memory (several times
faster than torch's boolean indexing there); on GPU in torch.

    entry, tensors = encode(piece, last)     # sender: entry = (kind, k, r); tensors to send in order
    last.copy_(piece)                        # sender's kept copy
    payload(entry, numel, dtype)             # receiver: what to allocate for the tensors of an entry
    apply(mirror, entry, tensors)            # receiver's mirror
    checksum(last) == checksum(mirror)
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

SAME, DENSE, INDICES, MASK, RUNS = 0, 1, 2, 3, 4
KINDS = ("same", "dense", "indices", "mask", "runs")
ENTRY = 3  # int64 values per piece in a header: (kind, changed elements k, runs r)

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements reinterpreted as integers of the same width, flat [numel] (bitwise equality)."""
    return t.detach().reshape(-1).view(_SAME_WIDTH_INT[t.element_size()])


def _np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bits as a numpy array sharing its memory (numpy's masked gathers and scatters are several
    times faster than torch's on CPU)."""
    return bits(t).numpy()


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices where they fit (half the bytes), else int64."""
    return torch.int32 if numel < 2 ** 31 else torch.int64


def _isize(numel: int) -> int:
    return 4 if index_dtype(numel) == torch.int32 else 8


def changed_mask(piece: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Flat bool [n]: the elements of `piece` whose bits differ from `last` (same shape and dtype)."""
    if piece.shape != last.shape or piece.dtype != last.dtype:
        raise ValueError(f"delta of a piece {tuple(piece.shape)} {piece.dtype} against {tuple(last.shape)} "
                         f"{last.dtype}: the sync plan changed without a full update")
    last = last.to(piece.device)
    if piece.device.type == "cpu":
        return torch.from_numpy(_np(piece) != _np(last))
    return bits(piece) != bits(last)


def encoded_bytes(kind: int, numel: int, element_size: int, changed: int, runs: int) -> int:
    """Bytes on the wire of a piece of `numel` elements of `element_size` bytes, `changed` of them changed in `runs`
    contiguous runs, sent as `kind` (the table of the module docstring)."""
    i = _isize(numel)
    return {SAME: 0, DENSE: numel * element_size, INDICES: changed * (i + element_size),
            MASK: -(-numel // 8) + changed * element_size, RUNS: 2 * runs * i + changed * element_size}[kind]


def cheapest(numel: int, element_size: int, changed: int, runs: int) -> int:
    """The kind with the fewest bytes (DENSE on a tie: no decoding); SAME when nothing changed."""
    if changed == 0:
        return SAME
    return min((DENSE, INDICES, MASK, RUNS), key=lambda k: (encoded_bytes(k, numel, element_size, changed, runs), k))


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [n] -> uint8 [ceil(n / 8)], element 8 q + s in bit s of byte q."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-mask.numel()) % 8)).view(-1, 8)
    return (m << _SHIFTS.to(m.device)).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 [ceil(n / 8)] -> bool [n] (pack_mask's inverse)."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(np.bool_))
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).bool().view(-1)[:numel]


def runs_of(mask: torch.Tensor) -> tuple:
    """(starts [r], lengths [r]) of the contiguous runs of True in a bool [n], in index_dtype(n)."""
    edges = torch.diff(mask.to(torch.int8), prepend=mask.new_zeros(1, dtype=torch.int8),
                       append=mask.new_zeros(1, dtype=torch.int8))
    starts, ends = torch.nonzero(edges == 1).view(-1), torch.nonzero(edges == -1).view(-1)
    dtype = index_dtype(mask.numel())
    return starts.to(dtype), (ends - starts).to(dtype)


def run_indices(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices [sum(lengths)] covered by runs (starts [r], lengths [r])."""
    lengths, starts = lengths.long(), starts.long()
    offsets = torch.cumsum(lengths, 0) - lengths  # where each run begins among the changed elements
    within = torch.arange(int(lengths.sum()), device=starts.device) - torch.repeat_interleave(offsets, lengths)
    return torch.repeat_interleave(starts, lengths) + within


def encode(piece: torch.Tensor, last: Optional[torch.Tensor]) -> tuple:
    """(entry (kind, k, r), tensors to send in order) of a contiguous piece against what was last sent of it (None:
    DENSE). Tensors are on the piece's device; `last` may live elsewhere (it is brought to the piece)."""
    n = piece.numel()
    if last is None:
        return (DENSE, n, 0), [piece]
    mask = changed_mask(piece, last)
    cpu = piece.device.type == "cpu"
    m = mask.numpy() if cpu else mask
    k = int(np.count_nonzero(m)) if cpu else int(mask.sum())
    r = int((m[1:] & ~m[:-1]).sum()) + int(m[:1].sum()) if k else 0
    kind = cheapest(n, piece.element_size(), k, r)
    if kind == SAME:
        return (SAME, 0, 0), []
    if kind == DENSE:
        return (DENSE, k, r), [piece]
    values = torch.from_numpy(_np(piece)[m]).view(piece.dtype) if cpu else piece.reshape(-1)[mask]
    if kind == INDICES:
        idx = torch.from_numpy(np.flatnonzero(m)) if cpu else torch.nonzero(mask).view(-1)
        return (INDICES, k, r), [idx.to(index_dtype(n)), values]
    if kind == MASK:
        return (MASK, k, r), [pack_mask(mask), values]
    return (RUNS, k, r), [*runs_of(mask), values]


def payload(entry: tuple, numel: int, dtype: torch.dtype) -> list:
    """[(numel, dtype)] of the tensors that follow a header entry for a piece of `numel` elements of `dtype`."""
    kind, k, r = entry
    idx = index_dtype(numel)
    return {SAME: [], DENSE: [(numel, dtype)], INDICES: [(k, idx), (k, dtype)],
            MASK: [(-(-numel // 8), torch.uint8), (k, dtype)], RUNS: [(r, idx), (r, idx), (k, dtype)]}[kind]


def apply(mirror: torch.Tensor, entry: tuple, tensors: list) -> None:
    """Bring the contiguous `mirror` (what was last sent) to the piece `entry` and `tensors` encode, in place."""
    kind = entry[0]
    flat = mirror.view(-1)
    if kind == DENSE:
        if tensors[0].data_ptr() != mirror.data_ptr():  # received straight into the mirror: nothing to copy
            flat.copy_(tensors[0].reshape(-1))
        return
    if kind == SAME:
        return
    tensors = [t.to(mirror.device) for t in tensors]
    if kind == INDICES:
        where = tensors[0]
    elif kind == MASK:
        where = unpack_mask(tensors[0], flat.numel())
    else:
        where = run_indices(tensors[0], tensors[1])
    if mirror.device.type == "cpu":
        _np(mirror)[where.numpy()] = _np(tensors[-1])  # a view: writes into the mirror
    else:
        flat[where if where.dtype == torch.bool else where.long()] = tensors[-1]


def checksum(t: torch.Tensor) -> int:
    """An order-sensitive checksum of a contiguous tensor's bits: sum of bits x (position mod 65521 + 1), int64 with
    wrap-around (the same on both sides of a sync)."""
    b = bits(t).to(torch.int64)
    weights = torch.arange(b.numel(), dtype=torch.int64, device=b.device) % 65521 + 1
    return int((b * weights).sum())
