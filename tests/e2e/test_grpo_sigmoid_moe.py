"""GRPO end to end on the tiny DeepSeek-V3-shaped (MLA, sigmoid router with bias, shared expert, dense first layer)
and GLM-4.5-shaped CPU recipes: the engine's logprobs of the sampled tokens equal the trainer's after every sync."""
import pytest

from megarl.validate import load_config
from tests.e2e.test_grpo_loop import PARITY_REWARD, ROOT, SMALL, _metrics


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["grpo_deepseek_v3_tiny_cpu.yaml", "grpo_glm4_moe_tiny_cpu.yaml"])
def test_engine_matches_trainer_after_each_sync(tmp_path, recipe):
    from megarl.launch_local import run_ranks

    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    cfg = load_config(ROOT / "recipes" / recipe, SMALL + [
        f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}",
        f"data.synthetic.output_dir={tmp_path / 'data'}", f"reward.reward_fn={reward}"])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=900)
    steps = [m for m in _metrics(tmp_path / "run") if "rollout/logprob_abs_diff_max" in m]
    assert len(steps) == 3
    gaps = [m["rollout/logprob_abs_diff_max"] for m in steps]
    print(f"[{recipe}] engine vs trainer logprob gap per step: {gaps}")
    assert max(gaps) < 1e-4
