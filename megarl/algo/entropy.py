"""Entropy of the categorical distribution given by logits, optionally from vocab-parallel shards."""
from __future__ import annotations

from typing import Callable

import torch

from megarl.algo._checks import check_floating

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _vocab_logits(logits: torch.Tensor, all_reduce_max, all_reduce_sum) -> torch.Tensor:
    """The checked [..., V] logits, in float32 when they come in half precision."""
    check_floating("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V > 0; got shape {tuple(logits.shape)}")
    if (all_reduce_max is None) != (all_reduce_sum is None):
        raise ValueError("pass both all_reduce_max and all_reduce_sum (vocab-parallel) or neither")
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def entropy_from_logits(logits: torch.Tensor, *, all_reduce_max: Reduce | None = None,
                        all_reduce_sum: Reduce | None = None) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits) over the last dim.

    logits: [..., V] (e.g. [B, T, V]); returns [...]. float16/bfloat16 logits are computed in float32, and the
    result is float32 (or the input dtype when that is wider).

    Stable for any logit scale: with z = logits - max, H = log S - sum_v e^z_v z_v / S where S = sum_v e^z_v, so
    nothing larger than e^0 is ever exponentiated.

    Vocab-parallel: when each rank holds a slice [..., V/tp] of the vocabulary, pass reductions over the
    tensor-parallel group; each takes a local [...] tensor and returns the elementwise max / sum over ranks. The
    result is then the exact full-vocabulary entropy on every rank. The max is used detached (the shift cancels
    in H); all_reduce_sum must be autograd-aware (e.g. torch.distributed.nn.functional.all_reduce) if gradients
    are needed.
    """
    z = _vocab_logits(logits, all_reduce_max, all_reduce_sum)
    local_max = z.detach().amax(dim=-1)
    shift = local_max if all_reduce_max is None else all_reduce_max(local_max)
    # -inf logits (masked vocab entries) become the most negative finite number: exp gives 0 and 0 * z stays 0
    # instead of 0 * -inf = NaN.
    z = (z - shift.unsqueeze(-1)).clamp(min=torch.finfo(z.dtype).min)
    exp_z = z.exp()
    sum_exp = exp_z.sum(-1)
    sum_exp_z = (exp_z * z).sum(-1)
    if all_reduce_sum is not None:
        sum_exp = all_reduce_sum(sum_exp)
        sum_exp_z = all_reduce_sum(sum_exp_z)
    return sum_exp.log() - sum_exp_z / sum_exp


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, *, all_reduce_max: Reduce | None = None,
                               all_reduce_sum: Reduce | None = None) -> torch.Tensor:
    """sum_v p_v^2 of softmax(logits) over the last dim (the collision probability; optimal_token_baseline's
    ||grad_logits log p(y)||^2 = 1 - 2 p(y) + sum_v p_v^2 reads it).

    logits: [..., V]; returns [...] in float32 (or wider). With z = logits - max and S = sum_v e^z_v,
    sum_v p_v^2 = sum_v e^(2 z_v) / S^2, so nothing larger than e^0 is exponentiated. Vocab-parallel reductions as in
    entropy_from_logits (no gradient: the result is a constant of the advantage).
    """
    z = _vocab_logits(logits, all_reduce_max, all_reduce_sum)
    local_max = z.amax(dim=-1)
    shift = local_max if all_reduce_max is None else all_reduce_max(local_max)
    exp_z = (z - shift.unsqueeze(-1)).exp()
    sum_exp, sum_exp2 = exp_z.sum(-1), (exp_z * exp_z).sum(-1)
    if all_reduce_sum is not None:
        sum_exp, sum_exp2 = all_reduce_sum(sum_exp), all_reduce_sum(sum_exp2)
    return sum_exp2 / sum_exp ** 2
