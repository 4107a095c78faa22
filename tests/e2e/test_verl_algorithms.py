"""verl's estimators, losses and rollout-correction presets in the real loop (engine + megatron) of the tiny recipe:
the wiring the unit tests cannot see (sum_v pi^2 from the old-logprob forward, gdpo's reward dimensions from the
reward function, a bypass REINFORCE preset)."""
import pytest

from tests.e2e.test_grpo_loop import _run

# two reward dimensions: parity of the word count, and a short answer; the score is their sum
TWO_REWARDS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    parity = float(len(solution_str.split()) % 2)
    short = float(len(solution_str.split()) < 3)
    return {"score": parity + short, "parity": parity, "short": short}
"""


@pytest.mark.slow
def test_optimal_token_baseline_with_sapo(tmp_path):
    metrics = _run(tmp_path, "otb", ["algorithm.adv_estimator=optimal_token_baseline", "actor.policy_loss=sapo",
                                     "actor.loss_agg_mode=seq-mean-token-mean"])
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert "timing/old_log_prob_s" in m  # its own forward: old logprobs and sum_v pi^2 before the advantages
        assert m["actor/grad_norm"] > 0


@pytest.mark.slow
def test_gdpo_reads_the_reward_dimensions(tmp_path):
    reward = tmp_path / "two_rewards.py"
    reward.write_text(TWO_REWARDS)
    metrics = _run(tmp_path, "gdpo", ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[parity,short]",
                                      "algorithm.gdpo_reward_weights=[1.0,0.5]", "actor.policy_loss=dppo_tv",
                                      f"reward.reward_fn={reward}"])
    for m in metrics:
        assert "reward/parity_mean" in m and m["actor/grad_norm"] > 0
        # gdpo whitens over the batch's tokens: mean advantage 0
        assert abs(m["train/advantage_mean"]) < 1e-5


@pytest.mark.slow
def test_bypass_reinforce_preset_logs_verls_metrics(tmp_path):
    metrics = _run(tmp_path, "preset", ["algorithm.rollout_correction.preset=bypass_pg_geo_rs_token_tis"])
    for m in metrics:
        assert "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" in m
        assert "rollout_corr/rollout_rs_masked_fraction" in m
        assert m["actor/grad_norm"] > 0


@pytest.mark.slow
def test_distillation_from_a_teacher(tmp_path):
    # the teacher is the student's own starting model: at step 1 (nothing trained yet) they agree on every token
    metrics = _run(tmp_path, "distill", ["distillation.enable=true", f"distillation.teacher.path={tmp_path / 'model'}",
                                         "distillation.kl_coef=0.5"])
    assert abs(metrics[0]["distill/reverse_kl"]) < 1e-5
    assert all("timing/teacher_s" in m and m["actor/grad_norm"] > 0 for m in metrics)
    assert metrics[-1]["distill/reverse_kl"] != metrics[0]["distill/reverse_kl"]  # the student moved
