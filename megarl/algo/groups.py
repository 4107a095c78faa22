"""Grouping of samples by prompt (the `index` of GRPO-style estimators and the DAPO group filter).

A group is every sample that shares an id. Statistics are vectorised with index_add, so the cost does not grow
with a Python loop over groups.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from megarl.algo._checks import check_batch_vector


def group_ids(index: torch.Tensor | Sequence[Hashable], batch_size: int,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Dense group ids for a batch.

    index: [B] integer tensor, or a length-B sequence of hashables (e.g. prompt uid strings).
    Returns (ids [B] int64 in 0..G-1, G). Ids follow first appearance for sequences, sorted order for tensors.
    """
    if isinstance(index, torch.Tensor):
        check_batch_vector("index", index, batch_size)
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise ValueError(f"index must hold integer group ids; got dtype {index.dtype}")
        uniq, ids = torch.unique(index, return_inverse=True)
        return ids.to(device if device is not None else index.device), int(uniq.numel())
    try:
        n = len(index)
    except TypeError:
        raise ValueError(
            f"index must be a [B] integer tensor or a sequence of ids; got {type(index).__name__}"
        ) from None
    if n != batch_size:
        raise ValueError(f"index has {n} entries but the batch has {batch_size} sequences; they must match")
    first_seen: dict[Hashable, int] = {}
    try:
        ids = [first_seen.setdefault(key, len(first_seen)) for key in index]
    except TypeError as err:
        raise ValueError(f"index entries must be hashable (e.g. prompt uid strings): {err}") from None
    return torch.tensor(ids, dtype=torch.long, device=device), len(first_seen)


def group_mean_std(scores: torch.Tensor, ids: torch.Tensor, num_groups: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample statistics of the sample's group.

    scores: [B] floating; ids: [B] dense group ids (from group_ids).
    Returns (mean [B], std [B], count [B]): the group mean, unbiased std and size, broadcast back to each sample.
    The std of a group of one is 0 (its spread is undefined, and 0 keeps it out of any division by std).
    """
    def per_group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, ids, x)

    count = per_group_sum(torch.ones_like(scores))
    mean = (per_group_sum(scores) / count)[ids]
    sq = per_group_sum((scores - mean) ** 2)
    var = sq / (count - 1).clamp(min=1)
    return mean, var.sqrt()[ids], count[ids]
