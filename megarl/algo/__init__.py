"""The mathematics of the RL algorithms, as pure torch functions on local tensors.

No config objects, no process groups, no megatron/vllm/ray: every function takes tensors (shapes in its
docstring), handles padding through a response mask, and returns tensors or (loss, metrics).

Conventions:
  token-level tensors are [B, T] (B sequences, T response positions), with response_mask [B, T];
  sequence-level tensors are [B]; group ids (`index`) are a [B] integer tensor or a sequence of hashables.
  Masks are bool, or integer/float tensors holding only 0 and 1; anything else is a ValueError.

Registries (name -> function) let the config select an algorithm; `lookup(registry, name, kind)` gives the
error a config validator should raise for an unknown name.
"""
from megarl.algo._checks import lookup
from megarl.algo.advantages import (
    ADV_ESTIMATORS,
    ESTIMATOR_KWARGS,
    drgrpo_advantage,
    gae_advantage,
    gdpo_advantage,
    gpg_advantage,
    grpo_advantage,
    grpo_passk_advantage,
    opo_advantage,
    optimal_token_baseline_advantage,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
)
from megarl.algo.aggregation import LOSS_AGG_MODES, agg_loss
from megarl.algo.dapo import filter_groups_by_metric, overlong_reward_penalty
from megarl.algo.entropy import entropy_from_logits, sum_pi_squared_from_logits
from megarl.algo.groups import group_ids, group_mean_std
from megarl.algo.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    reverse_kl_advantage,
)
from megarl.algo.losses import (
    POLICY_LOSS_OPTIONS,
    POLICY_LOSSES,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    geo_mean_loss,
    gpg_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
    sapo_loss,
)
from megarl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algo.rollout_correction import (
    VERL_CORRECTION_NAMES,
    VERL_MISMATCH_NAMES,
    rollout_is_weights,
    rollout_mismatch_metrics,
    rollout_rejection_mask,
)
from megarl.algo.value import explained_variance, value_loss

__all__ = [
    "ADV_ESTIMATORS", "ESTIMATOR_KWARGS", "POLICY_LOSSES", "POLICY_LOSS_OPTIONS", "LOSS_AGG_MODES", "KL_ESTIMATORS", "KL_CONTROLLERS",
    "lookup",
    "gae_advantage", "grpo_advantage", "drgrpo_advantage", "rloo_advantage", "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage", "remax_advantage", "opo_advantage", "gpg_advantage", "grpo_passk_advantage",
    "gdpo_advantage", "optimal_token_baseline_advantage",
    "ppo_clip_loss", "gspo_loss", "cispo_loss", "sapo_loss", "gpg_loss", "clip_cov_loss", "kl_cov_loss",
    "geo_mean_loss", "dro_loss", "dppo_tv_loss", "dppo_kl_loss", "agg_loss",
    "value_loss", "explained_variance",
    "kl_penalty", "kl_loss", "apply_kl_penalty", "reverse_kl_advantage", "FixedKLController", "AdaptiveKLController",
    "entropy_from_logits", "sum_pi_squared_from_logits",
    "overlong_reward_penalty", "filter_groups_by_metric",
    "rollout_is_weights", "rollout_rejection_mask", "rollout_mismatch_metrics", "VERL_MISMATCH_NAMES",
    "VERL_CORRECTION_NAMES",
    "masked_sum", "masked_mean", "masked_var", "masked_whiten",
    "group_ids", "group_mean_std",
]
