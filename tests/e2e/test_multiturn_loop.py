"""Multi-turn GRPO with a calculator tool on the tiny recipe: the first step is on-policy on the model's tokens
(engine vs trainer logprobs, PPO ratio exactly 1) with tool turns in the responses, the sanity check finds no drift,
and trainer TP2 with two engine replicas (each running the agent loop for its prompts) gives the same samples and
losses as one rank."""
import json
from pathlib import Path

import pytest

from megarl.launch_local import run_ranks
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "multiturn_tool_tiny_cpu.yaml"
# every demonstration calls the tool: these tests check the loop on responses that hold tool turns
SMALL = ["data.synthetic.num_train=64", "data.synthetic.num_val=8", "data.synthetic.num_sft=128",
         "data.synthetic.direct_answer_share=0",
         "sft.total_steps=40", "sft.optim.lr=3e-3", "data.train_batch_size=8", "rollout.n=4",
         "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
         "rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.total_steps=2", "trainer.test_freq=0",
         "trainer.val_before_train=false", "logging.tensorboard=false", "rollout.multi_turn.sanity_check=true",
         f"rollout.multi_turn.tool_config_path={ROOT / 'recipes' / 'tools' / 'calculator.yaml'}"]

pytestmark = pytest.mark.slow

# A barely warm-started model rarely answers a product right; this reward varies on any conversation (the parity of
# its length in characters), so the advantages and losses compared below are not all zero.
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""


def _run(tmp: Path, name: str, extra=()) -> list[dict]:
    run_dir = tmp / name
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    cfg = load_config(RECIPE, SMALL + [f"trainer.run_dir={run_dir}", f"model.path={tmp / 'model'}",
                                       f"reward.reward_fn={reward}",
                                       f"data.synthetic.output_dir={tmp / 'data'}", f"sft.output_dir={tmp / 'sft'}",
                                       *extra])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=900)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiturn")
    return tmp, _run(tmp, "tp1")


def test_first_step_on_policy_with_tool_turns(tp1):
    _, metrics = tp1
    first = metrics[0]
    assert first["tool/calls"] > 0 and first["tool/tool_turns"] > 0, first  # responses hold tool turns
    assert first["rollout/logprob_abs_diff_max"] < 1e-4, first  # on the model's tokens only (mask 1)
    assert first["actor/log_ratio_abs_max"] == 0.0 and first["actor/clip_frac"] == 0.0  # PPO ratio exactly 1
    for m in metrics:
        assert m["tool/sanity_checked"] > 0 and m["tool/sanity_drift"] == 0, m
        assert m["rollout/logprob_abs_diff_mean"] < 1e-4, m
        assert 1.0 <= m["tool/turns_mean"] <= 3.0


def test_trainer_tp2_with_two_engine_replicas(tp1):
    tmp, ref = tp1
    got = _run(tmp, "tp2", ["parallelism.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"])
    assert any(abs(m["actor/pg_loss"]) > 1e-4 for m in ref)  # equal non-trivial losses, not 0 == 0
    for a, b in zip(ref, got):
        # the same trajectories: sampling seeds follow the global prompt index, not the replica
        for key in ("train/reward_mean", "tool/calls", "tool/tool_turns", "rollout/response_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < 1e-4
    assert got[0]["rollout/num_prompts"] == 8.0  # both replicas' shares combined


def test_first_step_on_policy_with_the_hf_engine(tmp_path):
    # the transformers engine (rollout.name=hf) through the same agent loop: tool turns, on-policy first step, no drift
    metrics = _run(tmp_path, "hf", ["rollout.name=hf"])
    first = metrics[0]
    assert first["tool/calls"] > 0 and first["tool/tool_turns"] > 0, first
    assert first["rollout/logprob_abs_diff_max"] < 1e-4, first
    assert first["actor/log_ratio_abs_max"] == 0.0 and first["actor/clip_frac"] == 0.0
    for m in metrics:
        assert m["tool/sanity_checked"] > 0 and m["tool/sanity_drift"] == 0, m
