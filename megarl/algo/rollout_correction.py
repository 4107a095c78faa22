"""Rollout correction: the engine that sampled the responses (vLLM, other kernels, other precision) is not
numerically the policy the trainer differentiates. With r = pi_train / pi_rollout evaluated on the sampled tokens,
these functions reweight (truncated importance sampling), drop (rejection) or measure that drift.

Common arguments:
  old_log_prob     [B, T]  trainer log-probs of the sampled tokens, before the update (pi_train)
  rollout_log_prob [B, T]  the engine's log-probs of the same tokens (pi_rollout)
  response_mask    [B, T]  bool or 0/1
Everything here is computed without autograd: the outputs are constants of the loss.
"""
from __future__ import annotations

import math

import torch

from megarl.algo._checks import check_floating, check_mask, check_ndim, check_range, check_same_shape, lookup
from megarl.algo.masked import masked_mean

# Sequence log-ratios are sums over many tokens; clamping before exp() keeps weights and chi-square finite.
LOG_RATIO_CLAMP = 20.0

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
REJECTION_LEVELS = ("token", "sequence", "geometric", "seq_mean_k3")

# verl's names (logged under rollout_corr/) of rollout_mismatch_metrics' values
VERL_MISMATCH_NAMES = {
    "mismatch_kl": "kl", "mismatch_k3_kl": "k3_kl", "training_log_ppl": "training_log_ppl",
    "rollout_log_ppl": "rollout_log_ppl", "training_ppl": "training_ppl", "rollout_ppl": "rollout_ppl",
    "mismatch_log_ppl_diff": "log_ppl_diff", "mismatch_log_ppl_abs_diff": "log_ppl_abs_diff",
    "mismatch_log_ppl_diff_max": "log_ppl_diff_max", "mismatch_log_ppl_diff_min": "log_ppl_diff_min",
    "mismatch_ppl_ratio": "ppl_ratio", "mismatch_chi2_token": "chi2_token", "mismatch_chi2_seq": "chi2_seq",
}
# ... and of the weight and rejection metrics
VERL_CORRECTION_NAMES = {
    "is_weight_mean": "rollout_is_mean", "is_weight_max": "rollout_is_max",
    "rejected_token_frac": "rollout_rs_masked_fraction", "rejected_seq_frac": "rollout_rs_seq_masked_fraction",
}


def _log_ratio(old_log_prob, rollout_log_prob, response_mask) -> tuple[torch.Tensor, torch.Tensor]:
    check_ndim("old_log_prob", old_log_prob, 2, "[B, T]")
    check_floating("old_log_prob", old_log_prob)
    check_same_shape("rollout_log_prob", rollout_log_prob, "old_log_prob", old_log_prob)
    mask = check_mask("response_mask", response_mask, "old_log_prob", old_log_prob)
    log_ratio = torch.where(mask, old_log_prob.detach() - rollout_log_prob.detach(), 0.0)
    return log_ratio, mask


def _seq_mean(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of a [B] tensor over the sequences that have at least one valid token."""
    return masked_mean(per_seq, mask.any(-1))


@torch.no_grad()
def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       level: str = "token", threshold: float = 2.0, threshold_lower: float | None = None,
                       mode: str = "truncate") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights pi_train / pi_rollout, to multiply into the policy loss.

    level "token":    w_t = min(r_t, threshold)
    level "sequence": w_i = min(prod_t r_t, threshold) for every token of sequence i
    threshold_lower, if given, also clamps from below. Truncation trades a little bias for bounded variance.
    mode "mask" (IcePop, verl's "lower_upper" thresholds): a weight outside [threshold_lower, threshold] is set to 0
    instead of clamped (the token keeps its place in the mask but contributes no gradient).
    Returns (weights [B, T], 0 on padding; metrics) with is_weight_mean (over valid tokens, after truncation),
    is_weight_max (before truncation) and is_truncated_frac (fraction of valid tokens, or of sequences at
    sequence level, whose weight was truncated or zeroed).
    """
    lookup(dict.fromkeys(IS_LEVELS), level, "rollout IS level")
    lookup(dict.fromkeys(IS_MODES), mode, "rollout IS mode")
    check_range("threshold", threshold, low=0, low_open=True)
    if threshold_lower is not None:
        check_range("threshold_lower", threshold_lower, low=0, high=threshold)
    log_ratio, mask = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    raw = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if mode == "mask":
        inside = (raw <= threshold) & (raw >= (threshold_lower if threshold_lower is not None else 0.0))
        weights = torch.where(inside, raw, torch.zeros_like(raw))
    else:
        weights = raw.clamp(min=threshold_lower, max=threshold)
    truncated = mask & (weights != raw)
    weights = torch.where(mask, weights, 0.0)
    if level == "sequence":
        truncated_frac = _seq_mean(truncated.any(-1).to(raw.dtype), mask)
    else:
        truncated_frac = masked_mean(truncated.to(raw.dtype), mask)
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_max": torch.where(mask, raw, 0.0).amax() if raw.numel() else raw.new_zeros(()),
        "is_truncated_frac": truncated_frac,
    }
    return weights, metrics


@torch.no_grad()
def rollout_rejection_mask(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                           level: str = "token", threshold: float = 2.0, threshold_lower: float | None = None
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Drop tokens or sequences whose ratio leaves [threshold_lower, threshold] (default lower: 1 / threshold).

    level "token":     reject token t if r_t is outside the interval
    level "sequence":  reject sequence i if prod_t r_t is outside
    level "geometric": reject sequence i if the geometric mean exp(mean_t log r_t) is outside; length-independent,
                       so the interval is typically tight (e.g. threshold 1.001)
    level "seq_mean_k3": reject sequence i if mean_t (r_t - 1 - log r_t) (the k3 estimate of KL(rollout || train),
                       >= 0) exceeds threshold, a divergence bound (e.g. 0.01; threshold_lower is not used)
    Returns (mask [B, T] bool: response_mask with rejected positions removed; metrics) with rejected_token_frac
    (fraction of valid tokens removed) and rejected_seq_frac (fraction of non-empty sequences that lost any token).
    """
    lookup(dict.fromkeys(REJECTION_LEVELS), level, "rollout rejection level")
    if level == "seq_mean_k3":
        check_range("threshold", threshold, low=0, low_open=True)
        log_ratio, mask = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
        clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.where(mask, clamped.exp() - 1 - clamped, 0.0)
        stat = k3.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        return _rejection_result(mask, stat > threshold, log_ratio.dtype)
    check_range("threshold", threshold, low=1)
    if threshold_lower is None:
        lower = 1.0 / threshold
    else:
        lower = check_range("threshold_lower", threshold_lower, low=0, high=1)
    log_ratio, mask = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
    if level == "sequence":
        stat = log_ratio.sum(-1, keepdim=True)
    elif level == "geometric":
        stat = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    else:
        stat = log_ratio
    # Compare in log space: no overflow, and threshold_lower = 0 (log = -inf) means no lower bound.
    log_lower = math.log(lower) if lower > 0 else -math.inf
    outside = (stat > math.log(threshold)) | (stat < log_lower)
    return _rejection_result(mask, outside, log_ratio.dtype)


def _rejection_result(mask: torch.Tensor, outside: torch.Tensor, dtype) -> tuple[torch.Tensor, dict]:
    rejected = mask & outside.expand_as(mask)
    accepted = mask & ~rejected
    metrics = {
        "rejected_token_frac": masked_mean(rejected.to(dtype), mask),
        "rejected_seq_frac": _seq_mean(rejected.any(-1).to(dtype), mask),
    }
    return accepted, metrics


@torch.no_grad()
def rollout_mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's distribution is from the trainer's, on the sampled tokens.

    Returns 0-d tensors:
      mismatch_kl            mean_t(log pi_rollout - log pi_train): k1 estimate of KL(rollout || train)
      mismatch_k3_kl         mean_t(r - 1 - log r): non-negative k3 estimate of the same KL
      training_log_ppl, rollout_log_ppl   mean over sequences of -mean_t log-prob
      mismatch_log_ppl_diff  mean over sequences of (training log-ppl - rollout log-ppl)
      mismatch_log_ppl_abs_diff  the same with |.| per sequence
      mismatch_chi2_token    mean_t r^2 - 1: chi-square divergence per token
      mismatch_chi2_seq      mean_i (prod_t r_t)^2 - 1: chi-square of whole sequences (log-ratio clamped)
      training_ppl, rollout_ppl   mean over sequences of exp(log-ppl)
      mismatch_ppl_ratio     mean over sequences of exp(training log-ppl - rollout log-ppl)
      mismatch_log_ppl_diff_max, _min   the extremes of the per-sequence log-ppl difference
    VERL_MISMATCH_NAMES gives verl's name of each (rollout_corr/kl, rollout_corr/log_ppl_abs_diff, ...).
    """
    log_ratio, mask = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
    lengths = mask.sum(-1).clamp(min=1)
    train_log_ppl = -torch.where(mask, old_log_prob, 0.0).sum(-1) / lengths
    rollout_log_ppl = -torch.where(mask, rollout_log_prob, 0.0).sum(-1) / lengths
    token_log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_log_ratio = log_ratio.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "mismatch_kl": masked_mean(-log_ratio, mask),
        "mismatch_k3_kl": masked_mean(token_log_ratio.exp() - 1 - token_log_ratio, mask),
        "training_log_ppl": _seq_mean(train_log_ppl, mask),
        "rollout_log_ppl": _seq_mean(rollout_log_ppl, mask),
        "mismatch_log_ppl_diff": _seq_mean(train_log_ppl - rollout_log_ppl, mask),
        "mismatch_log_ppl_abs_diff": _seq_mean((train_log_ppl - rollout_log_ppl).abs(), mask),
        "mismatch_chi2_token": masked_mean((2 * token_log_ratio).exp(), mask) - 1,
        "mismatch_chi2_seq": _seq_mean((2 * seq_log_ratio).exp(), mask) - 1,
        "training_ppl": _seq_mean(train_log_ppl.exp(), mask),
        "rollout_ppl": _seq_mean(rollout_log_ppl.exp(), mask),
        "mismatch_ppl_ratio": _seq_mean((train_log_ppl - rollout_log_ppl).clamp(max=LOG_RATIO_CLAMP).exp(), mask),
        "mismatch_log_ppl_diff_max": _seq_extreme(train_log_ppl - rollout_log_ppl, mask, torch.amax),
        "mismatch_log_ppl_diff_min": _seq_extreme(train_log_ppl - rollout_log_ppl, mask, torch.amin),
    }


def _seq_extreme(per_seq: torch.Tensor, mask: torch.Tensor, reduce) -> torch.Tensor:
    """max/min of a [B] tensor over the sequences with a valid token (0 when there is none)."""
    present = mask.any(-1)
    return reduce(per_seq[present]) if bool(present.any()) else per_seq.new_zeros(())
