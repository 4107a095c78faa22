"""DAPO dynamic sampling, GSPO and PPO-with-critic runs of the tiny recipe (real engine, real megatron)."""
import pytest

from tests.e2e.test_grpo_loop import _run


def test_dapo_dynamic_sampling_keeps_only_groups_with_varying_rewards(tmp_path):
    metrics = _run(tmp_path, "dapo", ["algorithm.filter_groups.enable=true", "rollout.over_sample_rate=0",
                                      "algorithm.filter_groups.max_num_gen_batches=20", "actor.clip_ratio_high=0.28",
                                      "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4"])
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["dapo/constant_groups"] == 0  # every group in the training batch has a reward spread
        assert m["dapo/gen_rounds"] >= 1
    # with 8 groups of 4 coin-flip rewards, some groups come out constant: extra rounds are needed and reported
    assert sum(m["dapo/extra_rounds"] for m in metrics) >= 1
    assert all(m["rollout/logprob_abs_diff_mean"] < 1e-4 for m in metrics)


@pytest.mark.slow  # two runs; PPO with a critic: the test below, GSPO's loss: tests/unit
def test_gspo_and_ppo_with_critic_run(tmp_path):
    gspo = _run(tmp_path, "gspo", ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean",
                                   "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004"])
    assert all(m["actor/grad_norm"] > 0 for m in gspo)
    ppo = _run(tmp_path, "ppo", ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95",
                                 "algorithm.use_kl_in_reward=true", "critic.ppo_micro_batch_size_per_gpu=8",
                                 "ref.log_prob_micro_batch_size_per_gpu=8"])
    for m in ppo:
        assert m["critic/vf_loss"] > 0 and "actor/reward_kl" in m
    assert ppo[0]["actor/reward_kl"] == 0.0  # reference == actor before the first update


def test_ppo_with_log_prob_token_budgets(tmp_path):
    """rollout.log_prob_use_dynamic_bsz: old logprobs, reference logprobs and critic values in micro-batches of at
    most 40 tokens (prompts of 16 and responses of up to 8 tokens: one or two sequences each)."""
    ppo = _run(tmp_path, "ppo_budget", ["algorithm.adv_estimator=gae", "algorithm.lam=0.95",
                                        "algorithm.use_kl_in_reward=true", "critic.ppo_micro_batch_size_per_gpu=8",
                                        "rollout.log_prob_use_dynamic_bsz=true",
                                        "rollout.log_prob_max_token_len_per_gpu=40", "trainer.total_steps=2"])
    assert [m["step"] for m in ppo] == [1, 2]
    assert ppo[0]["rollout/logprob_abs_diff_mean"] < 1e-4  # old logprobs agree with the engine's
    assert ppo[0]["actor/reward_kl"] == 0.0  # reference logprobs equal the actor's before the first update
    assert all(m["critic/vf_loss"] > 0 for m in ppo)
