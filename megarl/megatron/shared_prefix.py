"""Shared prefixes: rows of a micro-batch that begin with the same tokens (a GRPO group: rollout.n samples of one
prompt) compute those tokens once.

A group of g rows of real lengths l_1 .. l_g whose first m tokens agree is laid out in the pack as a prefix piece
(tokens 0 .. a-1, positions 0 .. a-1, with a = min(m, min l) - 1) followed by one piece per row (tokens a .. l_r - 1,
positions a .. l_r - 1). A row's piece attends to the prefix piece and causally to itself; the prefix piece attends
causally to itself. Token a is the last one every row agrees on: repeating it at the head of each row's piece leaves
every packed position one next token (the prefix piece's last position predicts token a, the same for all rows), so
labels, logprob columns and values are read exactly as for rows packed apart (megarl.megatron.packing). The pack
computes sum(l) - (g - 1) * a tokens instead of sum(l), and every real token sees the keys, values and positions it
sees packed apart: outputs and gradients are those of the unshared pack up to float summation order.

Rows are grouped on the host from their tokens alone (no prompt boundary needed): sorted, then cut into runs that
maximise the tokens saved. Only megarl's SDPA core attention reads the layout, so sharing is on for a model built
without Transformer Engine, without MLA, at context-parallel size 1 and without routing replay (`enable`).

    layout: groups [(rows, a)], rows indices into the micro-batch, a = 0 for a row that shares nothing
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import numpy as np
import torch

# the longest run of rows one group may hold: grouping is O(rows x RUN) on the host
RUN = 256

_logged: set = set()  # the reasons sharing was off, each logged once per process
_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("megarl_rope_positions", default=None)


def common_prefixes(tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order [n], lcp [n-1]): rows sorted by their real tokens, and the common prefix length of each adjacent pair
    in that order (at most the shorter row's length). tokens [n, S] (right-padded), lengths [n]."""
    n, s = tokens.shape
    cols = np.arange(s)
    # padding sorts below every token so a row sorts before the rows it is a prefix of
    keyed = np.where(cols[None, :] < lengths[:, None], tokens.astype(np.int64) + 1, 0)
    order = np.lexsort(keyed.T[::-1]) if n > 1 else np.arange(n)
    srt, lens = keyed[order], lengths[order]
    if n < 2:
        return order, np.zeros(0, dtype=np.int64)
    differ = srt[1:] != srt[:-1]
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), s)
    return order, np.minimum(first, np.minimum(lens[1:], lens[:-1]))


def prefix_groups(tokens: torch.Tensor, lengths) -> list[tuple[list[int], int]]:
    """The groups of a micro-batch: [(rows, a)] covering every row once, a > 0 for rows sharing their first a tokens
    (+ the repeated one, module doc), a = 0 for a row alone; in the order of each group's first row.

    tokens [b, S] (host or device; read on the host), lengths [b] real lengths (1 .. S). Runs of the sorted rows are
    chosen to save the most tokens ((g - 1) * a per group) by dynamic programming over runs of at most RUN rows."""
    lens = np.asarray([int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)],
                      dtype=np.int64)
    n = len(lens)
    if n < 2:
        return [([i], 0) for i in range(n)]
    order, lcp = common_prefixes(tokens.detach().cpu().numpy(), lens)
    srt = lens[order]
    best = np.zeros(n + 1, dtype=np.int64)  # best[j]: tokens saved over the first j sorted rows
    cut = np.zeros(n + 1, dtype=np.int64)   # where the run ending at j starts
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], j - 1
        common, shortest = None, srt[j - 1]
        for i in range(j - 2, max(-1, j - 1 - RUN), -1):  # run i .. j-1 of at least two rows
            common = lcp[i] if common is None else min(common, lcp[i])
            shortest = min(shortest, srt[i])
            a = min(common, shortest) - 1
            if a < 1:
                break  # a longer run shares no more
            saved = best[i] + (j - 1 - i) * a
            if saved > best[j]:
                best[j], cut[j] = saved, i
    groups = []
    j = n
    while j > 0:
        i = int(cut[j])
        rows = sorted(int(r) for r in order[i:j])
        a = 0 if j - i == 1 else int(min(lcp[i:j - 1].min(), srt[i:j].min()) - 1)
        groups.append((rows, a))
        j = i
    return sorted(groups, key=lambda g: g[0][0])


def groups_size(groups, lengths) -> int:
    """Tokens the pack of `groups` computes (no end padding): each group's prefix once, then its rows past it."""
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    return sum(a + sum(lens[r] - a for r in rows) for rows, a in groups)


def budget_bins(tokens: torch.Tensor, lengths, max_tokens: int) -> list[list[int]]:
    """Rows (indices) in micro-batches of at most `max_tokens` computed tokens with prefixes shared: each group's
    rows go together, a group too large for one micro-batch in slices that each repeat its prefix, a row longer than
    the budget alone; groups by decreasing size into the first micro-batch with room (first-fit decreasing:
    deterministic, the same on every rank). The counterpart of megarl.batching.token_budget_groups."""
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    units = []
    for rows, a in prefix_groups(tokens, lens):
        part, load = [], a
        for r in sorted(rows, key=lambda r: (-lens[r], r)):
            if part and load + lens[r] - a > max_tokens:
                units.append((part, load))
                part, load = [], a
            part.append(r)
            load += lens[r] - a
        units.append((part, load))
    bins: list[list[int]] = []
    loads: list[int] = []
    for rows, cost in sorted(units, key=lambda u: (-u[1], u[0][0])):
        for b, load in enumerate(loads):
            if load + cost <= max_tokens:
                bins[b] += rows
                loads[b] += cost
                break
        else:
            bins.append(list(rows))
            loads.append(cost)
    return [sorted(b) for b in bins]


def supported(model) -> Optional[str]:
    """Why the model cannot share prefixes (None: it can): the layout is read by megarl's SDPA core attention only."""
    from megarl.bridge.sharding import unwrap

    chunk = unwrap(model)[0]
    if getattr(chunk, "megarl_te", False):
        return "Transformer Engine's attention"
    spec = getattr(chunk, "megarl_spec", None)
    if spec is not None and spec.mla is not None:
        return "multi-latent attention"
    if spec is not None and spec.vision is not None:  # M-RoPE positions are per token on three axes
        return "a vision-language model"
    if int(getattr(chunk.config, "context_parallel_size", 1) or 1) > 1:
        return "context parallelism"
    if not hasattr(chunk, "rotary_pos_emb"):
        return "no rotary embedding"
    return None


def enable(model, on: bool) -> bool:
    """Turn prefix sharing on for `model` (a GPTModel or its chunks) when `on` and supported; returns whether it is.
    Its rotary embedding then reads each packed token's own position while a shared pack runs (`positions`)."""
    from megarl.bridge.sharding import unwrap

    reason = supported(model)
    ok = on and reason is None
    if on and reason is not None and reason not in _logged:
        import logging

        _logged.add(reason)
        logging.getLogger("megarl").info("model.share_prefixes: off for this model (%s); rows are packed whole", reason)
    for chunk in unwrap(model):
        chunk.megarl_share_prefixes = ok
        if ok:
            _positioned(chunk.rotary_pos_emb)
    return ok


def sharing(model) -> bool:
    from megarl.bridge.sharding import unwrap

    return bool(getattr(unwrap(model)[0], "megarl_share_prefixes", False))


def _positioned(rope) -> None:
    """Give megatron's RotaryEmbedding instance the per-token path (same parameters and state dict)."""
    base = type(rope)
    if getattr(base, "megarl_positioned", False):
        return
    rope.__class__ = type(f"Positioned{base.__name__}", (base,), {"forward": _forward, "megarl_positioned": True})


def _forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
    """megatron's rotary forward, or within `positions(p)` the frequencies of each packed token [P, 1, 1, d]: with
    as many rows as the pack has tokens megatron's THD rope reads row j for token j (its offset mapping)."""
    pos = _POSITIONS.get()
    parent = super(type(self), self).forward
    if pos is None:
        return parent(max_seq_len, offset, packed_seq, cp_group)
    table = parent(int(pos.max()) + 1, offset, packed_seq, cp_group)
    return table[pos.to(table.device)]


@contextlib.contextmanager
def positions(pos: Optional[torch.Tensor]):
    """Within: a positioned rotary embedding returns the frequencies of `pos` [P] (None: megatron's own)."""
    token = _POSITIONS.set(pos)
    try:
        yield
    finally:
        _POSITIONS.reset(token)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments, links, causal_fn, masked_fn
           ) -> torch.Tensor:
    """Attention over a shared pack (module doc). query [t, np, hn], key/value [t, ng, hn]; segments: the pieces'
    lengths in pack order; links: per piece the index of the prefix piece it continues, -1 for none (prefix pieces,
    rows alone, the end padding). causal_fn(lengths, q, k, v) attends causally within each of the pieces laid end
    to end in q, k, v [m, heads, hn] (megarl.megatron.packing.by_segment); masked_fn(q [g, L, ...],
    k/v [g, a + L, ...], allowed [L, a + L] bool) attends where allowed. -> [t, np, hn]."""
    starts = np.concatenate([[0], np.cumsum(segments)]).astype(np.int64)
    device = query.device
    plain = [i for i, p in enumerate(links) if p < 0]  # never empty: a row's piece follows its prefix piece
    plain_idx = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in plain]).to(device)
    parts = [causal_fn([segments[i] for i in plain], query[plain_idx], key[plain_idx], value[plain_idx])]
    where = [plain_idx]
    children: dict = {}
    for i, p in enumerate(links):
        if p >= 0:
            children.setdefault(p, []).append(i)
    for p, kids in children.items():
        a = int(segments[p])
        lens = [int(segments[i]) for i in kids]
        width = max(lens)
        # each row's piece padded to the longest by repeating its last token: padded queries are dropped below, and
        # under the causal mask no real query sees a padded key
        cols = torch.arange(width)
        idx = torch.stack([int(starts[i]) + torch.minimum(cols, torch.tensor(n - 1)) for i, n in zip(kids, lens)])
        idx = idx.to(device)
        pre = slice(int(starts[p]), int(starts[p]) + a)
        k = torch.cat([key[pre].unsqueeze(0).expand(len(kids), -1, -1, -1), key[idx]], dim=1)
        v = torch.cat([value[pre].unsqueeze(0).expand(len(kids), -1, -1, -1), value[idx]], dim=1)
        j = torch.arange(a + width, device=device)
        allowed = (j.unsqueeze(0) < a) | (j.unsqueeze(0) - a <= torch.arange(width, device=device).unsqueeze(1))
        out = masked_fn(query[idx], k, v, allowed)  # [g, width, np, hn]
        real = (cols.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).to(device)
        parts.append(out[real])
        where.append(idx[real])
    flat = torch.cat(parts)
    inverse = torch.empty(query.shape[0], dtype=torch.long, device=device)
    inverse[torch.cat(where)] = torch.arange(query.shape[0], device=device)
    return flat[inverse]
