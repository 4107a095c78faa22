"""Policy-gradient losses.

All losses share one signature so the trainer can call `POLICY_LOSSES[name](...)`:

  old_log_prob     [B, T]  log-prob of each response token under the policy that generated the batch (no grad)
  log_prob         [B, T]  log-prob under the policy being trained (carries the gradient)
  advantages       [B, T]  (no grad)
  response_mask    [B, T]  bool or 0/1; masked positions are ignored even if they hold NaN
  loss_agg_mode            see aggregation.agg_loss
  clip_ratio_low, clip_ratio_high   ratio clipped to [1 - low, 1 + high]; high > low is DAPO's clip-higher
  clip_ratio_c             dual-clip bound for negative advantages (> 1), None disables it
  rollout_is_weights [B, T] optional detached per-token weights from rollout correction, multiplied into the loss
  denominator, max_response_length  passed to agg_loss

and returns (loss 0-d tensor, metrics) with detached 0-d tensor metrics:
  pg_clipfrac        fraction of valid tokens whose gradient the clip removed (upper + lower)
  pg_clipfrac_upper  ... because ratio > 1 + clip_ratio_high (advantage > 0 for ppo/gspo)
  pg_clipfrac_lower  ... because ratio < 1 - clip_ratio_low (advantage < 0 for ppo/gspo). Note: verl uses this
                     name for the dual-clip fraction; here that is dual_clip_frac.
  ppo_kl             mean(old_log_prob - log_prob): k1 estimate of KL(old || current) on the batch's tokens
  dual_clip_frac     fraction of valid tokens bounded by the dual clip (vanilla only)
"""
from __future__ import annotations

from typing import Callable

import torch

from megarl.algo._checks import check_floating, check_mask, check_ndim, check_range, check_same_shape
from megarl.algo.aggregation import agg_loss
from megarl.algo.masked import masked_mean

# exp() of a larger log-ratio overflows float32; beyond e^20 every branch is clipped anyway, and clamping keeps the
# backward pass free of 0 * inf = NaN through the discarded branch of max().
LOG_RATIO_CLAMP = 20.0


def _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights) -> torch.Tensor:
    check_ndim("log_prob", log_prob, 2, "[B, T]")
    check_floating("log_prob", log_prob)
    check_same_shape("old_log_prob", old_log_prob, "log_prob", log_prob)
    check_same_shape("advantages", advantages, "log_prob", log_prob)
    if rollout_is_weights is not None:
        check_same_shape("rollout_is_weights", rollout_is_weights, "log_prob", log_prob)
    return check_mask("response_mask", response_mask, "log_prob", log_prob)


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    check_range("clip_ratio_low", clip_ratio_low, low=0, high=1)
    check_range("clip_ratio_high", clip_ratio_high, low=0)


def _log_ratio(log_prob, old_log_prob, mask) -> torch.Tensor:
    """log(pi / pi_old) per token, 0 on padding, clamped to +-LOG_RATIO_CLAMP."""
    diff = torch.where(mask, log_prob - old_log_prob.detach(), 0.0)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_surrogate(ratio, adv, clip_ratio_low, clip_ratio_high, mask):
    """Per-token PPO surrogate max(-A r, -A clip(r)) and the masks of tokens the clip cut off."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    upper = mask & (adv > 0) & (ratio > 1 + clip_ratio_high)
    lower = mask & (adv < 0) & (ratio < 1 - clip_ratio_low)
    return torch.maximum(unclipped, clipped), upper, lower


def _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    return agg_loss(pg_losses, mask, loss_agg_mode, denominator=denominator, max_response_length=max_response_length)


def _clip_metrics(upper, lower, log_ratio, mask) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": masked_mean((upper | lower).to(log_ratio.dtype), mask).detach(),
        "pg_clipfrac_upper": masked_mean(upper.to(log_ratio.dtype), mask).detach(),
        "pg_clipfrac_lower": masked_mean(lower.to(log_ratio.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }


def ppo_clip_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                  clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0, *,
                  rollout_is_weights=None, denominator=None, max_response_length=None):
    """PPO clipped surrogate with dual clip and asymmetric (clip-higher) bounds.

    Shapes: see the module docstring. Per token, with r = exp(log_prob - old_log_prob):
        L = max(-A r, -A clip(r, 1 - low, 1 + high))
        L = min(L, -A clip_ratio_c)      for A < 0 (dual clip: a very unlikely token with negative advantage
                                         cannot produce an unbounded loss)
    Returns (loss, metrics) with pg_clipfrac, pg_clipfrac_upper, pg_clipfrac_lower, ppo_kl, dual_clip_frac.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None:
        check_range("clip_ratio_c", clip_ratio_c, low=1, low_open=True)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    pg_losses, upper, lower = _clipped_surrogate(log_ratio.exp(), adv, clip_ratio_low, clip_ratio_high, mask)
    dual = torch.zeros_like(mask)
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c
        dual = mask & (adv < 0) & (pg_losses > bound)
        pg_losses = torch.where(dual, bound, pg_losses)
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    metrics = _clip_metrics(upper, lower, log_ratio, mask)
    metrics["dual_clip_frac"] = masked_mean(dual.to(log_ratio.dtype), mask).detach()
    return loss, metrics


def gspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "seq-mean-token-mean",
              clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4, clip_ratio_c: float | None = None, *,
              rollout_is_weights=None, denominator=None, max_response_length=None):
    """GSPO: PPO clipping on the sequence-level ratio.

    Shapes: see the module docstring. s_i = exp(mean over valid t of log_ratio_{i,t}) is the length-normalised
    geometric mean ratio of sequence i. Each token uses
        s_{i,t} = sg[s_i] * exp(log_prob_{i,t} - sg[log_prob_{i,t}])
    whose value is s_i and whose gradient w.r.t. log_prob_{i,t} is s_i, so with "seq-mean-token-mean" the loss
    gradient equals that of the sequence-level objective; advantages may vary per token (GSPO-token).
    clip_ratio_c is accepted for the uniform signature and ignored (GSPO has no dual clip). The paper's clip
    range is small (3e-4 / 4e-4) because s_i is a per-token geometric mean.
    Returns (loss, metrics) with pg_clipfrac, pg_clipfrac_upper, pg_clipfrac_lower, ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    _check_clip(clip_ratio_low, clip_ratio_high)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    lp = torch.where(mask, log_prob, 0.0)
    ratio = torch.exp(lp - lp.detach() + seq_log_ratio.detach()[:, None])
    pg_losses, upper, lower = _clipped_surrogate(ratio, adv, clip_ratio_low, clip_ratio_high, mask)
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    return loss, _clip_metrics(upper, lower, log_ratio, mask)


def cispo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
               clip_ratio_low: float = 1.0, clip_ratio_high: float = 0.28, clip_ratio_c: float | None = None, *,
               rollout_is_weights=None, denominator=None, max_response_length=None):
    """CISPO: REINFORCE on every token, weighted by a clipped, detached importance ratio.

    Shapes: see the module docstring. Per token: L = -A * sg[clip(r, 1 - low, 1 + high)] * log_prob.
    Unlike PPO no token's gradient is dropped; clipping only bounds its weight. The default clip_ratio_low=1.0
    means no lower bound (MiniMax-M1 clips only from above). clip_ratio_c is ignored.
    Returns (loss, metrics) with pg_clipfrac, pg_clipfrac_upper, pg_clipfrac_lower (fractions of tokens whose
    weight was clipped, whatever the sign of A) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    _check_clip(clip_ratio_low, clip_ratio_high)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    ratio = log_ratio.exp().detach()
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    lp = torch.where(mask, log_prob, 0.0)
    pg_losses = -adv * weight * lp
    upper = mask & (ratio > 1 + clip_ratio_high)
    lower = mask & (ratio < 1 - clip_ratio_low)
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    return loss, _clip_metrics(upper, lower, log_ratio, mask)


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "vanilla": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
