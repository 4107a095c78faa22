"""The tiny loop with rollout.load_format=dummy (the engine starts from random weights and must receive the actor's
before the first rollout), ReMax greedy baselines and saved rollouts."""
import json
from pathlib import Path

import pytest

from megarl.launch_local import run_ranks
from megarl.validate import load_config
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE, SMALL, _metrics

pytestmark = pytest.mark.slow  # 85-110 s on 2 shared cores


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remax_dummy")
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    cfg = load_config(RECIPE, SMALL + [f"trainer.run_dir={tmp / 'run'}", f"model.path={tmp / 'model'}",
                                       f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward}",
                                       "rollout.load_format=dummy", "algorithm.adv_estimator=remax",
                                       "logging.save_rollouts=true", "trainer.total_steps=2"])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=600)
    return tmp / "run", _metrics(tmp / "run")


def test_dummy_load_samples_from_the_actor_at_step_one(run):
    _, metrics = run
    first = metrics[0]
    assert first["step"] == 1
    # before the fix the engine sampled step 1 from its random dummy weights: a gap of 0.18
    assert first["rollout/logprob_abs_diff_mean"] < 1e-4, first
    assert first["actor/log_ratio_abs_max"] < 1e-6, first


def test_remax_trains_with_greedy_baselines_and_rollouts_are_saved(run):
    run_dir, metrics = run
    for m in metrics:
        assert 0.0 <= m["remax/baseline_reward_mean"] <= 1.0 and m["timing/remax_baseline_s"] > 0
    rows = [json.loads(line) for line in (Path(run_dir) / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 8 * 4  # train_batch_size prompts x rollout.n samples
    assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(metrics[0]["train/reward_mean"])
    # parity reward: 1 for an odd number of words in the response
    assert all(r["reward"] == float(len(r["response"].split()) % 2) for r in rows)
    assert all(len(r["advantages"]) == r["response_length"] for r in rows)
