"""Packed micro-batches: the rows of a micro-batch laid end to end as one sequence (megatron's THD format).

Callers keep right-padded rows `tokens [b, S]`; only the model sees the pack. A pack of rows with real lengths
l_0 .. l_{b-1} holds P = sum(l_i) tokens, rounded up to `multiple` (sequence parallelism splits the pack over TP
ranks) with pad id 0 at the end of the pack only; that padding is its own segment, so no row attends to it, and nothing is
computed for it beyond the per-token layers it passes through: attention leaves it out (`attended`: its outputs are
0) and MoE routing sends it to no expert (megarl.megatron.moe_padding). The end padding can be long: the expert-
parallel ranks agree on one size per micro-batch (`agreed_sizes`) and the interleaved pipeline schedule on one size
per call (megarl.megatron.forward.schedule_shapes).
Positions restart at 0 on every row and attention never crosses a segment boundary (cu_seqlens), so every real
token's output is the one the padded batch computes there.

    ids, positions    [1, P]      the pack (batch dimension 1, as megatron's THD path wants)
    cu_seqlens        [k + 1]     int32 segment boundaries: the b rows, then the end padding when there is any (on
                                  the host: without TE only megatron's rope reads them, per layer)
    index             [b, S]      packed position of row r, column c; -1 at c >= l_r (no token computed there)

Rows that begin with the same tokens (a GRPO group's prompt) can share them (share=True,
megarl.megatron.shared_prefix): the pack then holds each group's prefix once, followed by each row's own tokens;
`links` says which piece continues which, and `index` maps every row's columns into that layout, so everything read
per row below is unchanged.

Outputs come back per row with `unpack` (zeros where nothing was computed); logprobs use `packed_labels` (the next
token of the same row) and `logprob_index` (columns 0 .. l_r - 2: the last real token predicts nothing in its row).

Context parallelism (CP > 1, megarl.megatron.context_parallel): every row's segment is padded at its end to a
multiple of 2*CP (the row's real tokens never attend to that padding, which comes after them) and the model sees this
rank's share of the pack only, `model_ids` / `model_positions` [1, P / CP]. Per-token outputs are gathered back to
the whole pack before they are read per row (row_logprobs, row_entropy, row_values), so `index` and `unpack` keep
meaning positions of the whole pack.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# the host copy of the segment lengths rides on megatron's PackedSeqParams: attention cuts segments without reading
# cu_seqlens back from the device in every layer
SEGMENTS_ATTR = "megarl_segments"
LINKS_ATTR = "megarl_links"  # and the shared-prefix links (Pack.links)
PAD_ATTR = "megarl_pad"  # and the end padding's length (Pack.pad): attention skips it


@dataclass(frozen=True)
class Pack:
    ids: torch.Tensor        # [1, P] long
    positions: torch.Tensor  # [1, P] long
    cu_seqlens: torch.Tensor  # [k + 1] int32
    index: torch.Tensor      # [b, S] long
    lengths: tuple           # (l_0, ..., l_{b-1}) real tokens per row
    segments: tuple          # segment lengths: the rows' (padded to 2*CP under CP), then the end padding's (if any)
    cp: int = 1              # context-parallel size and this rank's place in it: the model sees its share only
    cp_rank: int = 0
    links: tuple = ()        # shared prefixes: per segment the index of the prefix piece it continues, -1 for none
    pad: int = 0             # the end padding: the last segment's length when it is padding, else 0

    @property
    def size(self) -> int:
        """P: tokens computed, end padding included."""
        return int(self.ids.shape[1])

    @property
    def real(self) -> int:
        return sum(self.lengths)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's tokens of a whole-pack tensor [1, P, ...] -> [1, P / CP, ...] (x itself at CP 1)."""
        if self.cp == 1:
            return x
        from megarl.megatron.context_parallel import chunk_positions

        return x[:, chunk_positions(self.segments, self.cp, self.cp_rank).to(x.device)]

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token output of this rank's tokens [1, P / CP, ...] -> [1, P, ...], gathered over the CP group."""
        if self.cp == 1:
            return x
        from megarl.megatron.context_parallel import gather_tokens

        return gather_tokens(x, self.segments)

    @property
    def model_ids(self) -> torch.Tensor:
        """[1, P / CP]: the token ids the model computes on this rank."""
        return self.local(self.ids)

    @property
    def model_positions(self) -> torch.Tensor:
        return self.local(self.positions)


def row_lengths(mb: dict) -> torch.Tensor:
    """Real tokens per row [b] of a micro-batch: up to the last response token (response_mask [b, S-1]: its last True
    + 2), the reward model's `lengths` [b], or every column of input_ids [b, S]; at least 1, at most S."""
    ids = mb["input_ids"]
    s = ids.shape[1]
    if "response_mask" in mb:
        mask = mb["response_mask"]
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        lengths = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1) + 2
    elif "lengths" in mb:
        lengths = mb["lengths"]
    else:
        lengths = torch.full((ids.shape[0],), s, dtype=torch.long)
    return lengths.long().clamp(1, s).cpu()


def _row_segment(n: int, cp: int) -> int:
    """A row of n real tokens' segment length: n, or n rounded up to a multiple of 2*CP under CP."""
    return n if cp == 1 else n + (-n % (2 * cp))


def pack_rows(tokens: torch.Tensor, lengths: Optional[torch.Tensor] = None, multiple: int = 1,
              size: Optional[int] = None, cp: int = 1, cp_rank: int = 0, share: bool = False) -> Pack:
    """The pack of `tokens` [b, S] (right-padded) with real lengths `lengths` [b] (host values; None: all S), its
    size rounded up to a multiple of `multiple`, or exactly `size` (>= that: a size the expert-parallel ranks agreed
    on). cp > 1: each row's segment padded to a multiple of 2*cp, the model to see rank `cp_rank`'s share (the
    module doc); `multiple` must then be a multiple of 2*cp (megarl.megatron.forward.pack_multiple). The layout is
    computed on the host from the lengths; tokens are gathered on their own device (no read-back from it).
    share (CP 1 only): rows with a common prefix compute it once (megarl.megatron.shared_prefix); the layout then
    reads the tokens on the host too."""
    b, s = tokens.shape
    lens = [s] * b if lengths is None else [max(1, min(s, int(x))) for x in lengths.tolist()]
    if share:
        if cp > 1:
            raise ValueError("shared prefixes need context-parallel size 1")
        return _shared_pack(tokens, lens, multiple, size)
    rows = [_row_segment(n, cp) for n in lens]
    real = sum(rows)
    pad = _end_padding(real, multiple, size)
    if cp > 1 and pad % (2 * cp):
        raise ValueError(f"a pack's end padding of {pad} tokens does not split into 2*CP = {2 * cp} chunks; its "
                         f"size must be a multiple of {2 * cp}")
    segments = tuple(rows) + ((pad,) if pad else ())
    starts = [0]
    for n in segments:
        starts.append(starts[-1] + n)
    cols = torch.arange(s).unsqueeze(0)
    index = torch.where(cols < torch.tensor(lens).unsqueeze(1), torch.tensor(starts[:b]).unsqueeze(1) + cols,
                        torch.full((b, s), -1))
    # the flat source of each packed token in tokens (row r * S + column c); -1 for padding (a row's under CP, the
    # pack's end)
    src = torch.cat([torch.cat([r * s + torch.arange(n), torch.full((seg - n,), -1)])
                     for r, (n, seg) in enumerate(zip(lens, rows))] + [torch.full((pad,), -1)])
    positions = torch.cat([torch.arange(n) for n in segments])
    device = tokens.device
    src = src.to(device)
    ids = torch.where(src >= 0, tokens.reshape(-1)[src.clamp(min=0)], torch.zeros((), dtype=tokens.dtype,
                                                                                  device=device))
    return Pack(ids=ids.unsqueeze(0), positions=positions.to(device).unsqueeze(0),
                cu_seqlens=torch.tensor(starts, dtype=torch.int32), index=index.to(device),
                lengths=tuple(lens), segments=segments, cp=cp, cp_rank=cp_rank, pad=pad)


def _end_padding(real: int, multiple: int, size: Optional[int]) -> int:
    pad = -real % max(1, multiple)
    if size is not None:
        if size < real + pad:
            raise ValueError(f"pack size {size} is below the {real + pad} tokens of its rows")
        pad = size - real
    return pad


def _shared_pack(tokens: torch.Tensor, lens: list[int], multiple: int, size: Optional[int]) -> Pack:
    """pack_rows with shared prefixes: per group its prefix piece (tokens 0 .. a-1 of its first row), then each row's
    tokens a .. l_r - 1 at positions a .. l_r - 1; a row sharing nothing is one piece as in pack_rows."""
    from megarl.megatron.shared_prefix import prefix_groups

    b, s = tokens.shape
    segments, links, src, positions = [], [], [], []
    index = torch.full((b, s), -1, dtype=torch.long)
    at = 0
    for rows, a in prefix_groups(tokens, lens):
        parent = -1
        if a:
            parent = len(segments)
            segments.append(a)
            links.append(-1)
            src.append(rows[0] * s + torch.arange(a))
            positions.append(torch.arange(a))
            for r in rows:
                index[r, :a] = at + torch.arange(a)
            at += a
        for r in rows:
            n = lens[r] - a
            segments.append(n)
            links.append(parent)
            src.append(r * s + a + torch.arange(n))
            positions.append(a + torch.arange(n))
            index[r, a:lens[r]] = at + torch.arange(n)
            at += n
    pad = _end_padding(at, multiple, size)
    if pad:
        segments.append(pad)
        links.append(-1)
        src.append(torch.full((pad,), -1))
        positions.append(torch.arange(pad))
    starts = [0]
    for n in segments:
        starts.append(starts[-1] + n)
    device = tokens.device
    flat = torch.cat(src).to(device)
    ids = torch.where(flat >= 0, tokens.reshape(-1)[flat.clamp(min=0)], torch.zeros((), dtype=tokens.dtype,
                                                                                    device=device))
    return Pack(ids=ids.unsqueeze(0), positions=torch.cat(positions).to(device).unsqueeze(0),
                cu_seqlens=torch.tensor(starts, dtype=torch.int32), index=index.to(device), lengths=tuple(lens),
                segments=tuple(segments), links=tuple(links) if any(p >= 0 for p in links) else (), pad=pad)


def packed_labels(pack: Pack) -> torch.Tensor:
    """[1, P]: the token after each packed position within its row (0 at a row's last token and in the padding).
    The whole pack's; `pack.local` gives this CP rank's share."""
    ends = torch.zeros(pack.size, dtype=torch.bool)
    ends[torch.tensor(pack.segments).cumsum(0) - 1] = True  # each segment's last token: nothing after it in its row
    for piece in set(pack.links) - {-1}:  # except a shared prefix's: its rows go on with the next piece's token
        ends[sum(pack.segments[:piece + 1]) - 1] = False
    nxt = torch.cat([pack.ids[:, 1:], pack.ids[:, :1]], dim=1)
    return torch.where(ends.to(nxt.device).unsqueeze(0), torch.zeros((), dtype=nxt.dtype, device=nxt.device), nxt)


def logprob_index(pack: Pack) -> torch.Tensor:
    """[b, S-1]: the packed position whose output scores row r's token c + 1 (columns 0 .. l_r - 2), else -1."""
    s = pack.index.shape[1]
    cols = torch.arange(s - 1).unsqueeze(0)
    keep = (cols < torch.tensor(pack.lengths).unsqueeze(1) - 1).to(pack.index.device)
    return torch.where(keep, pack.index[:, : s - 1], torch.full((), -1, device=pack.index.device))


def unpack(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-row view of a packed output: x [1, P, ...], index [b, W] -> [b, W, ...], 0 where index is -1.
    Differentiable (a gather)."""
    flat = x[0]
    idx = index.to(flat.device)
    valid = idx >= 0
    out = flat[idx.clamp(min=0)]
    mask = valid.view(*valid.shape, *([1] * (out.dim() - 2)))
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def seq_params(pack: Pack, on_device: bool = False):
    """megatron's PackedSeqParams (qkv_format "thd") of the pack with the host segment lengths. on_device: the
    boundaries on the pack's device (TE's THD attention reads them there); otherwise on the host, where megatron's
    unfused rope reads them in every layer without waiting for the device."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = max(pack.segments)
    cu = pack.cu_seqlens.to(pack.ids.device) if on_device else pack.cu_seqlens
    # under CP Transformer Engine's THD attention reads the (2*CP-padded) boundaries as the padded ones; megatron's
    # rope reads them too to place each rank's chunks (megarl.megatron.context_parallel)
    padded = cu if pack.cp > 1 else None
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    setattr(params, SEGMENTS_ATTR, pack.segments)
    setattr(params, LINKS_ATTR, pack.links)
    setattr(params, PAD_ATTR, pack.pad)
    return params


def attended(params) -> tuple[list[int], int]:
    """(the segments attention computes, the end padding's length P_pad) of a PackedSeqParams: every segment but
    the end padding, which is the pack's last. The padding's outputs are 0: no query of it is computed, and no real
    query may see its keys (they come after every row). Under CP each rank holds P_pad / CP padding tokens, the last
    of its share (megarl.megatron.context_parallel: the padding is the last segment, split like every other)."""
    segments = segment_lengths(params)
    pad = int(getattr(params, PAD_ATTR, 0) or 0)
    return (segments[:-1] if pad else segments), pad


def with_padding(out: torch.Tensor, pad: int) -> torch.Tensor:
    """The attention output of the real tokens out [t - pad, ...] followed by `pad` zero rows: [t, ...]."""
    if not pad:
        return out
    return torch.cat([out, out.new_zeros(pad, *out.shape[1:])])


def padding_mask(pack: "Pack") -> Optional[torch.Tensor]:
    """[1, P / CP] bool, True at the end padding of the tokens the model computes on this rank (megatron's MoE
    padding_mask convention); None without padding."""
    if not pack.pad:
        return None
    t = pack.size // pack.cp
    mask = torch.zeros(1, t, dtype=torch.bool)
    mask[:, t - pack.pad // pack.cp:] = True
    return mask.to(pack.ids.device)


def segment_lengths(params) -> list[int]:
    """The segment lengths of a PackedSeqParams (megarl's host copy, else read from cu_seqlens)."""
    segments = getattr(params, SEGMENTS_ATTR, None)
    if segments is not None:
        return list(segments)
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return (cu[1:] - cu[:-1]).tolist()


def by_segment(segments: list[int], fn, *tensors: torch.Tensor) -> torch.Tensor:
    """fn applied to every segment of packed tensors, segments of one length batched together.

    tensors: [P, ...] each (packed); fn(*[g, L, ...]) -> [g, L, ...] for g segments of length L. Returns the results
    in packed order, [P, ...]. Work is proportional to what fn costs per segment (sum of L^2 for attention), never
    to the pack's length squared. A length held by one segment takes a view of it (no copy)."""
    starts, groups = [], {}
    for n in segments:
        at = starts[-1] + segments[len(starts) - 1] if starts else 0
        starts.append(at)
        groups.setdefault(n, []).append(len(starts) - 1)
    device = tensors[0].device
    pieces: list = [None] * len(segments)
    for n, members in groups.items():
        if len(members) == 1:
            i = members[0]
            inputs = [t[starts[i]:starts[i] + n].unsqueeze(0) for t in tensors]
        else:
            idx = torch.tensor([starts[i] for i in members], device=device).unsqueeze(1) + torch.arange(n, device=device)
            inputs = [t[idx] for t in tensors]  # [g, L, ...]
        out = fn(*inputs)
        for j, i in enumerate(members):
            pieces[i] = out[j]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def pack_size(lengths, multiple: int = 1, cp: int = 1, tokens: Optional[torch.Tensor] = None) -> int:
    """P of pack_rows for real lengths `lengths` (host ints or a host tensor, already within 1 .. S); tokens [b, S]:
    with shared prefixes (pack_rows' share)."""
    if tokens is not None:
        from megarl.megatron.shared_prefix import groups_size, prefix_groups

        real = groups_size(prefix_groups(tokens, lengths), lengths)
    else:
        real = sum(_row_segment(int(x), cp)
                   for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths))
    return real + (-real % max(1, multiple))


def agreed_sizes(sizes: list[int]) -> list[int]:
    """Each micro-batch's pack size, the largest over the expert-parallel group (the same on every rank of it).

    megatron's allgather token dispatcher gathers the tokens of every rank of the expert-parallel group into one
    tensor of equal parts, so the i-th micro-batch must hold the same token count on each: the shorter packs get
    more padding at their end (counted in their size). Every rank of the group has the same number of micro-batches
    (fixed-size micro-batches over equal row shares). Without expert parallelism: `sizes` unchanged."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1 or not sizes:
        return list(sizes)
    from megarl import distributed

    t = torch.tensor(sizes, dtype=torch.long, device=distributed.compute_device())
    distributed.all_reduce(t, group=ps.get_expert_tensor_and_model_parallel_group(), op=torch.distributed.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]


def expert_parallel() -> bool:
    """Whether the current megatron parallel state has expert parallelism (EP > 1)."""
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized() and ps.get_expert_model_parallel_world_size() > 1


def agreed_max(x: int) -> int:
    """The largest `x` over the expert-parallel group (its ranks must run the same number of micro-batches: see
    agreed_sizes); x itself without expert parallelism."""
    if not expert_parallel():
        return x
    return agreed_sizes([x])[0]


def token_rows(pack: Pack, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [P / CP], column [P / CP]) of every token the model computes on this rank, on the host: rows [b] gives
    each row's id (global ids for routing replay; -1 for a row that is padding); padding (a row's under CP, the
    pack's end) gets -1."""
    ids = torch.cat([torch.cat([torch.full((n,), int(r), dtype=torch.long), torch.full((seg - n,), -1)])
                     for n, seg, r in zip(pack.lengths, pack.segments, rows.tolist())]
                    + [torch.full((n,), -1, dtype=torch.long) for n in pack.segments[len(pack.lengths):]])
    return pack.local(ids.unsqueeze(0))[0], pack.local(pack.positions.cpu())[0]


def row_logprobs(logits: torch.Tensor, pack: Pack, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """logits [1, P, V/TP] of a pack -> [b, S-1] float32: logprob of row r's token c + 1 at column c (0 past the
    row's last real token). Vocab-parallel (megarl.megatron.vocab_parallel)."""
    from megarl.megatron.vocab_parallel import logprobs_from_logits

    lp = logprobs_from_logits(logits, pack.local(packed_labels(pack)), vocab_size, temperature)  # [1, P / CP]
    return unpack(pack.whole(lp), logprob_index(pack))


def row_entropy(logits: torch.Tensor, pack: Pack, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """logits [1, P, V/TP] -> [b, S-1]: entropy of the next-token distribution at each logprob column."""
    from megarl.megatron.vocab_parallel import vocab_parallel_entropy

    return unpack(pack.whole(vocab_parallel_entropy(logits, vocab_size, temperature)), logprob_index(pack))


def row_values(out: torch.Tensor, pack: Pack) -> torch.Tensor:
    """A value head's output [1, P, 1] -> [b, S] float32 (0 past each row's length)."""
    return unpack(pack.whole(out[..., 0].float()), pack.index)
