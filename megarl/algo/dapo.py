"""DAPO extras: the soft overlong penalty and the dynamic-sampling group filter."""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from megarl.algo._checks import check_finite, check_ndim, check_range
from megarl.algo.groups import group_ids


def overlong_reward_penalty(response_lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int,
                            penalty_factor: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO soft overlong punishment, to be added to each response's reward.

    response_lengths: [B] number of generated tokens (e.g. response_mask.sum(-1)).
    With L = max_response_length and C = overlong_buffer_len:
        0                                   if length <= L - C
        -penalty_factor * (length - (L - C)) / C   in the buffer, reaching -penalty_factor at L
        -penalty_factor                     if length > L
    so a truncated answer is not punished as harshly as a wrong one until it actually runs out of room.
    Returns (penalty [B] float, <= 0; metrics) with overlong_frac (fraction penalised) and
    overlong_penalty_mean.
    """
    check_ndim("response_lengths", response_lengths, 1, "[B]")
    check_range("max_response_length", max_response_length, low=0, low_open=True)
    check_range("overlong_buffer_len", overlong_buffer_len, low=0, high=max_response_length, low_open=True)
    check_range("penalty_factor", penalty_factor, low=0)
    lengths = response_lengths.to(torch.float32 if not response_lengths.is_floating_point() else response_lengths.dtype)
    if bool((lengths < 0).any()):
        raise ValueError(f"response_lengths must be >= 0; got min {lengths.min().item()}")
    exceed = lengths - (max_response_length - overlong_buffer_len)
    penalty = -(exceed / overlong_buffer_len).clamp(0.0, 1.0) * penalty_factor
    metrics = {
        "overlong_frac": (penalty < 0).to(lengths.dtype).mean() if lengths.numel() else lengths.new_zeros(()),
        "overlong_penalty_mean": penalty.mean() if lengths.numel() else lengths.new_zeros(()),
    }
    return penalty, metrics


def filter_groups_by_metric(metric_values: torch.Tensor, index: torch.Tensor | Sequence[Hashable],
                            keep_singletons: bool = False) -> tuple[torch.Tensor, dict[str, int]]:
    """DAPO dynamic sampling: keep only groups whose metric (e.g. accuracy or score) is not constant.

    metric_values: [B] one value per sample; index: [B] group ids (tensor or sequence of hashables).
    A group whose samples all share one value has zero group-relative advantage and only dilutes the batch.
    A group of one is constant too, so it is dropped unless keep_singletons (its GRPO/RLOO advantage is 0).
    Returns (keep [B] bool, metrics) with num_groups, num_groups_kept, num_samples_kept (python ints: the trainer
    uses them to decide whether to sample more prompts).
    """
    check_ndim("metric_values", metric_values, 1, "[B]")
    check_finite("metric_values", metric_values, "every sample needs a finite metric to be filtered")
    values = metric_values.to(torch.float64)
    ids, num_groups = group_ids(index, values.shape[0], device=values.device)
    group_max = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(
        0, ids, values, reduce="amax")
    group_min = torch.full((num_groups,), torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(
        0, ids, values, reduce="amin")
    # max > min rather than std > 0: round-off in a std of equal values must not keep a constant group.
    keep_group = group_max > group_min
    if keep_singletons:
        sizes = torch.zeros(num_groups, dtype=torch.long, device=values.device).index_add_(0, ids, torch.ones_like(ids))
        keep_group = keep_group | (sizes == 1)
    keep = keep_group[ids]
    metrics = {
        "num_groups": num_groups,
        "num_groups_kept": int(keep_group.sum()),
        "num_samples_kept": int(keep.sum()),
    }
    return keep, metrics
