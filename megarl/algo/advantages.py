"""Advantage estimators.

All estimators share one calling convention so the trainer can call `ADV_ESTIMATORS[name](**batch_kwargs)`:
keyword arguments only, drawn from ESTIMATOR_KWARGS:

  token_level_rewards [B, T]  reward per response token (outcome rewards sit on the last valid token)
  response_mask       [B, T]  bool or 0/1; False on padding (and on any token that is not the policy's own)
  index               [B]     group id per sample: an integer tensor or a sequence of hashables (prompt uid)
  values              [B, T]  critic values (gae)
  reward_baselines    [B]     reward of the greedy response for the same prompt (remax)
  gamma, lam                  discount and GAE lambda
  norm_adv_by_std             divide group-centred scores by the group std (grpo; False is Dr.GRPO)
  epsilon                     added to the group std before dividing
  whiten                      whiten gae advantages over the batch

Each returns (advantages [B, T], returns [B, T]), both 0 on masked positions and computed without autograd
(advantages are constants of the policy loss). An estimator ignores the keywords other estimators use, raises
ValueError when one it needs is None or missing, and rejects keywords no estimator knows (a typo such as
`norm_adv_by_std_in_grpo` must not be silently ignored).

Group of one: a lone sample has no peers to compare with, so grpo, drgrpo, rloo and the reinforce++ group
baseline give it a group-relative score of 0 (no learning signal), rather than its raw reward.

Masked tokens inside a response (e.g. tool output in multi-turn rollouts) are skipped by the recursive
estimators: they neither add reward nor discount, and the value bootstraps from the next valid token.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from megarl.algo._checks import (
    check_batch_vector,
    check_finite,
    check_floating,
    check_mask,
    check_ndim,
    check_range,
    check_same_shape,
)
from megarl.algo.groups import group_ids, group_mean_std
from megarl.algo.masked import masked_whiten

ESTIMATOR_KWARGS = frozenset({
    "token_level_rewards", "response_mask", "index", "values", "reward_baselines",
    "gamma", "lam", "norm_adv_by_std", "epsilon", "whiten",
})


def _check_kwargs(estimator: str, unused: dict[str, Any], **required: Any) -> None:
    unknown = sorted(set(unused) - ESTIMATOR_KWARGS)
    if unknown:
        raise ValueError(f"{estimator} advantage: unknown keyword(s) {unknown}; known: {sorted(ESTIMATOR_KWARGS)}")
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise ValueError(f"{estimator} advantage needs {missing}; got None (or not passed)")


def _check_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    check_ndim("token_level_rewards", token_level_rewards, 2, "[B, T]")
    check_floating("token_level_rewards", token_level_rewards)
    mask = check_mask("response_mask", response_mask, "token_level_rewards", token_level_rewards)
    check_finite("token_level_rewards", token_level_rewards, "check the reward function's output")
    return mask


def _zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _outcome_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B] float64: the whole-response reward (rewards on masked positions are ignored).

    float64 because a float32 group mean of equal rewards (e.g. sixteen 0.7s) is off by an ulp, and dividing
    that by a std of ~0 plus epsilon turns it into advantages of ~0.1 for a group that carries no signal.
    """
    return _zero_padding(token_level_rewards, mask).to(torch.float64).sum(-1)


def _group_stats(scores: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, num_groups = group_ids(index, scores.shape[0], device=scores.device)
    return group_mean_std(scores, ids, num_groups)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] -> ([B, T], copy) in dtype, 0 on masked positions."""
    adv = _zero_padding(per_seq[:, None].expand(mask.shape), mask).to(dtype)
    return adv, adv.clone()


@torch.no_grad()
def gae_advantage(*, token_level_rewards=None, response_mask=None, values=None, gamma: float = 1.0,
                  lam: float = 1.0, whiten: bool = True, **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (PPO with a critic).

    token_level_rewards, values, response_mask: [B, T]. Per valid token t (next = the next valid token, or the
    end of the response where V = 0):
        delta_t = r_t + gamma * V_next - V_t ;  A_t = delta_t + gamma * lam * A_next
    returns = A + V (the critic's regression target, before whitening). advantages are whitened over the batch's
    valid tokens when whiten is True. Both are 0 on masked positions.
    """
    _check_kwargs("gae", unused, token_level_rewards=token_level_rewards, response_mask=response_mask, values=values)
    mask = _check_rewards(token_level_rewards, response_mask)
    check_same_shape("values", values, "token_level_rewards", token_level_rewards)
    check_floating("values", values)
    check_range("gamma", gamma, low=0, high=1)
    check_range("lam", lam, low=0, high=1)
    rewards = token_level_rewards
    values = _zero_padding(values, mask)  # padding may hold garbage; it must not leak into a bootstrap
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(mask[:, t], adv_t, next_adv)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = next_adv
    returns = _zero_padding(advantages + values, mask)
    advantages = masked_whiten(advantages, mask) if whiten else _zero_padding(advantages, mask)
    return advantages, returns


@torch.no_grad()
def grpo_advantage(*, token_level_rewards=None, response_mask=None, index=None, norm_adv_by_std: bool = True,
                   epsilon: float = 1e-6, **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: each response's score relative to the other responses to the same prompt.

    token_level_rewards, response_mask: [B, T]; index: [B] group ids. score = sum of token rewards.
        A = (score - group_mean) / (group_std + epsilon)   if norm_adv_by_std   (std unbiased)
        A = score - group_mean                             otherwise (Dr.GRPO)
    broadcast over the valid tokens; returns == advantages. Groups of one and all-equal groups get 0.
    """
    _check_kwargs("grpo", unused, token_level_rewards=token_level_rewards, response_mask=response_mask, index=index)
    mask = _check_rewards(token_level_rewards, response_mask)
    scores = _outcome_scores(token_level_rewards, mask)
    mean, std, _ = _group_stats(scores, index)
    centred = scores - mean
    if norm_adv_by_std:
        centred = centred / (std + epsilon)
    return _broadcast(centred, mask, token_level_rewards.dtype)


def drgrpo_advantage(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: grpo_advantage with norm_adv_by_std=False (the std division biases towards easy/hard prompts)."""
    kwargs["norm_adv_by_std"] = False
    return grpo_advantage(**kwargs)


@torch.no_grad()
def rloo_advantage(*, token_level_rewards=None, response_mask=None, index=None,
                   **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: baseline = mean score of the other samples in the group (leave-one-out).

    token_level_rewards, response_mask: [B, T]; index: [B]. For a group of n > 1:
        A_i = score_i - (sum_group - score_i) / (n - 1)  ==  n / (n - 1) * (score_i - group_mean)
    broadcast over the valid tokens; returns == advantages. A group of one gets 0.
    """
    _check_kwargs("rloo", unused, token_level_rewards=token_level_rewards, response_mask=response_mask, index=index)
    mask = _check_rewards(token_level_rewards, response_mask)
    scores = _outcome_scores(token_level_rewards, mask)
    mean, _, count = _group_stats(scores, index)
    # n/(n-1) for n > 1; for n == 1, score - mean is already 0 and the factor is irrelevant.
    adv = (scores - mean) * count / (count - 1).clamp(min=1)
    return _broadcast(adv, mask, token_level_rewards.dtype)


@torch.no_grad()
def reinforce_pp_advantage(*, token_level_rewards=None, response_mask=None, gamma: float = 1.0,
                           **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch.

    token_level_rewards, response_mask: [B, T]. returns_t = r_t + gamma * returns_next (valid tokens only);
    advantages = masked_whiten(returns). Both 0 on masked positions.
    """
    _check_kwargs("reinforce_plus_plus", unused, token_level_rewards=token_level_rewards, response_mask=response_mask)
    mask = _check_rewards(token_level_rewards, response_mask)
    check_range("gamma", gamma, low=0, high=1)
    running = torch.zeros_like(token_level_rewards[:, 0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(mask[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = _zero_padding(returns, mask)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def reinforce_pp_baseline_advantage(*, token_level_rewards=None, response_mask=None, index=None,
                                    **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: score minus the group mean, broadcast to tokens, whitened over the batch.

    token_level_rewards, response_mask: [B, T]; index: [B]. returns == advantages. A group of one has centred
    score 0 before the batch whitening.
    """
    _check_kwargs("reinforce_plus_plus_baseline", unused, token_level_rewards=token_level_rewards,
                  response_mask=response_mask, index=index)
    mask = _check_rewards(token_level_rewards, response_mask)
    scores = _outcome_scores(token_level_rewards, mask)
    mean, _, _ = _group_stats(scores, index)
    centred, _ = _broadcast(scores - mean, mask, torch.float64)
    adv = masked_whiten(centred, mask).to(token_level_rewards.dtype)
    return adv, adv.clone()


@torch.no_grad()
def remax_advantage(*, token_level_rewards=None, response_mask=None, reward_baselines=None,
                    **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: undiscounted return-to-go minus the reward of the greedy response to the same prompt.

    token_level_rewards, response_mask: [B, T]; reward_baselines: [B].
    returns_t = sum_{s >= t, valid} r_s ; advantages_t = returns_t - reward_baselines. Both 0 on masked positions.
    """
    _check_kwargs("remax", unused, token_level_rewards=token_level_rewards, response_mask=response_mask,
                  reward_baselines=reward_baselines)
    mask = _check_rewards(token_level_rewards, response_mask)
    check_batch_vector("reward_baselines", reward_baselines, token_level_rewards.shape[0])
    check_finite("reward_baselines", reward_baselines, "check the greedy-rollout rewards")
    rewards = _zero_padding(token_level_rewards, mask)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    returns = _zero_padding(returns, mask)
    adv = _zero_padding(returns - reward_baselines[:, None].to(returns.dtype), mask)
    return adv, returns


ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": gae_advantage,
    "grpo": grpo_advantage,
    "drgrpo": drgrpo_advantage,
    "rloo": rloo_advantage,
    "reinforce_plus_plus": reinforce_pp_advantage,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline_advantage,
    "remax": remax_advantage,
}
