"""Critic loss and its diagnostics."""
from __future__ import annotations

import torch

from megarl.algo._checks import check_floating, check_mask, check_ndim, check_range, check_same_shape
from megarl.algo.aggregation import agg_loss
from megarl.algo.masked import masked_mean, masked_var


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
               cliprange_value: float | None = 0.2, loss_agg_mode: str = "token-mean", *,
               denominator=None, max_response_length=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO critic).

    vpreds [B, T]: current critic predictions (carry the gradient); returns [B, T]: regression targets;
    values [B, T]: predictions when the batch was made; response_mask [B, T]. (Argument order as in verl; returns
    and values are easy to swap, so prefer keywords.)
        vclip = values + clip(vpreds - values, -cliprange_value, cliprange_value)
        L = 0.5 * max((vpreds - returns)^2, (vclip - returns)^2)
    The max keeps one update from moving the value further than cliprange_value from where it started, in the
    direction that would lower the loss. cliprange_value=None disables clipping (plain 0.5 * MSE).
    Returns (loss, metrics): vf_clipfrac (fraction of valid tokens where the clipped term was larger),
    vpred_mean.
    """
    check_ndim("vpreds", vpreds, 2, "[B, T]")
    check_floating("vpreds", vpreds)
    check_same_shape("values", values, "vpreds", vpreds)
    check_same_shape("returns", returns, "vpreds", vpreds)
    mask = check_mask("response_mask", response_mask, "vpreds", vpreds)
    values, returns = values.detach(), returns.detach()
    unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        losses, clipped_wins = 0.5 * unclipped, torch.zeros_like(mask)
    else:
        check_range("cliprange_value", cliprange_value, low=0)
        vclip = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
        clipped = (vclip - returns) ** 2
        losses, clipped_wins = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    loss = agg_loss(losses, mask, loss_agg_mode, denominator=denominator, max_response_length=max_response_length)
    metrics = {
        "vf_clipfrac": masked_mean(clipped_wins.to(vpreds.dtype), mask).detach(),
        "vpred_mean": masked_mean(vpreds, mask).detach(),
    }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over the valid tokens (0-d tensor).

    values, returns, response_mask: [B, T]. 1 is a perfect critic, 0 no better than predicting the mean, negative
    worse than that. NaN when the returns are constant (the ratio is undefined).
    """
    check_floating("values", values)
    check_same_shape("returns", returns, "values", values)
    mask = check_mask("response_mask", response_mask, "values", values)
    values, returns = values.detach(), returns.detach()
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    nan = torch.full((), float("nan"), dtype=var_returns.dtype, device=var_returns.device)
    return torch.where(var_returns > 0, 1 - var_residual / var_returns, nan)
