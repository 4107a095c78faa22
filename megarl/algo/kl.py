"""KL between the policy and the reference model: per-token estimators, the KL loss, KL-in-reward and its
coefficient controllers.

The estimators approximate KL(pi || pi_ref) from tokens sampled from pi, per token, with x = log_prob - ref_log_prob:
  kl  / k1   x                       unbiased, high variance, can be negative per token
  abs        |x|
  mse / k2   x^2 / 2                 biased, low variance
  low_var_kl / k3   exp(-x) + x - 1  unbiased and always >= 0 (Schulman's k3), clamped to [0, 10]
"""
from __future__ import annotations

from typing import Callable

import torch

from megarl.algo._checks import (
    check_finite,
    check_floating,
    check_mask,
    check_ndim,
    check_range,
    check_same_shape,
    lookup,
)
from megarl.algo.aggregation import agg_loss
from megarl.algo.masked import masked_mean

# k3 exponentiates the log-ratio; a few tokens with a huge ratio would otherwise dominate (or overflow) the loss.
K3_LOG_RATIO_CLAMP = 20.0
K3_MAX = 10.0


def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: log_prob - ref_log_prob."""
    return log_prob - ref_log_prob


def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: |log_prob - ref_log_prob|."""
    return (log_prob - ref_log_prob).abs()


def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: 0.5 * (log_prob - ref_log_prob)^2."""
    return 0.5 * (log_prob - ref_log_prob) ** 2


def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: exp(ref - logp) - (ref - logp) - 1, log-ratio clamped to +-20, result clamped to [0, 10]."""
    log_ratio = (ref_log_prob - log_prob).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1).clamp(0.0, K3_MAX)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": kl_k1, "k1": kl_k1,
    "abs": kl_abs,
    "mse": kl_k2, "k2": kl_k2,
    "low_var_kl": kl_k3, "k3": kl_k3,
}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty_type: str = "kl") -> torch.Tensor:
    """Per-token KL estimate. log_prob, ref_log_prob: [B, T] (or any equal shapes). Returns the same shape,
    unmasked: the caller applies its response mask."""
    estimator = lookup(KL_ESTIMATORS, kl_penalty_type, "kl_penalty_type")
    check_floating("log_prob", log_prob)
    check_same_shape("ref_log_prob", ref_log_prob, "log_prob", log_prob)
    return estimator(log_prob, ref_log_prob)


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
            kl_loss_type: str = "low_var_kl", loss_agg_mode: str = "token-mean", *, denominator=None,
            max_response_length=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a loss term (GRPO's use_kl_loss; the caller scales it by kl_loss_coef).

    log_prob [B, T] carries the gradient; ref_log_prob [B, T]; response_mask [B, T].
    Returns (loss, {"kl_loss": detached loss}).
    """
    check_ndim("log_prob", log_prob, 2, "[B, T]")
    mask = check_mask("response_mask", response_mask, "log_prob", log_prob)
    per_token = kl_penalty(log_prob, ref_log_prob.detach(), kl_loss_type)
    loss = agg_loss(per_token, mask, loss_agg_mode, denominator=denominator, max_response_length=max_response_length)
    return loss, {"kl_loss": loss.detach()}


@torch.no_grad()
def apply_kl_penalty(token_level_scores: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_coef: float, kl_penalty_type: str = "kl"
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward (PPO-RLHF): rewards = scores - kl_coef * KL per valid token.

    token_level_scores [B, T]: task rewards; log_prob [B, T]: the rollout policy's log-probs (old_log_prob);
    ref_log_prob [B, T]; response_mask [B, T].
    Returns (token_level_rewards [B, T], metrics) with "kl" (mean over sequences of each sequence's mean token
    KL, the value to feed a KL controller) and "kl_coef".
    """
    check_ndim("token_level_scores", token_level_scores, 2, "[B, T]")
    check_floating("token_level_scores", token_level_scores)
    check_same_shape("log_prob", log_prob, "token_level_scores", token_level_scores)
    mask = check_mask("response_mask", response_mask, "token_level_scores", token_level_scores)
    check_finite("token_level_scores", token_level_scores, "check the reward function's output")
    check_range("kl_coef", kl_coef, low=0)
    kld = torch.where(mask, kl_penalty(log_prob, ref_log_prob, kl_penalty_type), 0.0)
    rewards = token_level_scores - kl_coef * kld
    per_seq = masked_mean(kld, mask, dim=-1)
    current_kl = masked_mean(per_seq, mask.any(-1))
    return rewards, {"kl": current_kl, "kl_coef": torch.tensor(float(kl_coef))}


class FixedKLController:
    """A constant KL coefficient. `value` is the coefficient; update() is a no-op kept for a uniform interface."""

    def __init__(self, kl_coef: float):
        self.value = float(check_range("kl_coef", kl_coef, low=0))

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards target_kl (Ziegler et al., 2019).

    After each step: error = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value *= 1 + error * n_steps / horizon. The clip stops one noisy KL estimate from swinging the coefficient.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = float(check_range("init_kl_coef", init_kl_coef, low=0))
        self.target = float(check_range("target_kl", target_kl, low=0, low_open=True))
        self.horizon = float(check_range("horizon", horizon, low=0, low_open=True))

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


@torch.no_grad()
def reverse_kl_advantage(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                         response_mask: torch.Tensor, kl_coef: float = 1.0, center: bool = True
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy distillation's dense signal (Thinking Machines, "On-Policy Distillation", 2025; as in verl, slime and
    the tinker cookbook): on tokens sampled from the student, log pi_student(y_t) - log pi_teacher(y_t) is a one-sample
    estimate of the per-token reverse KL(student || teacher); its negative is the token's advantage (no discounting:
    each token is judged by the teacher on its own).

    student_log_prob, teacher_log_prob, response_mask: [B, T]. Returns (advantages [B, T] = -kl_coef * (student -
    teacher), 0 on masked positions; metrics) with reverse_kl (mean over valid tokens) and teacher_log_prob_mean.
    center: subtract the batch's mean over valid tokens first. A constant baseline leaves the expected gradient
    -grad KL(student || teacher) unchanged, but a weak student's reverse KL is large everywhere (a mean advantage of
    about -1.3 on the tiny demo), and uncentred that offset is mostly noise: "lower every sampled token".
    """
    check_ndim("student_log_prob", student_log_prob, 2, "[B, T]")
    check_floating("student_log_prob", student_log_prob)
    check_same_shape("teacher_log_prob", teacher_log_prob, "student_log_prob", student_log_prob)
    mask = check_mask("response_mask", response_mask, "student_log_prob", student_log_prob)
    check_range("kl_coef", kl_coef, low=0)
    kl = torch.where(mask, student_log_prob - teacher_log_prob, 0.0)
    mean_kl = masked_mean(kl, mask)
    signal = torch.where(mask, kl - mean_kl, 0.0) if center else kl
    return -kl_coef * signal, {"reverse_kl": mean_kl,
                           "teacher_log_prob_mean": masked_mean(torch.where(mask, teacher_log_prob, 0.0), mask)}
