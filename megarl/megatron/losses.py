"""Loss functions on megatron outputs for train_step.train_mini_batch: policy (actor), value (critic) and SFT.

Each is a named callable (PolicyLoss, ValueLoss, SftLoss) that binds settings and the mini-batch's global denominator
to a pure loss from megarl.algo: loss(micro_batch, model_output) -> (loss, metrics), handed to Megatron's schedule as
it is (train_step.forward_step). The model ran on the micro-batch's pack (mb["pack"],
megarl.megatron.packing): its output [1, P, ...] comes back per row as [b, T] before any loss sees it. Tensors of a
micro-batch (T = S - 1, aligned with logprobs: position t scores token t+1):
    input_ids [b, S], response_mask [b, T], old_log_probs [b, T], advantages [b, T],
    optional ref_log_probs [b, T] (use_kl_loss), optional rollout_is_weights [b, T] (rollout correction),
    values [b, T] and returns [b, T] (critic).
The critic's value at position t is V(tokens[:t+1]), the state before token t+1 is generated, so its values [b, S]
are cut to [b, T] like the logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megarl import algo
from megarl.megatron.packing import row_entropy, row_logprobs, row_values


@dataclass(frozen=True)
class PolicyLossSettings:
    vocab_size: int
    policy_loss: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0  # the rollout temperature: logprobs must be of the distribution that was sampled
    loss_options: dict = field(default_factory=dict)  # the settings of policy_loss's own (algo.POLICY_LOSS_OPTIONS)

    @classmethod
    def from_config(cls, cfg, vocab_size: int) -> "PolicyLossSettings":
        a, o = cfg.actor, cfg.actor.policy_loss_options
        options = dict(tau_pos=o.tau_pos, tau_neg=o.tau_neg, clip_cov_ratio=o.clip_cov_ratio, clip_cov_lb=o.clip_cov_lb,
                       clip_cov_ub=o.clip_cov_ub, kl_cov_ratio=o.kl_cov_ratio, ppo_kl_coef=o.ppo_kl_coef,
                       dro_beta=o.dro_beta)
        # verl's bypass REINFORCE (rollout_correction.loss_type=reinforce) is the plain policy gradient with the
        # correction's importance weights: gpg's loss, which multiplies them in
        reinforce = cfg.algorithm.rollout_correction.loss_type == "reinforce"
        return cls(vocab_size=vocab_size, policy_loss="gpg" if reinforce else a.policy_loss, loss_agg_mode=a.loss_agg_mode,
                   clip_ratio_low=a.clip_low, clip_ratio_high=a.clip_high, clip_ratio_c=a.clip_ratio_c,
                   entropy_coeff=a.entropy_coeff, use_kl_loss=cfg.kl_loss_active, kl_loss_coef=a.kl_loss_coef,
                   kl_loss_type=a.kl_loss_type, temperature=cfg.rollout.temperature or 1.0,
                   loss_options={k: options[k] for k in algo.POLICY_LOSS_OPTIONS.get(a.policy_loss, ())})


@dataclass(frozen=True, eq=False)
class PolicyLoss:
    """(micro_batch, logits [1, P, V/TP] of its pack) -> (loss, metrics) for train_mini_batch.

    `denominator` is the global token or sequence count of the mini-batch (see train_step.loss_denominator), so the
    micro-batch losses add up to the mini-batch loss. pg_loss/kl_loss/entropy_loss metrics are such shares.

    With `on_policy_log_probs` (a list) the weights are still those that sampled the batch (its only optimizer step):
    the old logprobs are this forward's own, detached (PPO ratio exactly 1), so micro-batches need no old_log_probs;
    each appends (mb["row_index"] [b], logprobs [b, T]) to the list for the caller."""

    settings: PolicyLossSettings
    denominator: torch.Tensor
    max_response_length: Optional[int] = None
    on_policy_log_probs: Optional[list] = None

    def __call__(self, mb: dict, logits: torch.Tensor):
        s = self.settings
        mask, pack = mb["response_mask"], mb["pack"]
        log_prob = row_logprobs(logits, pack, s.vocab_size, s.temperature)
        if self.on_policy_log_probs is None:
            old_log_prob = mb["old_log_probs"]
        else:
            old_log_prob = log_prob.detach()
            self.on_policy_log_probs.append((mb["row_index"], old_log_prob))
        agg = dict(loss_agg_mode=s.loss_agg_mode, denominator=self.denominator,
                   max_response_length=self.max_response_length)
        pg_loss, pg_metrics = algo.POLICY_LOSSES[s.policy_loss](
            old_log_prob, log_prob, mb["advantages"], mask, clip_ratio_low=s.clip_ratio_low,
            clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c,
            rollout_is_weights=mb.get("rollout_is_weights"), **s.loss_options, **agg)
        loss = pg_loss
        # how far this update is off-policy: exactly 0 on the first mini-batch of a step (same weights as rollout)
        log_ratio = (log_prob.detach() - old_log_prob).abs()
        # |log ratio| >= 0, so filling non-response positions with 0 gives the max over the mask (0 when empty)
        # without the host synchronisation that boolean indexing or `if mask.any()` costs
        metrics = {"pg_loss": pg_loss.detach(), **pg_metrics,
                   "log_ratio_abs_max": log_ratio.masked_fill(~mask.bool(), 0.0).max()}
        with torch.set_grad_enabled(s.entropy_coeff != 0 and torch.is_grad_enabled()):
            entropy = row_entropy(logits if s.entropy_coeff else logits.detach(), pack, s.vocab_size, s.temperature)
            entropy_loss = algo.agg_loss(entropy, mask, **agg)
        if s.entropy_coeff:
            loss = loss - s.entropy_coeff * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
        metrics["entropy"] = algo.masked_mean(entropy.detach(), mask)
        if s.use_kl_loss:
            kl, _ = algo.kl_loss(log_prob, mb["ref_log_probs"], mask, s.kl_loss_type, **agg)
            loss = loss + s.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics


@dataclass(frozen=True, eq=False)
class ValueLoss:
    """(micro_batch, values_out [1, P, 1] of its pack) -> (clipped value loss, metrics) for the critic."""

    cliprange_value: float
    loss_agg_mode: str
    denominator: torch.Tensor
    max_response_length: Optional[int] = None

    def __call__(self, mb: dict, out: torch.Tensor):
        vpreds = row_values(out, mb["pack"])[:, : mb["input_ids"].shape[1] - 1]
        loss, metrics = algo.value_loss(vpreds=vpreds, returns=mb["returns"], values=mb["values"],
                                        response_mask=mb["response_mask"], cliprange_value=self.cliprange_value,
                                        loss_agg_mode=self.loss_agg_mode, denominator=self.denominator,
                                        max_response_length=self.max_response_length)
        return loss, {"vf_loss": loss.detach(), **metrics}


@dataclass(frozen=True, eq=False)
class SftLoss:
    """(micro_batch, logits) -> (token-mean NLL of the response tokens, metrics) for supervised fine-tuning."""

    vocab_size: int
    denominator: torch.Tensor

    def __call__(self, mb: dict, logits: torch.Tensor):
        log_prob = row_logprobs(logits, mb["pack"], self.vocab_size)
        nll = algo.agg_loss(-log_prob, mb["response_mask"], "token-mean", denominator=self.denominator)
        return nll, {"sft_loss": nll.detach()}
