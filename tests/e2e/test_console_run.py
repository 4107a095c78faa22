"""`megarl train` as a user runs it: a short console, library logs in <run_dir>/logs, and a failing run's error on
the console."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"
SMALL = ["sft.enable=false", "data.synthetic.num_train=64", "data.synthetic.num_val=8", "data.train_batch_size=8",
         "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
         "rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.total_steps=3", "trainer.test_freq=3",
         "logging.tensorboard=false"]


def _train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    args = [*SMALL, f"trainer.run_dir={run_dir}", f"model.path={tmp_path / 'model'}", *extra]
    return subprocess.run([sys.executable, "-m", "megarl", "train", str(RECIPE), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_quiet_run_and_its_logs(tmp_path):
    proc = _train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    assert len(console) <= 20, "\n".join(console)
    assert sum(line.startswith("step ") for line in console) == 4  # validation before training, then 3 steps
    assert any("val/reward_mean" in line for line in console) and any("train/reward_mean" in line for line in console)
    assert any(line.startswith("3 steps in ") for line in console)  # the summary
    logs = tmp_path / "run" / "logs"
    engine, rank = (logs / "vllm-engine.log").read_text(), (logs / "rank0.log").read_text()
    assert "Initializing a V1 LLM engine" in engine  # vLLM's start-up log
    assert "Params for bucket" in rank  # Megatron's DDP bucket list
    for noise in ("Initializing a V1 LLM engine", "Params for bucket", "UserWarning"):
        assert noise not in proc.stderr


# a failing rank's traceback: tests/dist/test_console_ranks.py; a known cause in one line: test_engine_start_errors
@pytest.mark.slow
def test_failing_run_shows_its_error(tmp_path):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise ValueError('broken reward for the test')\n")
    proc = _train(tmp_path, f"reward.reward_fn={reward}", "trainer.val_before_train=false")
    assert proc.returncode == 1
    assert "broken reward for the test" in proc.stderr
    assert "Params for bucket" not in proc.stderr
