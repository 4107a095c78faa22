"""Context parallelism (CP): every sequence split over the CP ranks of a model replica, attention kept exact.

Layout (megatron's load-balanced order, which is also Transformer Engine's THD partition): every segment of a pack
(megarl.megatron.packing: a row, or the pack's end padding) holds a multiple of 2*CP tokens. Cut into 2*CP equal
chunks, CP rank r holds chunks r and 2*CP-1-r of each segment, segments in pack order: P / CP tokens. Under causal
attention an early chunk's queries see few keys and a late chunk's many, so every rank does the same work.
megatron's rope for THD input picks each local token's position by the same rule (its cu_seqlens are the whole
pack's), so the model needs nothing else to know where its tokens sit.

Two gathers over the CP group, both exact:
- keys and values in every attention layer without Transformer Engine (`attend`): a rank's queries attend to the
  whole segment's keys up to their own position, block by block over the chunks (`blockwise`: only the blocks a
  query chunk may see, merged by their log-sum-exp), so the work is the causal minimum, not the dense [L / CP, L].
  The backward sums every rank's gradient of a key or value on the rank that holds it. (With Transformer Engine its
  own CP attention passes K/V chunks around a ring instead.)
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


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments, core: Callable,
           pad: int = 0) -> torch.Tensor:
    """Causal attention of this rank's queries within their segments, keys and values gathered over the CP group.

    query [t, nq, hq], key [t, ng, hk], value [t, ng, hv]: this rank's t = P / CP tokens of a pack of `segments`
    followed by `pad` tokens of end padding (a last segment nobody attends: its pad / CP queries here, the last of
    the share, get 0 and its keys are never read); core(q [g, m, nq, hq], k [g, n, ng, hk], v [g, n, ng, hv],
    causal) -> (out [g, m, nq, hv], lse [g, m, nq]): the attention of g blocks and its log-sum-exp per query, float32
    or wider (`block_attention` at the layer's scale). Returns [t, nq, hv] (`blockwise`). The gathered keys and
    values are the pack's, one layer at a time."""
    cp, r = size(), rank()
    segments = tuple(int(n) for n in segments)
    whole = segments + ((pad,) if pad else ())
    if cp > 1:
        key = _Gather.apply(key, whole, cp, r, True)
        value = _Gather.apply(value, whole, cp, r, True)
    real = query.shape[0] - pad // cp
    out = blockwise(query[:real], key, value, segments, cp, r, core)
    return torch.cat([out, out.new_zeros(pad // cp, *out.shape[1:])]) if pad else out


# The diagonal of a segment is cut into at least this many causal tiles (a chunk into ceil(16 / (2 * CP))): a tile
# computes its masked upper half in vain, so the work is the causal minimum plus at most 1/16 of it.
DIAGONAL_TILES = 16
# At most this many score elements (blocks x query heads x queries x keys) in one core call: a call holds its scores
# three times over in float32 (block_attention: the scores, their difference to the peak and its exp; in backward the
# exp, its gradient and the scores' gradient), so uncut the transient grows with the square of the rows' length and
# with the rows of one length in a pack (4 rows of 4,016 tokens at CP2, 14 heads: 3 x 645 MiB). Cut, it stays at
# 3 x 64 MiB: a call splits into fewer blocks, a block too big alone into fewer query rows (megarl.plan.terms
# cp_block_scores_bytes plans it).
CALL_SCORES = 1 << 24


class _Plan:
    """The blocks CP rank r computes for a pack of `segments`, blocks of one shape as one call.

    calls: (causal, q [g, m] rank-local query rows, k [g, n] pack positions of the keys)."""

    def __init__(self, segments: tuple, cp: int, r: int, device):
        shapes: dict = {}

        def block(q0, k0, m, n, causal):
            shapes.setdefault((causal, m, n), ([], []))
            shapes[(causal, m, n)][0].append(q0)
            shapes[(causal, m, n)][1].append(k0)

        start = local = 0
        for n in segments:
            c = n // (2 * cp)
            if not c:
                continue
            tiles = min(c, -(-DIAGONAL_TILES // (2 * cp)))
            cut = [c * j // tiles for j in range(tiles + 1)]
            for j, i in enumerate((r, 2 * cp - 1 - r)):
                rows, keys = local + j * c, start + i * c  # chunk i: this rank's rows, its keys in the pack
                if i:  # the earlier chunks: every key visible to every query of the chunk
                    block(rows, start, c, i * c, False)
                for a in range(tiles):
                    m = cut[a + 1] - cut[a]
                    block(rows + cut[a], keys + cut[a], m, m, True)
                    for b in range(a):  # the chunk's own earlier tiles, whole
                        block(rows + cut[a], keys + cut[b], m, cut[b + 1] - cut[b], False)
            start += n
            local += n // cp
        self.calls = []
        for (causal, m, n), (q0, k0) in shapes.items():
            self.calls.append((causal, (torch.tensor(q0).unsqueeze(1) + torch.arange(m)).to(device),
                               (torch.tensor(k0).unsqueeze(1) + torch.arange(n)).to(device)))


@lru_cache(maxsize=256)
def _plan(segments: tuple, cp: int, r: int, device) -> _Plan:
    _positions(segments, cp, r)  # the segments' check, with its message
    return _Plan(segments, cp, r, device)


def blockwise(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments, cp: int, r: int,
              core: Callable) -> torch.Tensor:
    """Causal attention of CP rank r's queries [t, nq, hq] to the whole pack's keys [P, ng, hk] and values
    [P, ng, hv] within each segment (no communication: `attend` gathers first) -> [t, nq, hv].

    Query chunk i of a segment (chunks r and 2*CP-1-r here) sees the chunks before it whole and its own causally:
    the earlier chunks are one block without a mask, the own chunk is cut into tiles, each tile causal over itself and
    whole over the chunk's earlier tiles; later chunks are never touched. core (see `attend`) computes the blocks,
    blocks of one shape in one call, and the results merge per query by their log-sum-exp, exactly: the work is the
    causal minimum plus the tiles' upper halves (DIAGONAL_TILES). Under autograd each block is recomputed in backward,
    as a fused attention kernel does."""
    plan = _plan(tuple(int(n) for n in segments), cp, r, query.device)
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    outs, lses, where = [], [], []
    for causal, q, k in (piece for call in plan.calls for piece in _pieces(*call, query.shape[1])):
        where.append(q.reshape(-1))
        if recompute:
            # backward recomputes the block from the tensors kept anyway: kept, its scores would be L^2 / (2 * CP)
            # floats per head and layer and its key and value copies about the pack's K/V again
            from torch.utils.checkpoint import checkpoint

            out, lse = checkpoint(_block, core, query, key, value, q, k, causal, use_reentrant=False)
        else:
            out, lse = _block(core, query, key, value, q, k, causal)
        outs.append(out.reshape(-1, *out.shape[2:]))
        lses.append(lse.reshape(-1, lse.shape[-1]))
    out, lse, rows = torch.cat(outs), torch.cat(lses), torch.cat(where)
    t, heads = query.shape[0], lse.shape[-1]
    # softmax over a query's blocks with weights exp(lse - peak); the peak only keeps exp in range, so no gradient
    peak = lse.detach().new_full((t, heads), float("-inf")).scatter_reduce_(
        0, rows.unsqueeze(1).expand(-1, heads), lse.detach(), "amax")
    weight = torch.exp(lse - peak[rows])
    total = weight.new_zeros(t, heads).index_add(0, rows, weight)
    merged = out.new_zeros(t, heads, out.shape[-1]).index_add(0, rows, weight.unsqueeze(-1) * out)
    return (merged / total.unsqueeze(-1)).to(value.dtype)


def _pieces(causal: bool, q: torch.Tensor, k: torch.Tensor, heads: int):
    """A call (q [g, m], k [g, n]) cut into calls of at most CALL_SCORES score elements: runs of whole blocks, and a
    block over the limit alone cut into runs of its query rows (all its keys each; a causal tile stays whole, its
    mask needs m = n: tiles are at most a 1/16 of a segment's chunk, DIAGONAL_TILES)."""
    g, m = q.shape
    block = m * k.shape[1] * heads
    if g * block <= CALL_SCORES:
        yield causal, q, k
        return
    if block <= CALL_SCORES or causal:
        step = max(1, CALL_SCORES // block)
        for i in range(0, g, step):
            yield causal, q[i:i + step], k[i:i + step]
        return
    rows = max(1, CALL_SCORES // (k.shape[1] * heads))
    for i in range(g):
        for a in range(0, m, rows):
            yield causal, q[i:i + 1, a:a + rows], k[i:i + 1]


def _block(core, query, key, value, q, k, causal):
    return core(query[q], key[k], value[k], causal)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    dropout: float = 0.0) -> tuple:
    """softmax(scale * q k^T) v of g blocks and its log-sum-exp: the core `attend` takes, softmax in float32 (or the
    inputs' wider type).

    q [g, m, nq, hq], k [g, n, ng, hk], v [g, n, ng, hv] (GQA: query head j reads group j // (nq / ng); keys and values
    are never repeated); causal: m = n and query a sees keys 0..a. -> (out [g, m, nq, hv], lse [g, m, nq]) in the
    softmax's type. dropout: the probability of dropping an attention weight (training)."""
    g, m, nq, hq = q.shape
    n, ng, hv = k.shape[1], k.shape[2], v.shape[-1]
    rep = nq // ng
    acc = torch.promote_types(q.dtype, torch.float32)  # the softmax's precision: float32 at least
    # [g, ng, rep * m, hq]: the queries of a KV group as one matrix, so keys and values need no repeat
    qg = q.reshape(g, m, ng, rep, hq).permute(0, 2, 3, 1, 4).reshape(g, ng, rep * m, hq)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).to(acc) * scale  # [g, ng, rep * m, n]
    if causal:
        hidden = torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.view(g, ng, rep, m, n).masked_fill(hidden, float("-inf")).view(g, ng, rep * m, n)
    peak = scores.detach().amax(-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(-1, keepdim=True)
    if dropout:
        weights = torch.nn.functional.dropout(weights, dropout)
    out = torch.matmul(weights.to(v.dtype), v.permute(0, 2, 1, 3)).to(acc) / total  # [g, ng, rep * m, hv]
    lse = (peak + total.log()).view(g, ng, rep, m)
    return (out.view(g, ng, rep, m, hv).permute(0, 3, 1, 2, 4).reshape(g, m, nq, hv),
            lse.permute(0, 3, 1, 2).reshape(g, m, nq))
