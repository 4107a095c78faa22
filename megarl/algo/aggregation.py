"""Reduce a per-token loss matrix [B, T] to the scalar that is back-propagated.

The mode decides how much each token weighs: token-mean weighs every token equally (long answers dominate);
seq-mean-* weigh every sequence equally; seq-mean-token-sum-norm (Dr.GRPO) divides each sequence's token sum by
one constant, so no length normalisation biases the gradient.

`denominator` lets a caller that splits a global batch into micro-batches or data-parallel ranks divide by the
global token count (token-mean) or global sequence count (seq-mean-*), so the sum of the pieces equals the loss of
the whole batch.
"""
from __future__ import annotations

from typing import Callable

import torch

from megarl.algo._checks import check_floating, check_mask, check_ndim, check_range, lookup


def _denominator(default: torch.Tensor, denominator: float | torch.Tensor | None) -> torch.Tensor | float:
    if denominator is None:
        return default.clamp(min=1)
    if not isinstance(denominator, torch.Tensor):
        check_range("denominator", denominator, low=0, low_open=True)
    return denominator


def _seq_loss_sum(seq_losses: torch.Tensor, mask: torch.Tensor, denominator) -> torch.Tensor:
    """Sum of per-sequence losses over the denominator; rows without a valid token are not counted by default."""
    non_empty = mask.any(-1)
    return seq_losses.sum() / _denominator(non_empty.sum(), denominator)


def _token_mean(loss_mat, mask, denominator, max_response_length):
    return torch.where(mask, loss_mat, 0.0).sum() / _denominator(mask.sum(), denominator)


def _seq_mean_token_sum(loss_mat, mask, denominator, max_response_length):
    return _seq_loss_sum(torch.where(mask, loss_mat, 0.0).sum(-1), mask, denominator)


def _seq_mean_token_mean(loss_mat, mask, denominator, max_response_length):
    per_seq = torch.where(mask, loss_mat, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    return _seq_loss_sum(per_seq, mask, denominator)


def _seq_mean_token_sum_norm(loss_mat, mask, denominator, max_response_length):
    # Dr.GRPO: one constant for every sequence (the generation budget), so length does not rescale the gradient.
    # This follows the paper (mean over sequences); verl's variant omits the division by the sequence count.
    norm = loss_mat.shape[-1] if max_response_length is None else max_response_length
    check_range("max_response_length", norm, low=0, low_open=True)
    return _seq_loss_sum(torch.where(mask, loss_mat, 0.0).sum(-1) / norm, mask, denominator)


LOSS_AGG_MODES: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
             denominator: float | torch.Tensor | None = None,
             max_response_length: int | None = None) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    loss_mat: [B, T] floating; loss_mask: [B, T] bool or 0/1 (masked-out entries are ignored, even if NaN).
    loss_agg_mode:
      "token-mean"              sum(loss) / #valid tokens
      "seq-mean-token-sum"      mean over sequences of the token sum
      "seq-mean-token-mean"     mean over sequences of the token mean
      "seq-mean-token-sum-norm" mean over sequences of token sum / max_response_length (Dr.GRPO)
    denominator: overrides the count divided by (#valid tokens for token-mean, #sequences with at least one valid
      token for seq-mean-*), e.g. the global count when the batch is split across micro-batches or ranks.
    max_response_length: the Dr.GRPO constant; defaults to T.
    Returns a 0-d tensor. An all-padding input gives 0.
    """
    agg = lookup(LOSS_AGG_MODES, loss_agg_mode, "loss_agg_mode")
    check_ndim("loss_mat", loss_mat, 2, "[B, T]")
    check_floating("loss_mat", loss_mat)
    mask = check_mask("loss_mask", loss_mask, "loss_mat", loss_mat)
    return agg(loss_mat, mask, denominator, max_response_length)
