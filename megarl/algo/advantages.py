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
  reward_components   [B, K]  gdpo: K reward dimensions per sample (None: the one outcome score)
  reward_weights      [K]     gdpo: weight of each dimension (None: 1 each)
  old_log_probs       [B, T]  optimal_token_baseline: log-prob of the sampled token under the sampling policy
  sum_pi_squared      [B, T]  optimal_token_baseline: sum over the vocabulary of pi^2 at each position
  rollout_is_weights  [B, T]  optimal_token_baseline: rollout-correction weights (None: no correction)

Each returns (advantages [B, T], returns [B, T]), both 0 on masked positions and computed without autograd
(advantages are constants of the policy loss). An estimator ignores the keywords other estimators use, raises
ValueError when one it needs is None or missing, and rejects keywords no estimator knows (a typo such as
`norm_adv_by_std_in_grpo` must not be silently ignored).

Group of one: a lone sample has no peers to compare with, so grpo, drgrpo, rloo, the reinforce++ group baseline,
opo, gpg, gdpo and optimal_token_baseline give it a group-relative score of 0 (no learning signal), rather than its
raw reward (verl gives some of them the raw reward).

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
    "reward_components", "reward_weights", "old_log_probs", "sum_pi_squared", "rollout_is_weights",
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


@torch.no_grad()
def opo_advantage(*, token_level_rewards=None, response_mask=None, index=None,
                  **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (On-Policy RL with Optimal reward baseline, Hao et al. 2025, arXiv 2505.23585; verl's "opo").

    token_level_rewards, response_mask: [B, T]; index: [B]. The baseline is the length-weighted mean score of the group,
        b = sum_j |o_j| * score_j / sum_j |o_j|      (|o_j| = valid tokens of response j)
        A_i = score_i - b
    the optimal baseline for a sequence-level reward when the per-token gradient norms are about equal (the gradient
    variance of a response grows with its length). Broadcast over the valid tokens; returns == advantages. A group of
    one gets 0 (verl gives it its raw score; see the module docstring).
    """
    _check_kwargs("opo", unused, token_level_rewards=token_level_rewards, response_mask=response_mask, index=index)
    mask = _check_rewards(token_level_rewards, response_mask)
    scores = _outcome_scores(token_level_rewards, mask)
    lengths = mask.sum(-1).to(torch.float64)
    ids, num_groups = group_ids(index, scores.shape[0], device=scores.device)

    def per_group(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, ids, x)[ids]

    count = per_group(torch.ones_like(scores))
    baseline = per_group(lengths * scores) / per_group(lengths).clamp(min=1)
    adv = torch.where(count > 1, scores - baseline, torch.zeros_like(scores))
    return _broadcast(adv, mask, token_level_rewards.dtype)


@torch.no_grad()
def gpg_advantage(*, token_level_rewards=None, response_mask=None, index=None,
                  **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Group Policy Gradient, Chu et al. 2025, arXiv 2504.02546), as verl's "gpg" estimator computes it.

    token_level_rewards, response_mask: [B, T]; index: [B].
        A_i = alpha * (score_i - group_mean),   alpha = B / max(1, #samples in the batch with a non-zero score)
    alpha rescales the batch gradient so that samples contributing nothing do not dilute it (verl counts non-zero
    scores; with 0/1 rewards that is the correct samples). No std division (f_norm = 1). Broadcast over the valid
    tokens; returns == advantages. A group of one gets 0. Pair with actor.policy_loss=gpg (plain policy gradient).
    """
    _check_kwargs("gpg", unused, token_level_rewards=token_level_rewards, response_mask=response_mask, index=index)
    mask = _check_rewards(token_level_rewards, response_mask)
    scores = _outcome_scores(token_level_rewards, mask)
    mean, _, _ = _group_stats(scores, index)
    alpha = scores.shape[0] / max(1, int(torch.count_nonzero(scores)))
    return _broadcast(alpha * (scores - mean), mask, token_level_rewards.dtype)


@torch.no_grad()
def grpo_passk_advantage(*, token_level_rewards=None, response_mask=None, index=None, norm_adv_by_std: bool = True,
                         epsilon: float = 1e-6, **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025, "Pass@k Training", arXiv 2503.19595; verl's "grpo_passk").

    token_level_rewards, response_mask: [B, T]; index: [B]. Only the best response of each group learns: its advantage
    is (best score - second-best score), divided by (group std + epsilon) when norm_adv_by_std; every other response
    gets 0. This optimises the group's maximum (pass@k with k = the group size) rather than its mean. Ties go to the
    first of the best responses in batch order (its advantage is then 0 anyway). Groups must have at least 2 samples
    (ValueError otherwise: the second best is undefined). Broadcast over the valid tokens; returns == advantages.
    """
    _check_kwargs("grpo_passk", unused, token_level_rewards=token_level_rewards, response_mask=response_mask,
                  index=index)
    mask = _check_rewards(token_level_rewards, response_mask)
    scores = _outcome_scores(token_level_rewards, mask)
    ids, num_groups = group_ids(index, scores.shape[0], device=scores.device)
    _, std, count = group_mean_std(scores, ids, num_groups)
    if bool((count < 2).any()):
        lone = sorted({int(i) for i in ids[count < 2]})
        raise ValueError(f"grpo_passk needs at least 2 samples per group (the second-best score is its baseline); "
                         f"group(s) {lone[:5]} have one; set rollout.n >= 2")
    adv = torch.zeros_like(scores)
    for g in range(num_groups):
        rows = (ids == g).nonzero().flatten()
        ordered = torch.sort(scores[rows], descending=True).values
        best = rows[int(torch.argmax(scores[rows]))]  # argmax gives the first of equal maxima
        gap = ordered[0] - ordered[1]
        adv[best] = gap / (std[best] + epsilon) if norm_adv_by_std else gap
    return _broadcast(adv, mask, token_level_rewards.dtype)


@torch.no_grad()
def gdpo_advantage(*, token_level_rewards=None, response_mask=None, index=None, reward_components=None,
                   reward_weights=None, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
                   **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (Group reward-Decoupled normalization Policy Optimization, Liu et al. 2026, arXiv 2601.05242; verl's
    "gdpo").

    token_level_rewards, response_mask: [B, T]; index: [B]; reward_components: [B, K] (K reward dimensions per sample,
    e.g. correctness and format) or None (then K = 1: the outcome score); reward_weights: [K] or None (all 1).
        A_k = GRPO advantage of dimension k alone (group-centred, / (group std + epsilon) when norm_adv_by_std)
        A   = whiten over the batch's valid tokens of sum_k w_k A_k
    Normalising each dimension before summing keeps distinct reward combinations apart (GRPO on the sum maps (1, 0)
    and (0, 1) to the same advantage) and stops one dimension's scale drowning the others. With reward_components the
    token rewards are not read (as in verl: a KL-in-reward penalty does not enter). Groups of one contribute 0 before
    the whitening. returns == advantages.
    """
    _check_kwargs("gdpo", unused, token_level_rewards=token_level_rewards, response_mask=response_mask, index=index)
    mask = _check_rewards(token_level_rewards, response_mask)
    if reward_components is None:
        components = _outcome_scores(token_level_rewards, mask)[:, None]
    else:
        check_ndim("reward_components", reward_components, 2, "[B, K]")
        check_floating("reward_components", reward_components)
        check_batch_vector("reward_components[:, 0]", reward_components[:, 0], token_level_rewards.shape[0])
        check_finite("reward_components", reward_components, "check the reward function's extra values")
        components = reward_components.to(torch.float64)
    k = components.shape[1]
    if reward_weights is None:
        weights = torch.ones(k, dtype=torch.float64)
    else:
        weights = torch.as_tensor(reward_weights, dtype=torch.float64)
        check_batch_vector("reward_weights", weights, k)
    ids, num_groups = group_ids(index, components.shape[0], device=components.device)
    total = torch.zeros(components.shape[0], dtype=torch.float64, device=components.device)
    for j in range(k):
        mean, std, _ = group_mean_std(components[:, j], ids, num_groups)
        centred = components[:, j] - mean
        if norm_adv_by_std:
            centred = centred / (std + epsilon)
        total = total + weights[j] * centred
    per_token, _ = _broadcast(total, mask, torch.float64)
    adv = masked_whiten(per_token, mask).to(token_level_rewards.dtype)
    return adv, adv.clone()


@torch.no_grad()
def optimal_token_baseline_advantage(*, token_level_rewards=None, response_mask=None, index=None,
                                     old_log_probs=None, sum_pi_squared=None, rollout_is_weights=None,
                                     epsilon: float = 1e-8, **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (verl's "optimal_token_baseline"): a per-position baseline shared by a prompt's group.

    token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights (optional): [B, T];
    index: [B]. The variance-minimising baseline for the gradient at position t weighs each trajectory by the squared
    norm of its score function so far. With logit gradients, ||d log pi(y_j) / d logits||^2 = 1 - 2 pi_j + sum pi^2,
        w_j = 1 - 2 pi(y_j) + sum_v pi(v)^2            (pi(y_j) = exp(old_log_probs), per valid token)
        w_j *= rho_j^2                                  when rollout_is_weights rho are given (truncated IS)
        W_t = sum_{j <= t, valid} w_j                   (cumulative path variance)
        G_t = sum_{s >= t, valid} r_s                   (return to go)
        B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + epsilon)   over the group's responses valid at t
        A_t = G_t - B_t
    As verl does, where one response of a group is strictly the longest, its positions beyond the second-longest get
    baseline 0 (only it is valid there, so the baseline would cancel its own return). A group of one gets 0 (megarl's
    convention; verl keeps its raw return). Returns (advantages, returns = G), 0 on masked positions.
    """
    _check_kwargs("optimal_token_baseline", unused, token_level_rewards=token_level_rewards,
                  response_mask=response_mask, index=index, old_log_probs=old_log_probs,
                  sum_pi_squared=sum_pi_squared)
    mask = _check_rewards(token_level_rewards, response_mask)
    check_same_shape("old_log_probs", old_log_probs, "token_level_rewards", token_level_rewards)
    check_same_shape("sum_pi_squared", sum_pi_squared, "token_level_rewards", token_level_rewards)
    rewards = _zero_padding(token_level_rewards, mask).to(torch.float64)
    returns = _zero_padding(rewards.flip(-1).cumsum(-1).flip(-1), mask)
    w = 1 - 2 * old_log_probs.to(torch.float64).exp() + sum_pi_squared.to(torch.float64)
    if rollout_is_weights is not None:
        check_same_shape("rollout_is_weights", rollout_is_weights, "token_level_rewards", token_level_rewards)
        w = w * rollout_is_weights.to(torch.float64) ** 2
    cum_w = _zero_padding(w, mask).cumsum(-1)
    maskf = mask.to(torch.float64)
    ids, num_groups = group_ids(index, rewards.shape[0], device=rewards.device)
    num = torch.zeros(num_groups, rewards.shape[1], dtype=torch.float64).index_add_(0, ids, returns * cum_w * maskf)
    den = torch.zeros(num_groups, rewards.shape[1], dtype=torch.float64).index_add_(0, ids, cum_w * maskf)
    baselines = (num / (den + epsilon))[ids]
    lengths = mask.sum(-1)
    count = torch.zeros(num_groups, dtype=torch.long).index_add_(0, ids, torch.ones_like(lengths))[ids]
    for g in range(num_groups):
        rows = (ids == g).nonzero().flatten()
        if rows.numel() < 2:
            continue
        sorted_lengths = torch.sort(lengths[rows]).values
        longest, second = int(sorted_lengths[-1]), int(sorted_lengths[-2])
        if longest > second:
            baselines[rows[lengths[rows] == longest][0], second:] = 0.0
    adv = torch.where((count > 1)[:, None] & mask, returns - baselines, torch.zeros_like(returns))
    return adv.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": gae_advantage,
    "grpo": grpo_advantage,
    "drgrpo": drgrpo_advantage,
    "rloo": rloo_advantage,
    "reinforce_plus_plus": reinforce_pp_advantage,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline_advantage,
    "remax": remax_advantage,
    "opo": opo_advantage,
    "gpg": gpg_advantage,
    "grpo_passk": grpo_passk_advantage,
    "gdpo": gdpo_advantage,
    "optimal_token_baseline": optimal_token_baseline_advantage,
}
