"""Vocab-parallel math on this tensor-parallel rank's shard of the logits [..., V_padded / TP]: logprobs of targets,
entropy and the max/sum reductions over the TP group they need. The logits are never gathered; megatron's vocab padding
columns (ids >= vocab_size, not tokens) are kept out of every softmax. Used by the forward passes and the losses alike.
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl import algo


def scaled_local_logits(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                        pad_fill: Optional[float] = None) -> torch.Tensor:
    """This TP rank's vocab shard [..., V_padded / TP] in float32 divided by temperature, with megatron's vocab padding
    columns (ids >= vocab_size; they are not tokens) set to `pad_fill` (default: the most negative float). It may be
    `logits` itself when there is nothing to change."""
    from megatron.core import parallel_state as ps

    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if start + local > vocab_size:
        cols = torch.arange(start, start + local, device=x.device)
        x = x.masked_fill(cols >= vocab_size, torch.finfo(x.dtype).min if pad_fill is None else pad_fill)
    return x


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                         temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[targets] from this TP rank's vocab shard, differentiable.

    logits: [..., V_padded / TP] (this rank's vocab columns); targets: [...] token ids < vocab_size.
    Columns at or beyond `vocab_size` (megatron's vocab padding) are excluded from the softmax."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = scaled_local_logits(logits, vocab_size, temperature)
    if x is logits:
        x = x.clone()  # vocab_parallel_cross_entropy works in place on its input
    return -vocab_parallel_cross_entropy(x, targets)


def tp_reductions():
    """Max/sum over the tensor-parallel group for vocab-parallel entropy (None, None without TP)."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return None, None
    group = ps.get_tensor_model_parallel_group()

    def reduce_max(t):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    return reduce_max, lambda t: dist_fn.all_reduce(t, group=group)


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy [...] of softmax(logits / temperature) over the full vocabulary from this rank's shard [..., V/TP]."""
    x = scaled_local_logits(logits, vocab_size, temperature, pad_fill=float("-inf"))
    reduce_max, reduce_sum = tp_reductions()
    return algo.entropy_from_logits(x, all_reduce_max=reduce_max, all_reduce_sum=reduce_sum)
