"""Which forward passes a step needs: the old-logprob pass is skipped only when the update's own forward is exactly
the sampling policy and nothing reads old logprobs before the update; the reference model only when a KL term with
a positive coefficient reads it."""
import pytest

from megarl.config import MegarlConfig
from megarl.megatron.losses import PolicyLossSettings
from megarl.steps import old_log_probs_from_update

# 4 prompts x 2 samples, all in one mini-batch: one optimizer step per batch
ONE_STEP = {"data": {"train_batch_size": 4}, "rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 4}}


def _cfg(**changes) -> MegarlConfig:
    data = {k: dict(v) for k, v in ONE_STEP.items()}
    for dotted, value in changes.items():
        section, *path = dotted.split("__")
        node = data.setdefault(section, {})
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return MegarlConfig.model_validate(data)


def test_one_optimizer_step_and_no_earlier_reader_skips_the_pass():
    assert old_log_probs_from_update(_cfg(), actor_updates=True)


@pytest.mark.parametrize("change", [
    {"actor__ppo_epochs": 2},  # the second epoch trains a policy that did not sample
    {"actor__ppo_mini_batch_size": 2},  # two optimizer steps: the second mini-batch is off-policy
    {"algorithm__use_kl_in_reward": True},  # the KL penalty reads old logprobs before the update
    {"algorithm__rollout_correction__is_level": "token"},
    {"algorithm__rollout_correction__rejection_level": "sequence"},
    {"algorithm__rollout_correction__use_rollout_log_probs": True},  # old = the engine's logprobs, not the actor's
], ids=lambda c: next(iter(c)))
def test_the_separate_pass_stays_where_it_is_needed(change):
    assert not old_log_probs_from_update(_cfg(**change), actor_updates=True)


def test_no_actor_update_keeps_the_pass_for_the_metrics():
    assert not old_log_probs_from_update(_cfg(), actor_updates=False)  # critic warm-up steps


def test_kl_in_reward_with_zero_coefficient_needs_neither_ref_nor_the_pass():
    cfg = _cfg(algorithm__use_kl_in_reward=True, algorithm__kl_ctrl__kl_coef=0.0)
    assert not cfg.ref_enabled
    assert old_log_probs_from_update(cfg, actor_updates=True)


@pytest.mark.parametrize("coef,active", [(0.0, False), (0.01, True)])
def test_kl_loss_reads_the_reference_only_with_a_positive_coefficient(coef, active):
    cfg = _cfg(actor__use_kl_loss=True, actor__kl_loss_coef=coef)
    assert cfg.ref_enabled is active
    assert PolicyLossSettings.from_config(cfg, vocab_size=16).use_kl_loss is active


def test_an_explicit_ref_enable_wins():
    assert not _cfg(actor__use_kl_loss=True, actor__kl_loss_coef=0.01, ref__enable=False).ref_enabled
    assert _cfg(ref__enable=True).ref_enabled
