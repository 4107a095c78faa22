"""`megarl plan --measure` on the tiny recipe: one real step of its trainer (one rank, CPU), the table of planned and
measured peaks per phase, and the calibration file `megarl plan --search --calibration` reads."""
import json
import subprocess
import sys
from pathlib import Path

from megarl.plan.measure import PHASES
from megarl.plan.timing import read_calibration

ROOT = Path(__file__).resolve().parents[2]


def test_plan_measure_prints_planned_beside_measured_per_phase(tmp_path):
    out = tmp_path / "calibration.json"
    r = subprocess.run([sys.executable, "-m", "megarl", "plan", "recipes/grpo_tiny_cpu.yaml", "--measure", "--steps",
                        "1", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
                        "--calibration-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    head = next(x for x in lines if "2 of 2 layer(s)" in x)
    assert "1 rank(s) on cpu" in head and "live tensors" in head, head
    # the weight sync phase ran the trainer's delivery: the engine received the whole model (tiny: under 1 MiB)
    synced = head.split("engine parameters, ")[1].split(" per sync")[0]
    assert float(synced.split()[0]) > 0, head
    for phase in PHASES:
        row = next(x for x in lines if x.startswith(phase))
        ratio = float(row[len(phase):].split()[4])  # planned (2 words), measured (2 words), ratio
        assert 0.2 < ratio < 5, row  # a real measurement of the same run: the tiny model's sizes, not the 10% bound
    record = json.loads(out.read_text())
    assert set(record["phases"]) == {f"{p}|0" for p in PHASES}
    assert all(v["measured"] > 0 and v["planned"] > 0 for v in record["phases"].values())
    assert read_calibration(str(out)).tflops.keys() == {"update"}  # on-policy GRPO: no separate forward to time


def test_plan_measure_refuses_bad_input_in_one_line():
    r = subprocess.run([sys.executable, "-m", "megarl", "plan", "recipes/grpo_tiny_cpu.yaml", "--measure",
                        "--layers", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--layers 0" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "megarl", "plan", "recipes/grpo_tiny_cpu.yaml"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--nodes and --gpus-per-node are required" in r.stderr, r.stderr
