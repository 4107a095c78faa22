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

Losses with settings of their own take them as keyword-only arguments with defaults (POLICY_LOSS_OPTIONS lists
which, for the config to pass only those); losses that have no use for a common argument accept and ignore it.
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


def _gated_sigmoid(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "seq-mean-token-mean",
              clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = None, *,
              tau_pos: float = 1.0, tau_neg: float = 1.05, rollout_is_weights=None, denominator=None,
              max_response_length=None):
    """SAPO: Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv 2511.20347; verl's "sapo").

    Shapes: see the module docstring. Instead of a hard clip, each token's ratio r passes a smooth gate
        L = -A * f(r),   f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
    f(1) = 2 / tau and f'(1) = 1, so on-policy the gradient is the policy gradient; away from r = 1 the gradient
    4 s (1 - s) (s = the sigmoid) decays smoothly instead of dropping to 0. tau_neg > tau_pos damps negative updates
    faster (they are the less stable ones). The clip ratios and clip_ratio_c are ignored. loss_agg_mode is followed;
    the default, seq-mean-token-mean, is the paper's, and verl 0.9.1's sapo uses it whatever its loss_agg_mode says
    (convert-verl sets actor.loss_agg_mode to it; other modes weigh tokens differently, a choice of the recipe).
    Returns (loss, metrics) with pg_clipfrac (0: nothing is clipped) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    check_range("tau_pos", tau_pos, low=0, low_open=True)
    check_range("tau_neg", tau_neg, low=0, low_open=True)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    tau = torch.where(adv > 0, torch.as_tensor(float(tau_pos), dtype=adv.dtype),
                      torch.as_tensor(float(tau_neg), dtype=adv.dtype))
    pg_losses = -adv * _gated_sigmoid(log_ratio.exp(), tau)
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    none = torch.zeros_like(mask)
    return loss, _clip_metrics(none, none, log_ratio, mask)


def gpg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
             clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = None, *,
             rollout_is_weights=None, denominator=None, max_response_length=None):
    """GPG's loss (Chu et al. 2025, arXiv 2504.02546; verl's "gpg"): the plain policy gradient, no surrogate.

    Shapes: see the module docstring. Per token L = -A * log_prob; the gradient is -A grad log pi whatever the
    old policy (no ratio, no clip: meant for one optimizer step per batch). old_log_prob is read only for ppo_kl.
    Returns (loss, metrics) with pg_clipfrac (0) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    pg_losses = -adv * torch.where(mask, log_prob, 0.0)
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    none = torch.zeros_like(mask)
    return loss, _clip_metrics(none, none, log_ratio, mask)


def _centred_product(adv: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A) * (log_prob - mean log_prob) per valid token (means over the valid tokens): each token's
    contribution to the covariance that drives the entropy change (Cui et al. 2025)."""
    lp = torch.where(mask, log_prob.detach(), 0.0)
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def clip_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                  clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = None, *,
                  clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                  generator: torch.Generator | None = None, rollout_is_weights=None, denominator=None,
                  max_response_length=None):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617; verl's
    "clip_cov").

    Shapes: see the module docstring. The PPO clipped surrogate max(-A r, -A clip(r, 1 - low, 1 + high)) (no dual
    clip), then entropy collapse is slowed by detaching a few high-covariance tokens: among the valid tokens the clip
    left alone whose centred product cov = (A - mean A)(log_prob - mean log_prob) lies in (clip_cov_lb, clip_cov_ub),
    max(1, int(clip_cov_ratio * #valid tokens)) are drawn at random (torch.randperm with `generator`) and their loss
    is zeroed. Means and counts are over this call's tokens (a micro-batch, as in verl). clip_ratio_c is ignored.
    Returns (loss, metrics) with pg_clipfrac (fraction of valid tokens cut by the PPO clip or the covariance rule),
    pg_clipfrac_upper/lower (the PPO clip alone), cov_clipfrac (the covariance rule alone) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    _check_clip(clip_ratio_low, clip_ratio_high)
    check_range("clip_cov_ratio", clip_cov_ratio, low=0, low_open=True, high=1)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    cut_by_clip = mask & (clipped > unclipped)
    cov = _centred_product(adv, log_prob, mask)
    candidates = (mask & ~cut_by_clip & (cov > clip_cov_lb) & (cov < clip_cov_ub)).flatten().nonzero().flatten()
    budget = max(int(clip_cov_ratio * int(mask.sum())), 1)
    if candidates.numel() > budget:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:budget]]
    detached = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    detached[candidates] = True
    detached = detached.view_as(mask)
    pg_losses = torch.where(detached, 0.0, torch.maximum(unclipped, clipped))
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    upper = mask & (adv > 0) & (ratio > 1 + clip_ratio_high)
    lower = mask & (adv < 0) & (ratio < 1 - clip_ratio_low)
    metrics = _clip_metrics(upper, lower, log_ratio, mask)
    metrics["pg_clipfrac"] = masked_mean((cut_by_clip | detached).to(log_ratio.dtype), mask).detach()
    metrics["cov_clipfrac"] = masked_mean(detached.to(log_ratio.dtype), mask).detach()
    return loss, metrics


def kl_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = None, *,
                kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1, rollout_is_weights=None, denominator=None,
                max_response_length=None):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617; verl's "kl_cov"): no clipping; a KL penalty on the tokens with the
    largest covariance.

    Shapes: see the module docstring. Per token L = -A r; on the top max(1, int(kl_cov_ratio * #valid tokens))
    valid tokens by cov = (A - mean A)(log_prob - mean log_prob) (means over this call's valid tokens),
    L = -A r + ppo_kl_coef * |log r|. The clip ratios and clip_ratio_c are ignored.
    Returns (loss, metrics) with pg_clipfrac (0), kl_cov_frac (fraction of valid tokens penalised) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    check_range("kl_cov_ratio", kl_cov_ratio, low=0, low_open=True, high=1)
    check_range("ppo_kl_coef", ppo_kl_coef, low=0)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    pg_losses = -adv * log_ratio.exp()
    penalised = torch.zeros_like(mask)
    n_valid = int(mask.sum())
    if n_valid:
        cov = _centred_product(adv, log_prob, mask).flatten()
        valid_idx = mask.flatten().nonzero().flatten()
        k = max(1, int(n_valid * kl_cov_ratio))
        top = valid_idx[torch.topk(cov[valid_idx], k).indices]
        penalised = penalised.flatten().index_fill(0, top, True).view_as(mask)
    pg_losses = torch.where(penalised, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    none = torch.zeros_like(mask)
    metrics = _clip_metrics(none, none, log_ratio, mask)
    metrics["kl_cov_frac"] = masked_mean(penalised.to(log_ratio.dtype), mask).detach()
    return loss, metrics


def geo_mean_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "seq-mean-token-mean",
                  clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.4, clip_ratio_c: float | None = None, *,
                  rollout_is_weights=None, denominator=None, max_response_length=None):
    """GMPO: Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673; verl's "geo_mean").

    Shapes: see the module docstring. The clip acts on log-ratios x_t = log r_t, per token and pessimistically
    (x clamped to [-clip_ratio_low, clip_ratio_high], the clamp kept only where it lowers the objective):
        x'_t = sign(A) * min(sign(A) x_t, sign(A) clamp(x_t))
        L_i  = -Abar_i * exp(mean over valid t of x'_t),   Abar_i = mean over valid t of A_t
    i.e. the geometric mean of the token ratios, less sensitive to one outlier token than the arithmetic mean. L_i is
    placed on each valid token of sequence i and aggregated with loss_agg_mode: seq-mean-token-mean (the default)
    gives mean_i L_i, the paper's mean over sequences and what verl 0.9.1 computes whatever its loss_agg_mode says
    (convert-verl sets it); token-mean weighs each L_i by its length. The paper clips wider than PPO (its
    ranges are in log space, e.g. 0.4). With rollout_is_weights, each sequence is weighted by their geometric mean.
    clip_ratio_c is ignored. Returns (loss, metrics) with pg_clipfrac (valid tokens whose log-ratio lies outside
    the range, as verl counts them: _upper where A > 0, _lower where A < 0) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    _check_clip(clip_ratio_low, clip_ratio_high)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(-1).clamp(min=1)
    seq_ratio = torch.exp(torch.where(mask, pessimistic, 0.0).sum(-1) / lengths)
    seq_adv = adv.sum(-1) / lengths
    seq_loss = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.where(mask, torch.log(rollout_is_weights.detach().clamp(min=1e-10)), 0.0)
        seq_loss = seq_loss * torch.exp(log_w.sum(-1) / lengths)
    pg_losses = seq_loss[:, None].expand_as(log_ratio)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, denominator=denominator, max_response_length=max_response_length)
    cut = mask & (clamped != log_ratio)
    return loss, _clip_metrics(cut & (adv > 0), cut & (adv < 0), log_ratio, mask)


def dro_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
             clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = None, *,
             dro_beta: float | None = None, rollout_is_weights=None, denominator=None, max_response_length=None):
    """DRO: Direct Reward Optimization with a quadratic log-ratio penalty (Richemond et al. 2024, "Offline
    Regularised Reinforcement Learning for LLM Alignment", arXiv 2405.19107; verl's "dro").

    Shapes: see the module docstring. Per token L = -(A log_prob - dro_beta / 2 * (log_prob - old_log_prob)^2):
    a policy gradient whose quadratic term pulls the policy back towards the one that sampled, instead of a clip.
    dro_beta must be > 0 (ValueError otherwise; verl has no default). The clip ratios and clip_ratio_c are ignored.
    Returns (loss, metrics) with pg_clipfrac (0) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if dro_beta is None:
        raise ValueError("dro_loss needs dro_beta > 0 (actor.policy_loss_options.dro_beta); got None")
    check_range("dro_beta", dro_beta, low=0, low_open=True)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    lp = torch.where(mask, log_prob, 0.0)
    pg_losses = -(adv * lp - 0.5 * dro_beta * log_ratio.square())
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    none = torch.zeros_like(mask)
    return loss, _clip_metrics(none, none, log_ratio, mask)


def _dppo_loss(valid, log_ratio, log_prob, adv, mask, clip_ratio_c, rollout_is_weights, loss_agg_mode,
               denominator, max_response_length):
    """Shared tail of the DPPO losses: truncated-IS policy gradient on the tokens inside the divergence bound."""
    ratio = log_ratio.exp().detach()
    weight = ratio if clip_ratio_c is None else ratio.clamp(max=clip_ratio_c)
    lp = torch.where(mask, log_prob, 0.0)
    pg_losses = torch.where(valid, -adv * weight * lp, 0.0)
    loss = _finish(pg_losses, mask, rollout_is_weights, loss_agg_mode, denominator, max_response_length)
    outside = mask & ~valid
    metrics = _clip_metrics(outside & (adv > 0), outside & (adv <= 0), log_ratio, mask)
    truncated = mask & valid & (ratio > clip_ratio_c) if clip_ratio_c is not None else torch.zeros_like(mask)
    metrics["truncated_frac"] = masked_mean(truncated.to(log_ratio.dtype), mask).detach()
    return loss, metrics


def dppo_tv_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                 clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 20.0, *,
                 rollout_is_weights=None, denominator=None, max_response_length=None):
    """DPPO-Binary-TV (Divergence PPO, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv
    2602.04879; verl's "dppo_tv").

    Shapes: see the module docstring. The trust region is on the sampled token's probability, not its ratio: a token
    keeps its gradient unless the update already moved its probability p = exp(log_prob) past the bound in the
    direction the advantage pushes,
        valid = p - p_old <= clip_ratio_high   where A > 0
        valid = p - p_old >= -clip_ratio_low   where A <= 0
    (clip_ratio_low/high are total-variation bounds here, not ratio bounds). On valid tokens
        L = -A * sg[min(r, clip_ratio_c)] * log_prob
    whose gradient is -A min(r, c) grad log pi: the ratio is a truncated importance weight (clip_ratio_c None: not
    truncated; the paper recommends a large bound such as 20). Invalid tokens get no gradient.
    Returns (loss, metrics) with pg_clipfrac (tokens outside the bound; _upper: A > 0, _lower: A <= 0),
    truncated_frac (valid tokens whose weight was truncated) and ppo_kl.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    _check_clip(clip_ratio_low, clip_ratio_high)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    p = torch.where(mask, log_prob.detach(), 0.0).exp()
    p_old = torch.where(mask, old_log_prob.detach(), 0.0).exp()
    valid = mask & torch.where(adv > 0, p - p_old <= clip_ratio_high, p - p_old >= -clip_ratio_low)
    return _dppo_loss(valid, log_ratio, log_prob, adv, mask, clip_ratio_c, rollout_is_weights, loss_agg_mode,
                      denominator, max_response_length)


def dppo_kl_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                 clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 20.0, *,
                 rollout_is_weights=None, denominator=None, max_response_length=None):
    """DPPO-Binary-KL (arXiv 2602.04879; verl's "dppo_kl"): dppo_tv with the bound on the KL between the Bernoulli
    distributions {sampled token, anything else} before and after the update,
        D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        valid = D <= clip_ratio_high or p <= p_old   where A > 0   (only moves towards the advantage are bounded)
        valid = D <= clip_ratio_low  or p >= p_old   where A <= 0
    and the same truncated-IS loss on valid tokens. Shapes and metrics: see dppo_tv_loss.
    """
    mask = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    _check_clip(clip_ratio_low, clip_ratio_high)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = _log_ratio(log_prob, old_log_prob, mask)
    lp = torch.where(mask, log_prob.detach(), 0.0)
    lp_old = torch.where(mask, old_log_prob.detach(), 0.0)
    p, p_old = lp.exp(), lp_old.exp()
    binary_kl = p_old * (lp_old - lp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    valid = mask & torch.where(adv > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                               (binary_kl <= clip_ratio_low) | (p >= p_old))
    return _dppo_loss(valid, log_ratio, log_prob, adv, mask, clip_ratio_c, rollout_is_weights, loss_agg_mode,
                      denominator, max_response_length)


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "vanilla": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "gpg": gpg_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
    "geo_mean": geo_mean_loss,
    "dro": dro_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
}

# The settings each loss reads beyond the common ones (actor.policy_loss_options.<name> in the config).
POLICY_LOSS_OPTIONS: dict[str, tuple[str, ...]] = {
    "sapo": ("tau_pos", "tau_neg"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    "dro": ("dro_beta",),
}
