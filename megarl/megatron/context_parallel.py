"""Context parallelism (CP): every sequence split over the CP ranks of a model replica, attention kept exact.

Layout (megatron's load-balanced order, which is also Transformer Engine's THD partition): every segment of a pack
(megarl.megatron.packing: a row, or the pack's end padding) holds a multiple of 2*CP tokens. Cut into 2*CP equal
chunks, CP rank r holds chunks r and 2*CP-1-r of each segment, segments in pack order: P / CP tokens. Under causal
attention an early chunk's queries see few keys and a late chunk's many, so every rank does the same work.
megatron's rope for THD input picks each local token's position by the same rule (its cu_seqlens are the whole
pack's), so the model needs nothing else to know where its tokens sit.

Two gathers over the CP group, both exact:
- keys and values in every attention layer without Transformer Engine (`attend`): a rank's queries attend to the
  whole segment's keys up to their own position. The backward sums every rank's gradient of a key or value on the
  rank that holds it. (With Transformer Engine its own CP attention passes K/V chunks around a ring instead.)
- per-token outputs (logprobs, entropy, values) before they are read per row (`gather_tokens`): every rank of the
  replica then computes the same loss over whole rows. The backward keeps the rank's own tokens' gradient only:
  megatron's schedule multiplies a micro-batch's loss by CP and DDP averages gradients over the data-parallel x CP
  group, so what reaches the optimizer is the sum over CP ranks of their own tokens' share, the full gradient.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch

from megarl import distributed


def size() -> int:
    """The CP size of the current megatron parallel state (1 before it is set up)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_context_parallel_world_size()


def rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank() if size() > 1 else 0


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


@lru_cache(maxsize=256)
def _positions(segments: tuple, cp: int, r: int) -> torch.Tensor:
    out, start = [], 0
    for n in segments:
        if n % (2 * cp):
            raise ValueError(f"context parallelism: a segment of {n} tokens does not split into 2*CP = {2 * cp} "
                             "equal chunks (megarl.megatron.packing pads every row to a multiple of 2*CP)")
        c = n // (2 * cp)
        out += [torch.arange(start + r * c, start + (r + 1) * c),
                torch.arange(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c)]
        start += n
    return torch.cat(out)


def chunk_positions(segments, cp: int, r: int) -> torch.Tensor:
    """[P / cp] long (host): the pack positions CP rank r holds, in its own order, for a pack of `segments` (each a
    multiple of 2*cp tokens). E.g. one segment of 8 at cp 2: rank 0 holds [0, 1, 6, 7], rank 1 [2, 3, 4, 5]."""
    return _positions(tuple(int(n) for n in segments), cp, r)


def _place(parts: list, segments: tuple, cp: int) -> torch.Tensor:
    """Every rank's tokens [P / cp, ...] -> the pack [P, ...] in pack order."""
    full = parts[0].new_empty((parts[0].shape[0] * cp, *parts[0].shape[1:]))
    for r, part in enumerate(parts):
        full[chunk_positions(segments, cp, r).to(part.device)] = part
    return full


def _all_gather(x: torch.Tensor, cp: int) -> list:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp)]
    distributed.all_gather(parts, x, group=_group())
    return parts


class _Gather(torch.autograd.Function):
    """x [P / cp, ...] (this rank's tokens) -> [P, ...]. Backward: the own tokens' gradient; `summed`: every rank's
    gradient of the pack summed first (tensors every rank reads, such as keys and values), else no communication
    (per-token outputs every rank reads the same loss from)."""

    @staticmethod
    def forward(ctx, x, segments, cp, r, summed):
        ctx.own, ctx.summed = chunk_positions(segments, cp, r).to(x.device), summed
        return _place(_all_gather(x, cp), segments, cp)

    @staticmethod
    def backward(ctx, grad):
        if ctx.summed:
            grad = grad.contiguous()
            distributed.all_reduce(grad, group=_group())
        return grad[ctx.own], None, None, None, None


def gather_tokens(x: torch.Tensor, segments) -> torch.Tensor:
    """A per-token output of this rank's tokens [1, P / CP, ...] -> the whole pack's [1, P, ...] in pack order
    (unchanged at CP 1). Every rank of the replica must call it; see the module doc for its gradient."""
    cp = size()
    if cp == 1:
        return x
    return _Gather.apply(x[0], tuple(segments), cp, rank(), False).unsqueeze(0)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments,
           core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Causal attention of this rank's queries within their segments, keys and values gathered over the CP group.

    query [t, nq, hq], key [t, ng, hk], value [t, ng, hv]: this rank's t = P / CP tokens of a pack of `segments`.
    core(q [g, m, nq, hq], k [g, L, ng, hk], v [g, L, ng, hv], allowed [m, L] bool, True = may attend) ->
    [g, m, nq, hv] for g segments of length L, m = L / CP of whose queries this rank holds. Returns [t, nq, hv].
    Work per segment m * L = L^2 / CP; the gathered keys and values are the pack's, one layer at a time."""
    cp, r = size(), rank()
    segments = tuple(int(n) for n in segments)
    k = _Gather.apply(key, segments, cp, r, True)
    v = _Gather.apply(value, segments, cp, r, True)
    device = query.device
    full_starts, local_starts, groups = [], [], {}
    at_full = at_local = 0
    for i, n in enumerate(segments):
        full_starts.append(at_full)
        local_starts.append(at_local)
        groups.setdefault(n, []).append(i)
        at_full += n
        at_local += n // cp
    pieces: list = [None] * len(segments)
    for n, members in groups.items():
        m, c = n // cp, n // (2 * cp)
        # the segment positions of this rank's queries: chunks r and 2*CP-1-r
        q_pos = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
        allowed = (torch.arange(n).unsqueeze(0) <= q_pos.unsqueeze(1)).to(device)  # [m, n]
        q_idx = (torch.tensor([local_starts[i] for i in members]).unsqueeze(1) + torch.arange(m)).to(device)
        k_idx = (torch.tensor([full_starts[i] for i in members]).unsqueeze(1) + torch.arange(n)).to(device)
        out = core(query[q_idx], k[k_idx], v[k_idx], allowed)
        for j, i in enumerate(members):
            pieces[i] = out[j]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
