"""Engine replicas over the trainer's ranks, and how their rollouts reach every rank as tensors.

Replica r (of rollout.data_parallel_size) spans trainer ranks [r*T, (r+1)*T) with T = rollout.tensor_model_parallel_size;
its first rank owns the engine process. A step's prompts are split into contiguous shares, one per replica, and
each sample's sampling seed is a function of its global prompt index, so the samples do not depend on how many
replicas there are. Each owner then broadcasts its share as a few tensors (token ids, lengths, logprobs, codes),
never as a pickled object. Which ranks a replica spans is megarl.layout.EngineTopology.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megarl.agent.loop import COUNT_KEYS as TOOL_COUNT_KEYS, tool_rates
from megarl.types import FINISH_REASONS, RolloutBatch

# rollout metrics that add up over replicas; seconds take the slowest replica; the rest is recomputed
_SUMMED = ("rollout/num_prompts", "rollout/num_samples", "rollout/prompts_truncated", "rollout/prompts_filtered",
           "rollout/response_tokens", "rollout/num_aborted") + TOOL_COUNT_KEYS
_SLOWEST = ("rollout/generate_seconds",)
METRIC_KEYS = _SUMMED + _SLOWEST


def replica_cores(cores: list, index: int, count: int, workers: int) -> list:
    """The cores of the `index`-th of `count` engine replicas on one machine: an equal contiguous share, or all of
    them when a share would give a worker no core of its own (the replicas then share the cores)."""
    per = len(cores) // max(1, count)
    if per < workers:
        return list(cores)
    return list(cores[index * per:(index + 1) * per])


def _broadcast(t: torch.Tensor, src: int, group, device: torch.device) -> Optional[torch.Tensor]:
    """src's `t` on every rank, through `device` (the group's: an NCCL group takes device tensors only). Receivers
    get it back on the CPU, where the step's batch lives; the sender keeps its own (None)."""
    out = t.to(device)
    dist.broadcast(out, src=src, group=group)
    return None if dist.get_rank() == src else out.cpu()


def broadcast_rollout(batch: Optional[RolloutBatch], src: int, group=None,
                      device: Optional[torch.device] = None) -> RolloutBatch:
    """`batch` (on rank src; None elsewhere) on every rank, sent as tensors from `device` (the runtime's compute
    device: the rank's GPU under NCCL; default the CPU)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return batch
    device = device or torch.device("cpu")
    me = dist.get_rank()
    if me == src:
        n, width = batch.response_ids.shape
        routes = tuple(batch.routed_experts.shape[1:]) if batch.routed_experts is not None else (0, 0, 0)
        header = [n, width, batch.rollout_logprobs is not None, sum(len(p) for p in batch.prompt_ids),
                  batch.weight_version, batch.pad_token_id, batch.loss_mask is not None,
                  batch.tool_rewards is not None, *routes]
        _broadcast(torch.tensor(header, dtype=torch.long), src, group, device)
    else:
        header = _broadcast(torch.empty(11, dtype=torch.long), src, group, device).tolist()
    n, width, has_lp, prompt_tokens, version, pad, has_mask, has_tool, *routes = header

    def field(make, value):
        return _broadcast(value() if me == src else make(), src, group, device)

    response = field(lambda: torch.empty((n, width), dtype=torch.long), lambda: batch.response_ids.contiguous())
    logprobs = field(lambda: torch.empty((n, width), dtype=torch.float32),
                     lambda: batch.rollout_logprobs.contiguous()) if has_lp else None
    rows = field(lambda: torch.empty((5, n), dtype=torch.long), lambda: torch.stack([
        batch.response_lengths, batch.prompt_index, batch.truncated.long(), batch.prompt_truncated.long(),
        torch.tensor([FINISH_REASONS.index(r) for r in batch.finish_reasons], dtype=torch.long)]).reshape(5, n))
    prompt_lens = field(lambda: torch.empty(n, dtype=torch.long),
                        lambda: torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.long))
    prompts = field(lambda: torch.empty(prompt_tokens, dtype=torch.long),
                    lambda: torch.tensor([t for p in batch.prompt_ids for t in p], dtype=torch.long))
    loss_mask = field(lambda: torch.empty((n, width), dtype=torch.bool),
                      lambda: batch.loss_mask.contiguous()) if has_mask else None
    tool_rewards = field(lambda: torch.empty(n, dtype=torch.float32),
                         lambda: batch.tool_rewards.contiguous()) if has_tool else None
    # sent as int32 (gloo has no int16 collectives)
    routed = field(lambda: torch.empty((n, *routes), dtype=torch.int32),
                   lambda: batch.routed_experts.to(torch.int32)) if routes[1] else None
    # NaN marks a metric the batch does not have (single-turn rollouts have no tool/* counts)
    metrics = field(lambda: torch.empty(len(METRIC_KEYS), dtype=torch.float64), lambda: torch.tensor(
        [float(batch.metrics.get(k, float("nan"))) for k in METRIC_KEYS], dtype=torch.float64))
    if me == src:
        return batch
    return RolloutBatch(prompt_ids=[p.tolist() for p in prompts.split(prompt_lens.tolist())], response_ids=response,
                        response_lengths=rows[0].clone(), rollout_logprobs=logprobs,
                        finish_reasons=[FINISH_REASONS[c] for c in rows[4].tolist()], truncated=rows[2].bool(),
                        prompt_index=rows[1].clone(), prompt_truncated=rows[3].bool(), weight_version=int(version),
                        pad_token_id=int(pad), loss_mask=loss_mask, tool_rewards=tool_rewards,
                        routed_experts=None if routed is None else routed.to(torch.int16),
                        metrics={k: v for k, v in zip(METRIC_KEYS, metrics.tolist()) if v == v})


def combine(batches: list) -> RolloutBatch:
    """The replicas' shares as one batch, in prompt order, with metrics over all of them."""
    if len(batches) == 1:
        return batches[0]
    out = RolloutBatch.concat(batches)
    m = {k: sum(b.metrics.get(k, 0.0) for b in batches) for k in _SUMMED if any(k in b.metrics for b in batches)}
    m.update({k: max(b.metrics.get(k, 0.0) for b in batches) for k in _SLOWEST})
    out.metrics = {**m, **rollout_rates(out, m), **(tool_rates(m) if "tool/samples" in m else {})}
    return out


def rollout_rates(batch: RolloutBatch, m: dict) -> dict:
    n = len(batch)
    seconds = m.get("rollout/generate_seconds", 0.0)
    return {"rollout/response_length_mean": float(batch.response_lengths.float().mean()) if n else 0.0,
            "rollout/truncated_fraction": float(batch.truncated.float().mean()) if n else 0.0,
            "rollout/tokens_per_second": m.get("rollout/response_tokens", 0.0) / seconds if seconds > 0 else 0.0}
