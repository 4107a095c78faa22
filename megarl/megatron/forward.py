"""Forward passes of a megarl GPTModel over micro-batches: per-token logprobs (policy) and values (critic).

Batches are right-padded token ids [N, S]; position t attends to 0..t (causal) and its rope position is t
(megatron's rope uses positions 0..S-1: left padding is not supported). Right padding never changes the result at real
tokens, so the caller computes on the padded batch and masks the outputs at pad positions with its loss mask.

    logprobs[n, t] = log p(tokens[n, t+1] | tokens[n, :t+1])    shape [N, S-1]
    values[n, t]   = V(tokens[n, :t+1])                          shape [N, S]

With pipeline parallelism every stage runs the schedule (get_forward_backward_func, forward only); results come back
on the last stage and None on the others. Vocab-parallel logits are never gathered: logprobs use megatron's
vocab_parallel_cross_entropy (negated), with the vocab padding rows masked out of the softmax.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch

from megarl import algo, distributed
from megarl.megatron import router_replay
from megarl.megatron.vocab_parallel import logprobs_from_logits, scaled_local_logits, tp_reductions


def causal_inputs(tokens: torch.Tensor) -> tuple:
    """(position_ids [B, S], attention_mask [1, 1, S, S] with True = masked) for a right-padded batch.

    The mask is marked causal (megarl.megatron.layer_spec.mark_causal): megarl's SDPA attention then uses the kernel's
    own causal masking and never reads it."""
    from megarl.megatron.layer_spec import mark_causal

    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1).view(1, 1, s, s)
    return pos, mark_causal(mask)


def _pad_batch(tokens: torch.Tensor, rows: int, seq_multiple: int) -> torch.Tensor:
    """`tokens` with copies of row 0 up to `rows` rows and pad id 0 up to a multiple of `seq_multiple` columns."""
    n, s = tokens.shape
    n_pad = rows - n
    s_pad = -s % seq_multiple
    if n_pad or s_pad:
        tokens = torch.nn.functional.pad(tokens, (0, s_pad), value=0)
        if n_pad:
            tokens = torch.cat([tokens, tokens[:1].expand(n_pad, -1)], dim=0)
    return tokens


def run_microbatches(model, tokens: torch.Tensor, micro_batch_size: int,
                     output_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Optional[torch.Tensor]:
    """Forward-only pass of `tokens` [N, S] in micro-batches of `micro_batch_size` through the pipeline schedule.

    output_fn(model output [b, s', ...], micro-batch tokens [b, s']) -> [b, ...] runs on the last stage; the results are
    concatenated to [N, ...] there (None on other stages). For the schedule, N is padded to a multiple of the
    micro-batch size (the extra rows are dropped from the result; with virtual pipeline stages the micro-batch count
    is rounded up to a multiple of PP, as the interleaved schedule needs, and the micro-batches shrink to share the
    rows) and, under sequence parallelism, S to a multiple of TP
    with pad id 0 on the right (s' >= S: output_fn cuts the sequence dimension back to what it needs)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.bridge.sharding import unwrap
    from megarl.megatron.parallel import schedule_args

    chunks = unwrap(model)
    config = chunks[0].config
    spec = getattr(chunks[0], "megarl_spec", None)
    n, s = tokens.shape
    if spec is not None and spec.sliding_window and s > spec.sliding_window:
        raise ValueError(f"sequence length {s} exceeds the model's sliding_window={spec.sliding_window}; megarl's "
                         "megatron attention is full causal and would differ from the HF model beyond the window")
    device = distributed.compute_device()
    seq_multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    count = -(-n // micro_batch_size)
    if len(chunks) > 1:
        # the interleaved schedule (virtual pipeline stages) takes micro-batches in groups of PP: round the count up
        # to a multiple of PP and shrink the micro-batches to match (fewer padding rows than padding the count)
        pp = ps.get_pipeline_model_parallel_world_size()
        count = -(-count // pp) * pp
        micro_batch_size = -(-n // count)
    padded = _pad_batch(tokens.to(device), count * micro_batch_size, seq_multiple)
    micro = list(padded.split(micro_batch_size))
    replay = router_replay.STATE
    if replay.action != "off":  # routing replay: each micro-batch's global row ids (-1: the padding rows)
        if replay.pass_rows is None or len(replay.pass_rows) != n:
            raise ValueError("routing replay: the rows of this forward pass were not given (STATE.pass_rows)")
        ids = torch.cat([replay.pass_rows.long(), torch.full((padded.shape[0] - n,), -1, dtype=torch.long)])
        micro_rows = list(ids.split(micro_batch_size))
    else:
        micro_rows = [None] * len(micro)

    def step(data_iterator, m):
        mb, rows = next(data_iterator)
        if rows is not None:
            router_replay.micro_batch(rows, mb.shape[1])
        pos, mask = causal_inputs(mb)
        out = distributed.call_model(m, mb, pos, mask)
        return out, partial(_collect, mb)

    def _collect(mb, output):
        return torch.zeros((), device=output.device), {"out": output_fn(output, mb).detach()}

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=step, **schedule_args(chunks, list(zip(micro, micro_rows))),
            num_microbatches=len(micro), seq_length=padded.shape[1], micro_batch_size=micro_batch_size,
            forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    out = torch.cat([r["out"] for r in results], dim=0)[:n]
    return out


def token_logprobs(model, tokens: torch.Tensor, micro_batch_size: int = 1, temperature: float = 1.0,
                   vocab_size: Optional[int] = None) -> Optional[torch.Tensor]:
    """Per-token logprobs [N, S-1] (float32) of `tokens` [N, S] on the last pipeline stage; None elsewhere.

    Call on every rank of the model-parallel group (and each DP rank with its own tokens)."""
    chunk = _first(model)
    vocab_size = vocab_size or chunk.megarl_spec.vocab_size
    s = tokens.shape[1]

    def fn(logits, mb):
        return logprobs_from_logits(logits[:, : s - 1], mb[:, 1:s], vocab_size, temperature)

    return run_microbatches(model, tokens, micro_batch_size, fn)


def token_logprobs_and_sum_pi_squared(model, tokens: torch.Tensor, micro_batch_size: int = 1,
                                      temperature: float = 1.0, vocab_size: Optional[int] = None
                                      ) -> Optional[torch.Tensor]:
    """[N, S-1, 2] (float32) on the last pipeline stage, None elsewhere: [..., 0] the per-token logprobs (as
    token_logprobs), [..., 1] sum_v pi(v)^2 over the full vocabulary at each position (optimal_token_baseline)."""

    chunk = _first(model)
    vocab_size = vocab_size or chunk.megarl_spec.vocab_size
    s = tokens.shape[1]

    def fn(logits, mb):
        logits = logits[:, : s - 1]
        logp = logprobs_from_logits(logits, mb[:, 1:s], vocab_size, temperature)
        reduce_max, reduce_sum = tp_reductions()
        x = scaled_local_logits(logits, vocab_size, temperature, pad_fill=float("-inf"))
        sq = algo.sum_pi_squared_from_logits(x, all_reduce_max=reduce_max, all_reduce_sum=reduce_sum)
        return torch.stack([logp, sq], dim=-1)

    return run_microbatches(model, tokens, micro_batch_size, fn)


def token_values(model, tokens: torch.Tensor, micro_batch_size: int = 1) -> Optional[torch.Tensor]:
    """Critic values [N, S] (float32) of `tokens` [N, S] on the last pipeline stage; None elsewhere."""
    s = tokens.shape[1]
    return run_microbatches(model, tokens, micro_batch_size, lambda out, mb: out[:, :s, 0].float())


def _first(model):
    from megarl.bridge.sharding import unwrap

    return unwrap(model)[0]
