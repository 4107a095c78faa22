import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _megarl(*args):
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_validate_prints_resolved_config_and_exits_zero():
    r = _megarl("validate", "recipes/grpo_tiny_cpu.yaml", "rollout.n=4")
    assert r.returncode == 0, r.stderr
    assert "derived:" in r.stdout and "n: 4" in r.stdout


def test_validate_reports_problems_and_exits_nonzero():
    r = _megarl("validate", "recipes/grpo_tiny_cpu.yaml", "rollout.temprature=0.7", "trainer.n_gpus_per_node=0")
    assert r.returncode == 1
    assert "rollout.temperature" in r.stderr and "trainer.n_gpus_per_node" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_command_gives_usage_not_a_traceback():
    r = _megarl("frobnicate")
    assert r.returncode == 2 and "usage: megarl" in r.stderr and "Traceback" not in r.stderr
    r = _megarl()
    assert r.returncode == 2 and "validate" in r.stdout
