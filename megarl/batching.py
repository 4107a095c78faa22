"""From a rollout to training tensors, and the split of a step's samples into DP shards, mini- and micro-batches.

Training tensors of a step (N samples, S = longest prompt + response, T = S - 1):
    input_ids          [N, S] long   prompt tokens then response tokens, right-padded with pad_token_id
    response_mask      [N, T] bool   True at t when token t+1 is a response token the model sampled (logprob
                                     positions; multi-turn tool and template tokens are False: RolloutBatch.loss_mask)
    rollout_log_probs  [N, T] float  the engine's logprob of token t+1 where response_mask, else 0
    token_level_scores [N, T] float  the sample's reward at its last response token, else 0
    prompt_index       [N]    long   group id (samples of one prompt)
    response_lengths   [N]    long
    routed_experts     [N, S, L, k] int16  the engine's experts per token position and decoder layer, -1 = none
                                     (only when the rollout carries them: rollout.return_routed_experts)
    pixel_values       [N, P_max, D] float  a vision-language row's image patches (its images' in order, zeros after;
                                     D = the processor's patch size), only when some row has images
    image_grid_thw     [N, I_max, 3] long   its images' patch grids (t, h, w), rows of zeros after them
Later stages add old_log_probs, ref_log_probs, values, advantages, returns ([N, T] each).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.types import RolloutBatch


def build_train_batch(rollout: RolloutBatch, scores: torch.Tensor, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Concatenate prompts and responses of `rollout` and place each sample's score on its last response token.

    scores: [N] float, one reward per sample."""
    n = len(rollout)
    if scores.shape != (n,):
        raise ValueError(f"scores has shape {tuple(scores.shape)}; expected ({n},), one reward per sample")
    lengths = rollout.response_lengths
    prompt_lengths = torch.tensor([len(p) for p in rollout.prompt_ids], dtype=torch.long)
    s = int((prompt_lengths + lengths).max())
    # [N, S] masks of where each row's prompt and response tokens go; boolean indexing fills them in row-major order,
    # the order of the flattened prompts and of the valid response entries
    cols = torch.arange(s).unsqueeze(0)
    in_prompt = cols < prompt_lengths.unsqueeze(1)
    in_response = (cols >= prompt_lengths.unsqueeze(1)) & (cols < (prompt_lengths + lengths).unsqueeze(1))
    valid = torch.arange(rollout.response_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    ids = torch.full((n, s), pad_token_id, dtype=torch.long)
    ids[in_prompt] = torch.tensor([t for p in rollout.prompt_ids for t in p], dtype=torch.long)
    ids[in_response] = rollout.response_ids[valid]
    # a multi-turn response holds tool and template tokens the model did not sample: no consumer may learn from them
    learn = in_response.clone()
    if rollout.loss_mask is not None:
        learn[in_response] = rollout.loss_mask[valid]
    # logprob position t scores token t+1: a response token at column c is scored at c - 1
    mask = learn[:, 1:].clone()
    rollout_lp = torch.zeros(n, s - 1)
    if rollout.rollout_logprobs is not None:
        placed = torch.zeros(n, s)
        placed[in_response] = rollout.rollout_logprobs[valid].float()
        rollout_lp = torch.where(mask, placed[:, 1:], rollout_lp)
    # the reward sits on the last token the model sampled; a response without one contributes nothing to the loss
    token_scores = torch.zeros(n, s - 1)
    rows = mask.any(dim=1).nonzero().flatten()
    last = torch.where(mask, torch.arange(s - 1).expand_as(mask), -1).amax(dim=1)
    token_scores[rows, last[rows]] = scores[rows].float()
    out = {"input_ids": ids, "response_mask": mask, "rollout_log_probs": rollout_lp,
           "token_level_scores": token_scores, "prompt_index": rollout.prompt_index.clone(),
           "response_lengths": lengths.clone()}
    if rollout.routed_experts is not None:  # by sequence position, as input_ids' columns
        r = rollout.routed_experts
        routes = torch.full((n, s, *r.shape[2:]), -1, dtype=torch.int16)
        routes[:, :min(s, r.shape[1])] = r[:, :s]
        out["routed_experts"] = routes
    return out


def route_coverage(routes: torch.Tensor, lengths: torch.Tensor) -> float:
    """Share of the forwarded positions (0 .. length-2 of each row; lengths [N]: prompt + response tokens) that have
    the engine's routes (routes [N, S, L, k], -1 = none)."""
    need = torch.arange(routes.shape[1]).unsqueeze(0) < (lengths.view(-1, 1) - 1)
    have = (routes >= 0).any(dim=-1).any(dim=-1)
    return float((have & need).sum()) / max(1, int(need.sum()))


def select_rows(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


def mini_batch_rows(num_samples: int, mini_batch_size: int, dp_size: int, dp_rank: int,
                    generator: Optional[torch.Generator] = None,
                    lengths: Optional[list[int]] = None) -> list[torch.Tensor]:
    """Row indices of this DP rank's share of each mini-batch.

    The N samples are (optionally shuffled with `generator`, identically on every rank, then) cut into mini-batches of
    `mini_batch_size` samples; each mini-batch is split contiguously over DP ranks, or, given every sample's token
    count `lengths` [N], dealt over them by tokens (balanced_shares: expert parallelism). Every rank gets one index
    tensor per mini-batch, of mini_batch_size / dp_size rows."""
    if num_samples % mini_batch_size or mini_batch_size % dp_size:
        raise ValueError(f"{num_samples} samples do not split into mini-batches of {mini_batch_size} over "
                         f"{dp_size} data-parallel ranks; check actor.ppo_mini_batch_size, rollout.n and the layout")
    order = torch.randperm(num_samples, generator=generator) if generator is not None else torch.arange(num_samples)
    share = mini_batch_size // dp_size
    out = []
    for start in range(0, num_samples, mini_batch_size):
        mini = order[start:start + mini_batch_size]
        if lengths is not None and dp_size > 1:
            mini = mini[balanced_shares([int(lengths[i]) for i in mini.tolist()], dp_size)]
        out.append(mini[dp_rank * share:(dp_rank + 1) * share])
    return out


def split_micro(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    n = next(iter(batch.values())).shape[0]
    if n % micro_batch_size:
        raise ValueError(f"{n} rows do not split into micro-batches of {micro_batch_size}")
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()} for i in range(0, n, micro_batch_size)]


def sequence_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Real tokens per row: up to and including the last response token (the last True of response_mask, + 1)."""
    mask = batch["response_mask"]
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1) + 2


def split_by_token_budget(batch: dict[str, torch.Tensor], max_tokens: int,
                          bins: Optional[list[list[int]]] = None) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of whole rows holding at most `max_tokens` real tokens each (a longer row goes alone).

    Rows go longest first into the first micro-batch with room (first-fit decreasing: deterministic); each
    micro-batch's tensors are cut to its longest row, and the forward runs it packed (rows end to end, no padding
    computed: megarl.megatron.packing). bins: the rows of each micro-batch, chosen by the caller (shared prefixes:
    megarl.megatron.shared_prefix.budget_bins; expert parallelism: agreed_budget_groups, whose empty bins give
    micro-batches of no rows)."""
    lengths = sequence_lengths(batch).tolist()
    out = []
    for rows in bins if bins is not None else token_budget_groups(lengths, max_tokens):
        if not rows:  # an empty bin (agreed_budget_groups): no rows, for the caller to fill
            out.append({k: v[:0] for k, v in batch.items()})
            continue
        s = max(lengths[i] for i in rows)
        idx = torch.tensor(sorted(rows))
        out.append({k: _cut_columns(k, v[idx], s) for k, v in batch.items()})
    return out


def token_budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows (indices into `lengths`) packed into groups of at most `max_tokens` tokens each, a longer row alone;
    longest first into the first group with room (first-fit decreasing: deterministic, the same on every rank)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balanced_groups(lengths: list[int], count: int, rows_each: Optional[int] = None) -> list[list[int]]:
    """Rows (indices into `lengths`) dealt into `count` groups of near-equal tokens: longest first onto the group
    with the fewest tokens so far (that still has room for rows_each rows, when given); ties to the lower group.
    Returns the groups heaviest first (each ascending; a group may be empty when count > rows).

    Packs of equal tokens need little end padding where a micro-batch's pack size is agreed across ranks
    (expert parallelism: the i-th micro-batch of every rank of the expert-parallel group, dealt heaviest first, is
    padded to the largest of them) or across the micro-batches of a call (the interleaved pipeline schedule). The
    largest group holds at most the mean + the longest row (greedy longest-first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in order:
        open_ = [g for g in range(count) if rows_each is None or len(groups[g]) < rows_each]
        if not open_:
            raise ValueError(f"{len(lengths)} rows do not fit {count} groups of {rows_each} rows")
        g = min(open_, key=lambda j: (loads[j], j))
        groups[g].append(i)
        loads[g] += lengths[i]
    ranked = sorted(range(count), key=lambda j: (-loads[j], min(groups[j], default=len(lengths))))
    return [sorted(groups[j]) for j in ranked]


def agreed_budget_groups(lengths: list[int], max_tokens: int, agree: Callable[[int], int],
                         multiple: int = 1) -> list[list[int]]:
    """Micro-batches of at most `max_tokens` tokens (a longer row alone) whose count is the same on every rank of a
    group (expert parallelism: every rank must join every micro-batch's token dispatch) and a multiple of `multiple`
    (the interleaved pipeline schedule's groups of PP), their tokens balanced (`balanced_groups`).

    agree(x) -> the largest x over the group (every rank calls it the same number of times). The count starts at
    the largest first-fit-decreasing count of the group (token_budget_groups), rounded up to `multiple`, and grows by
    `multiple` while a group of more than one row exceeds `max_tokens` on some rank. Groups may be empty on a rank
    with fewer rows than the count."""
    step = max(1, multiple)
    count = agree(-(-len(token_budget_groups(lengths, max_tokens)) // step) * step)
    while True:
        groups = balanced_groups(lengths, count)
        over = any(len(g) > 1 and sum(lengths[i] for i in g) > max_tokens for g in groups)
        if not agree(int(over)):
            return groups
        count += step


def fewest_groups(lengths: list[int], groups: list[list[int]], agree: Callable[[int], int],
                  multiple: int = 1) -> list[list[int]]:
    """The rows of `groups` (fixed-size micro-batches) dealt again by tokens into as few micro-batches as hold them
    within the largest group's tokens (over the ranks of `agree`'s group), a multiple of `multiple` of them.

    Where pack sizes are agreed (every pack of an interleaved-schedule call padded to the longest; every expert-
    parallel rank's i-th pack to the group's largest) a long-tail batch in fixed micro-batches is mostly padding:
    one long row sets every pack's size. The same largest pack then holds more rows: no pack grows, and the padding
    and the count shrink (`agreed_budget_groups` with that largest pack as the budget)."""
    largest = agree(max((sum(lengths[i] for i in g) for g in groups), default=1))
    return agreed_budget_groups(lengths, largest, agree, multiple)


def balanced_shares(lengths: list[int], parts: int) -> list[int]:
    """An order of the rows whose `parts` contiguous equal shares hold near-equal tokens (rows dealt longest first to
    the lightest share: `balanced_groups`), each share ascending. len(lengths) must divide by parts.

    The data-parallel ranks of an expert-parallel group pad their packs to each other's: rows dealt by tokens over
    the ranks leave little to pad (megarl.megatron.packing.agreed_sizes)."""
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows do not split into {parts} equal shares")
    shares = balanced_groups(lengths, parts, len(lengths) // parts)
    return [i for share in sorted(shares, key=lambda g: g[0] if g else len(lengths)) for i in share]


def forward_by_token_budget(forward, tokens: torch.Tensor, lengths: torch.Tensor, max_tokens: int,
                            width: int, on_rows=None, bins: Optional[list[list[int]]] = None
                            ) -> Optional[torch.Tensor]:
    """A forward-only pass in token-budget micro-batches (rollout.log_prob_use_dynamic_bsz).

    forward(tokens [g, s], micro_batch_size, lengths [g]) -> [g, <= s, ...] per-position outputs (None off the last
    pipeline stage); tokens [N, S]; lengths [N] real tokens per row (prefix up to the last real token). Each group of
    rows holding at most max_tokens tokens runs as one (packed) micro-batch cut to its longest row; the rows come
    back in their order as [N, width, ...], zero past each group's cut (positions no loss reads). on_rows(idx [g]):
    called with each group's row indices (into `tokens`) before its forward. bins: the groups, chosen by the caller
    (as in split_by_token_budget)."""
    groups = bins if bins is not None else token_budget_groups([int(x) for x in lengths.tolist()], max_tokens)
    out = None
    for rows in groups:
        # an empty group (bins agreed across ranks: agreed_budget_groups) still joins its peers' forward, on row 0
        # with the smallest length; its result is dropped
        empty = not rows
        rows = rows or [0]
        cut = min(tokens.shape[1], max(2, max(int(lengths[r]) for r in rows)))
        idx = torch.tensor(sorted(rows))
        if on_rows is not None:
            on_rows(idx)
        part = forward(tokens[idx, :cut], len(rows), lengths[idx].clamp(1, 1 if empty else cut))
        if part is None or empty:
            continue
        if out is None:
            out = part.new_zeros((tokens.shape[0], width) + tuple(part.shape[2:]))
        w = min(width, part.shape[1])
        out[idx.to(out.device), :w] = part[:, :w]
    return out


# per-row tensors whose second axis is not the sequence's: micro-batches keep them whole
VISION_KEYS = ("pixel_values", "image_grid_thw")


def _cut_columns(key: str, t: torch.Tensor, seq_len: int) -> torch.Tensor:
    if t.dim() < 2 or key in VISION_KEYS:
        return t
    return t[:, :seq_len] if key == "input_ids" else t[:, :seq_len - 1]
