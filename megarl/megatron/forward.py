"""Forward passes of a megarl GPTModel over micro-batches: per-token logprobs (policy) and values (critic).

Batches are right-padded token ids [N, S] with each row's real length (None: every column is real). Every micro-batch
runs packed (megarl.megatron.packing): its rows end to end as one sequence, positions restarting at every row,
attention within each row, so no padding is computed and each real token's output is the padded batch's. Where the
model shares prefixes (`shares`), rows beginning with the same tokens compute them once
(megarl.megatron.shared_prefix).

    logprobs[n, t] = log p(tokens[n, t+1] | tokens[n, :t+1])    shape [N, S-1]   (0 from t = length - 1 on)
    values[n, t]   = V(tokens[n, :t+1])                          shape [N, S]     (0 from t = length on)

With pipeline parallelism every stage runs the schedule (get_forward_backward_func, forward only); results come back
on the last stage and None on the others. Vocab-parallel logits are never gathered: logprobs use megatron's
vocab_parallel_cross_entropy (negated), with the vocab padding rows masked out of the softmax.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch

from megarl import algo, distributed
from megarl.megatron import router_replay
from megarl.megatron.packing import (Pack, agreed_sizes, logprob_index, pack_rows, pack_size, packed_labels,
                                     padding_mask, row_logprobs, row_values, seq_params, token_rows, unpack)
from megarl.megatron.vocab_parallel import logprobs_from_logits, scaled_local_logits, tp_reductions


def causal_inputs(tokens: torch.Tensor) -> tuple:
    """(position_ids [B, S], attention_mask [1, 1, S, S] with True = masked) for a right-padded batch run unpacked.

    The mask is marked causal (megarl.megatron.layer_spec.mark_causal): megarl's SDPA attention then uses the kernel's
    own causal masking and never reads it."""
    from megarl.megatron.layer_spec import mark_causal

    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1).view(1, 1, s, s)
    return pos, mark_causal(mask)


def pack_multiple(config) -> int:
    """What every pack's length must divide by: TP under sequence parallelism (each TP rank holds a chunk); under
    context parallelism 2*CP (each segment's chunks) and CP * TP with sequence parallelism (each CP rank's share
    splits over TP)."""
    tp = config.tensor_model_parallel_size if getattr(config, "sequence_parallel", False) else 1
    cp = context_parallel_size(config)
    return tp if cp == 1 else math.lcm(2 * cp, cp * tp)


def context_parallel_size(config) -> int:
    return int(getattr(config, "context_parallel_size", 1) or 1)


def shares(model) -> bool:
    """Whether `model`'s packs share their rows' common prefixes now (megarl.megatron.shared_prefix; routing replay
    records routes per row and column, so its passes pack every row whole)."""
    from megarl.megatron.shared_prefix import sharing

    return sharing(model) and router_replay.STATE.action == "off"


def pack_for(config, tokens: torch.Tensor, lengths: torch.Tensor, size: Optional[int] = None,
             share: bool = False) -> Pack:
    """The pack of a micro-batch as the model of `config` computes it (sequence- and context-parallel sizes; share:
    common prefixes once)."""
    from megarl.megatron import context_parallel

    cp = context_parallel_size(config)
    return pack_rows(tokens, lengths, pack_multiple(config), size, cp=cp, cp_rank=context_parallel.rank() if cp > 1
                     else 0, share=share)


def pack_size_for(config, lengths, tokens: Optional[torch.Tensor] = None) -> int:
    """pack_size of a micro-batch's real lengths under `config`'s layout (as pack_for lays it out; tokens [b, S]:
    with shared prefixes)."""
    return pack_size(lengths, pack_multiple(config), context_parallel_size(config), tokens)


def schedule_shapes(chunks: list, sizes: list[int]) -> tuple[list[int], dict]:
    """(pack sizes to use, seq_length and micro_batch_size for megatron's schedule) over packs of `sizes` tokens
    (batch dimension 1).

    Pipeline stages exchange activations [P / TP (sequence parallel), 1, hidden], and every stage holds the same
    micro-batches, so every stage computes the same sizes. The 1F1B schedule takes packs of different lengths when
    megatron sends each shape first (variable_seq_lengths); the interleaved one (virtual pipeline stages) pairs its
    sends and receives by one fixed shape, so there every pack is padded at its end to the longest of the call."""
    interleaved = len(chunks) > 1
    if interleaved:
        sizes = [max(sizes)] * len(sizes)
    for chunk in chunks:
        chunk.config.variable_seq_lengths = len(set(sizes)) > 1
    return sizes, {"seq_length": max(sizes), "micro_batch_size": 1}


def packed_forward(model, pack: Pack, rows: Optional[torch.Tensor] = None, vision: Optional[dict] = None):
    """The model on one pack (on the compute device): [1, P, ...] on the last pipeline stage. rows [b]: the rows'
    global ids, for routing replay. A vision-language model runs megarl.megatron.vlm.packed_vl_forward with the
    rows' images, vision: {"pixel_values" [b, P_max, patch_dim], "image_grid_thw" [b, I_max, 3]} (None: text rows)."""
    if rows is not None and router_replay.STATE.action != "off":
        router_replay.micro_batch(*token_rows(pack, rows))
    from megarl.megatron.shared_prefix import positions

    from megarl.megatron import moe_padding

    te = getattr(getattr(model, "module", model), "megarl_te", False)
    if is_vision_language(model):
        from megarl.megatron.vlm import packed_vl_forward

        vision = vision or {}
        return packed_vl_forward(model, pack, seq_params(pack, on_device=te), vision.get("pixel_values"),
                                 vision.get("image_grid_thw"))
    # a shared pack's rows resume at their prefix's length: rope reads every token's own position
    with positions(pack.positions[0] if pack.links else None):
        return distributed.call_model(model, pack.model_ids, pack.model_positions, None,
                                      seq_params(pack, on_device=te),
                                      moe_padding.model_mask(model, padding_mask(pack)))


def is_vision_language(model) -> bool:
    """Whether `model` (a chunk, DDP-wrapped or not) is a vision-language model (M-RoPE, images on stage 0)."""
    from megarl.bridge.sharding import unwrap

    spec = getattr(unwrap(model)[0], "megarl_spec", None)
    return spec is not None and spec.vision is not None


def micro_batch_rows(n: int, micro_batch_size: int, num_chunks: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch of n rows: consecutive groups of micro_batch_size. With virtual pipeline
    stages the count is rounded up to a multiple of PP (the interleaved schedule's groups) and the rows shared over
    them; a micro-batch left empty gets row 0 again (its result is dropped)."""
    from megatron.core import parallel_state as ps

    count = -(-n // micro_batch_size)
    if num_chunks > 1:
        pp = ps.get_pipeline_model_parallel_world_size()
        count = -(-count // pp) * pp
        micro_batch_size = -(-n // count)
    groups = [torch.arange(i * micro_batch_size, min(n, (i + 1) * micro_batch_size)) for i in range(count)]
    return [g if len(g) else torch.zeros(1, dtype=torch.long) for g in groups]


def fewest_rows(groups: list[torch.Tensor], lengths: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """The rows of `groups` (micro_batch_rows) dealt again by tokens into as few micro-batches as the largest of
    them holds (megarl.batching.fewest_groups: agreed over the expert-parallel group; a multiple of PP under virtual
    pipeline stages), heaviest first: where pack sizes are agreed (the interleaved schedule pads every pack of a call
    to the longest; the expert-parallel ranks each micro-batch to the group's largest) no pack grows and the padding
    shrinks. An empty group gets row 0 again (its result is dropped)."""
    from megatron.core import parallel_state as ps

    from megarl.batching import fewest_groups
    from megarl.megatron.packing import agreed_max

    if not groups:
        return groups
    seen, fixed = set(), []
    for g in groups:  # micro_batch_rows' repeats of row 0 are not rows of their own
        fixed.append([i for i in g.tolist() if i not in seen])
        seen.update(fixed[-1])
    multiple = ps.get_pipeline_model_parallel_world_size() if num_chunks > 1 else 1
    dealt = fewest_groups([int(x) for x in lengths.tolist()], fixed, agreed_max, multiple)
    return [torch.tensor(g, dtype=torch.long) if g else torch.zeros(1, dtype=torch.long) for g in dealt]


def run_microbatches(model, tokens: torch.Tensor, micro_batch_size: int,
                     output_fn: Callable[[torch.Tensor, Pack], torch.Tensor],
                     lengths: Optional[torch.Tensor] = None, vision: Optional[dict] = None
                     ) -> Optional[torch.Tensor]:
    """Forward-only pass of `tokens` [N, S] (real lengths `lengths` [N], None: all S) in packed micro-batches of
    `micro_batch_size` rows through the pipeline schedule; vision: the rows' images of a vision-language model,
    {"pixel_values" [N, P_max, patch_dim], "image_grid_thw" [N, I_max, 3]} (packed_forward).

    output_fn(model output [1, P, ...], pack) -> [b, ...] runs on the last stage; the results are concatenated to
    [N, ...] there (None on other stages)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.bridge.sharding import unwrap
    from megarl.megatron.parallel import schedule_args

    chunks = unwrap(model)
    config = chunks[0].config
    spec = getattr(chunks[0], "megarl_spec", None)
    n, s = tokens.shape
    lengths = torch.full((n,), s, dtype=torch.long) if lengths is None else lengths.long().clamp(1, s).cpu()
    longest = int(lengths.max()) if n else 0
    if spec is not None and spec.sliding_window and longest > spec.sliding_window:
        raise ValueError(f"sequence length {longest} exceeds the model's sliding_window={spec.sliding_window}; "
                         "megarl's megatron attention is full causal and would differ from the HF model beyond the "
                         "window")
    device = distributed.compute_device()
    groups = micro_batch_rows(n, micro_batch_size, len(chunks))
    replay = router_replay.STATE
    if replay.action != "off":  # routing replay: each micro-batch's global row ids
        if replay.pass_rows is None or len(replay.pass_rows) != n:
            raise ValueError("routing replay: the rows of this forward pass were not given (STATE.pass_rows)")
    share = shares(model)
    if not share and (len(chunks) > 1 or ps.get_expert_model_parallel_world_size() > 1):
        groups = fewest_rows(groups, lengths, len(chunks))
    host = tokens
    sizes, shapes = schedule_shapes(chunks, agreed_sizes([
        pack_size_for(config, lengths[g], host[g] if share else None) for g in groups]))
    items = [(g, replay.pass_rows.long()[g] if replay.action != "off" else None, size)
             for g, size in zip(groups, sizes)]
    tokens = tokens.to(device)

    def step(data_iterator, m):
        rows, global_rows, size = next(data_iterator)
        pack = pack_for(config, tokens[rows.to(device)], lengths[rows], size, share)
        images = None if vision is None else {k: v[rows] for k, v in vision.items()}
        return packed_forward(m, pack, global_rows, images), partial(_collect, pack)

    def _collect(pack, output):
        return torch.zeros((), device=output.device), {"out": output_fn(output, pack).detach()}

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=step, **schedule_args(chunks, items), num_microbatches=len(items),
            forward_only=True, **shapes)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    # each row's result where it was computed first (an empty micro-batch ran row 0 again: dropped)
    seen, parts, rows = set(), [], []
    for g, r in zip(groups, results):
        keep = [j for j, i in enumerate(g.tolist()) if i not in seen]
        seen.update(g.tolist())
        parts.append(r["out"][keep])
        rows.append(g[keep])
    out = torch.cat(parts, dim=0)
    return out[torch.cat(rows).argsort().to(out.device)]


def token_logprobs(model, tokens: torch.Tensor, micro_batch_size: int = 1, temperature: float = 1.0,
                   vocab_size: Optional[int] = None, lengths: Optional[torch.Tensor] = None,
                   vision: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Per-token logprobs [N, S-1] (float32) of `tokens` [N, S] (real lengths `lengths` [N], None: all S) on the last
    pipeline stage; None elsewhere. vision: the rows' images (run_microbatches).

    Call on every rank of the model-parallel group (and each DP rank with its own tokens)."""
    chunk = _first(model)
    vocab_size = vocab_size or chunk.megarl_spec.vocab_size
    return run_microbatches(model, tokens, micro_batch_size,
                            lambda logits, pack: row_logprobs(logits, pack, vocab_size, temperature), lengths,
                            vision)


def token_logprobs_and_sum_pi_squared(model, tokens: torch.Tensor, micro_batch_size: int = 1,
                                      temperature: float = 1.0, vocab_size: Optional[int] = None,
                                      lengths: Optional[torch.Tensor] = None, vision: Optional[dict] = None
                                      ) -> Optional[torch.Tensor]:
    """[N, S-1, 2] (float32) on the last pipeline stage, None elsewhere: [..., 0] the per-token logprobs (as
    token_logprobs), [..., 1] sum_v pi(v)^2 over the full vocabulary at each position (optimal_token_baseline)."""

    chunk = _first(model)
    vocab_size = vocab_size or chunk.megarl_spec.vocab_size

    def fn(logits, pack):
        logp = logprobs_from_logits(logits, pack.local(packed_labels(pack)), vocab_size, temperature)
        reduce_max, reduce_sum = tp_reductions()
        x = scaled_local_logits(logits, vocab_size, temperature, pad_fill=float("-inf"))
        sq = algo.sum_pi_squared_from_logits(x, all_reduce_max=reduce_max, all_reduce_sum=reduce_sum)
        return unpack(pack.whole(torch.stack([logp, sq.to(logp.dtype)], dim=-1)), logprob_index(pack))

    return run_microbatches(model, tokens, micro_batch_size, fn, lengths, vision)


def token_values(model, tokens: torch.Tensor, micro_batch_size: int = 1,
                 lengths: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Critic values [N, S] (float32) of `tokens` [N, S] (real lengths `lengths` [N], None: all S) on the last
    pipeline stage; None elsewhere."""
    return run_microbatches(model, tokens, micro_batch_size, lambda out, pack: row_values(out, pack), lengths)


def _first(model):
    from megarl.bridge.sharding import unwrap

    return unwrap(model)[0]
