"""tools/seed_range.py: one recipe over several seeds, each in a fresh directory, then `megarl report` over the runs.
What each seed's run makes for itself lands in its own directory; existing directories and bad configs are refused
before any run starts."""
import subprocess
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from seed_range import main, seed_overrides  # noqa: E402

DEMO = str(ROOT / "recipes" / "grpo_tiny_cpu.yaml")
DAPO = str(ROOT / "recipes" / "dapo_tiny_cpu.yaml")


def test_what_a_run_creates_moves_into_its_directory(tmp_path):
    run = tmp_path / "s2"
    assert seed_overrides(DEMO, 2, run, ["rollout.n=4"]) == [
        "trainer.seed=2", f"trainer.run_dir={run}", f"model.path={run}/init_model",
        f"sft.output_dir={run}/sft_model", f"data.synthetic.output_dir={run}/data", "rollout.n=4"]
    # DAPO from each seed's demo run: the given paths win, with the seed filled in; the data still moves
    given = ["model.path=demo/s{seed}/init_model", "sft.output_dir=demo/s{seed}/sft_model"]
    assert seed_overrides(DAPO, 3, run, given) == [
        "trainer.seed=3", f"trainer.run_dir={run}", f"data.synthetic.output_dir={run}/data",
        "model.path=demo/s3/init_model", "sft.output_dir=demo/s3/sft_model"]


def test_existing_directories_and_bad_configs_refused_before_a_run(tmp_path, capsys):
    (tmp_path / "s2").mkdir()
    (tmp_path / "s2" / "metrics.jsonl").write_text("{}\n")
    assert main([DEMO, "--seeds", "1", "2", "--run-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 's2'} already exist" in err and "fresh directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s2"]  # seed 1 did not start

    assert main([DEMO, "--run-root", str(tmp_path / "new"), "sft.total_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "sft.optim.lr_warmup_steps = 10" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()
    r = subprocess.run([sys.executable, "tools/seed_range.py", DEMO, "--seeds", "1", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "each seed once" in r.stderr


def test_two_seeds_run_fresh_and_are_reported_side_by_side(tmp_path):
    root = tmp_path / "runs"
    r = subprocess.run([sys.executable, "tools/seed_range.py", DEMO, "--seeds", "1", "2", "--run-root", str(root),
                        "--min-gain", "-1", "trainer.total_steps=1", "sft.total_steps=12", "trainer.test_freq=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    weights = []
    for seed in (1, 2):
        run = root / f"s{seed}"
        resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
        assert resolved["trainer"]["seed"] == seed
        assert Path(resolved["model"]["path"]) == (run / "init_model").resolve()
        assert (run / "sft_model" / "config.json").is_file() and (run / "data" / "train.parquet").is_file()
        weights.append(load_file(str(run / "init_model" / "model.safetensors")))
    # each seed's model was created from its own seed, not copied from the other's
    assert weights[0].keys() == weights[1].keys()
    assert any(not weights[0][k].equal(weights[1][k]) for k in weights[0])
    lines = r.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("run "))):]
    assert [row.split()[1] for row in table[1:3]] == ["1", "2"]
    assert table[3].startswith("val/reward_mean over 2 of 2 runs: gain ")
    assert table[4] == f"report: {root / 'report_runs.png'}" and (root / "report_runs.png").is_file()
    assert table[5] == "every run gained at least -1.000"


def test_ctrl_c_stops_the_sweep_after_the_running_seed(tmp_path):
    """Ctrl-C reaches the whole process group: the running seed gets it too and stops on its own (not killed by the
    sweep), and no later seed starts."""
    import os
    import signal
    import time

    root = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "tools/seed_range.py", DEMO, "--seeds", "1", "2", "--run-root",
                             str(root), "trainer.total_steps=1", "sft.total_steps=12"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().startswith("== seed 1 (1 of 2): megarl train ")
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "seed_range: SIGINT during seed 1" in err and "the 1 seed(s) after it were not run" in err
    assert "== seed 2" not in out and not (root / "s2").exists()
