"""`megarl train` as a user runs it: a failing run's error on the console. The short console of a run that works and
its library logs in <run_dir>/logs: tests/e2e/test_grpo_loop.py (its run is a `megarl train` command)."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_grpo_loop import RECIPE, ROOT, SMALL


def _train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [*SMALL, f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", *extra]
    return subprocess.run([sys.executable, "-m", "megarl", "train", str(RECIPE), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


# a failing rank's traceback: tests/dist/test_console_ranks.py; a known cause in one line: test_engine_start_errors
@pytest.mark.slow
def test_failing_run_shows_its_error(tmp_path):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise ValueError('broken reward for the test')\n")
    proc = _train(tmp_path, f"reward.reward_fn={reward}")  # SMALL: no validation before the first step
    assert proc.returncode == 1
    assert "broken reward for the test" in proc.stderr
    assert "Params for bucket" not in proc.stderr
