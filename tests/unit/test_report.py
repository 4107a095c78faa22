"""`megarl report`: the table's rows and values (hand-computed), the PNG, the end-of-run summary; the console lines
of MetricsLogger; `python -m megarl`."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from megarl import cli, report
from megarl.metrics import MetricsLogger

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[dict]:
    rows = [{"step": 0, "val/reward_mean": 0.25}]
    for step in range(1, 7):
        rows.append({"step": step, "train/reward_mean": step / 10, "train/response_length_mean": 3.0 + step,
                     "actor/kl": 0.001 * step, "actor/entropy": 1.0 - step / 100, "actor/grad_norm": 0.5,
                     "actor/clip_frac": 0.0, "timing/rollout_s": 0.1, "timing/train_s": 0.2, "timing/step_s": 0.4})
    rows[3]["val/reward_mean"] = 0.5  # validation at step 3 and 6
    rows[6]["val/reward_mean"] = 0.75
    return rows


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return tmp_path


def test_table_rows_and_column_means():
    lines = report.table_lines(_rows(), columns=3)
    cells = {line.split()[0]: line.split()[1:] for line in lines}
    assert cells["steps"] == ["1-2", "3-4", "5-6"]
    # rows: the metrics asked for, in order, and only those with data (no ref, values or sync timing here)
    assert list(cells)[1:] == ["train/reward_mean", "val/reward_mean", "train/response_length_mean", "actor/kl",
                               "actor/entropy", "actor/grad_norm", "actor/clip_frac", "timing/rollout_s",
                               "timing/train_s", "timing/step_s"]
    assert cells["train/reward_mean"] == ["0.15", "0.35", "0.55"]  # (0.1+0.2)/2, (0.3+0.4)/2, (0.5+0.6)/2
    assert cells["val/reward_mean"] == ["-", "0.5", "0.75"]  # the last validation in each stretch
    assert cells["actor/kl"] == ["0.0015", "0.0035", "0.0055"]


def test_summary_lines_hand_values():
    lines = report.summary_lines(_rows(), seconds=10.0)
    assert lines[0] == "6 steps in 10 s: 0.400 s/step (rollout 0.100, train 0.200)"
    assert "val/reward_mean 0.250 at step 0 -> 0.750 at step 6 (+0.500)" in lines[1]
    # a tenth of 6 steps rounds up to one step: first 0.1, last 0.6
    assert "train/reward_mean 0.100 -> 0.600" in lines[1]


def test_nice_ticks_cover_the_range_with_round_steps():
    assert report.nice_ticks(1, 29, 6) == [0, 10, 20, 30]
    assert report.nice_ticks(0.1, 0.43) == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert report.nice_ticks(2.99, 3.04) == [2.98, 3.0, 3.02, 3.04]
    assert report.nice_ticks(0.0, 0.0) == [-1.0, -0.5, 0.0, 0.5, 1.0]  # a flat series still gets an axis


def test_report_command_writes_png_and_prints_table(run_dir, capsys):
    assert cli.main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    png = run_dir / "report.png"
    assert png.stat().st_size > 10_000
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width == 1200
        # seven panels with data (reward, length, KL, entropy, grad norm, clip fraction, time): four rows of two
        assert image.height == 40 + 4 * 300
        colors = {c for _, c in image.getcolors(maxcolors=1 << 16)}
    assert report.COLORS[0] in colors and report.COLORS[1] in colors  # train and val curves were drawn
    assert out[0].split()[0] == "steps" and any(line.startswith("train/reward_mean") for line in out)
    assert out[-1] == f"report: {png}"


def test_report_command_names_a_missing_run(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 1
    assert "no metrics at" in capsys.readouterr().err


def test_console_lines_paced_named_and_summarised(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, tensorboard=False, total_steps=12)
    logger.log(0, {"val/reward_mean": 0.2})
    for step in range(1, 13):
        metrics = {"train/reward_mean": 0.5, "timing/step_s": 1.0, "actor/kl": 0.0}
        if step == 7:
            metrics["val/reward_mean"] = 0.6
        logger.log(step, metrics)
    logger.close()
    err = capsys.readouterr().err.splitlines()
    steps = [int(line.split()[1].split("/")[0]) for line in err if line.startswith("step ")]
    # the first logged step, step 1, each multiple of 12 // 6 = 2, validation steps (7), and the last step
    assert steps == [0, 1, 2, 4, 6, 7, 8, 10, 12]
    val_line = next(line for line in err if line.startswith("step  7/12"))
    assert "train/reward_mean 0.5" in val_line and "val/reward_mean 0.6" in val_line
    assert err[-3].startswith("12 steps in ")
    assert "val/reward_mean 0.200 at step 0 -> 0.600 at step 7" in err[-2]
    assert err[-1] == f"curves: megarl report {tmp_path}"


def test_python_dash_m_megarl_is_the_megarl_command():
    recipe = str(ROOT / "recipes" / "grpo_tiny_cpu.yaml")
    by_module = subprocess.run([sys.executable, "-m", "megarl", "validate", recipe, "rollout.n=4"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
    by_cli = subprocess.run([sys.executable, "-m", "megarl.cli", "validate", recipe, "rollout.n=4"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert by_module.returncode == 0, by_module.stderr
    assert by_module.stdout == by_cli.stdout and "n: 4" in by_module.stdout
    bad = subprocess.run([sys.executable, "-m", "megarl", "no-such-command"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_sparse_logging_reports_the_first_step_past_each_mark(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, tensorboard=False, total_steps=150, summary=False)
    for step in [1, *range(7, 150, 7), 150]:  # how SFT logs: every 150 // 20 = 7 steps
        logger.log(step, {"sft/loss": 1.0})
    logger.close()
    err = capsys.readouterr().err.splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in err] == [1, 28, 56, 77, 105, 126, 150]


def _seed_run(root: Path, name: str, seed, vals: dict[int, float]) -> Path:
    """A run directory with validation at the given steps, a train reward at every step, and (seed not None) the
    config.resolved.yaml the trainer writes."""
    run = root / name
    run.mkdir()
    rows = [{"step": s, "train/reward_mean": 0.1 * s} for s in range(1, max(vals) + 1)]
    rows.insert(0, {"step": 0})
    for step, value in vals.items():
        rows[step]["val/reward_mean"] = value
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if seed is not None:
        (run / "config.resolved.yaml").write_text(f"trainer: {{run_dir: {run}, seed: {seed}, total_steps: 4}}\n")
    return run


def test_several_runs_side_by_side_and_their_range(tmp_path, capsys):
    a = _seed_run(tmp_path, "s1", 1, {0: 0.5, 2: 0.75, 4: 0.625})
    b = _seed_run(tmp_path, "s2", 2, {0: 0.25, 2: 0.5, 4: 0.5})
    c = _seed_run(tmp_path, "s3", None, {0: 0.25})  # one validation only: no gain, left out of the range
    assert cli.main(["report", str(a), str(b), str(c)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in out[1:4]}
    # first, last, best (the earliest of the highest), last - first
    assert rows[str(a)] == ["1", "0.500", "(0)", "0.625", "(4)", "0.750", "(2)", "+0.125"]
    assert rows[str(b)] == ["2", "0.250", "(0)", "0.500", "(4)", "0.500", "(2)", "+0.250"]
    assert rows[str(c)] == ["-"] * 5
    assert out[4] == ("val/reward_mean over 2 of 3 runs: gain +0.125 to +0.250 (mean +0.188); "
                      "last 0.500 to 0.625")
    png = tmp_path / "report_runs.png"  # the folder that holds the runs
    assert out[5] == f"report: {png}"
    with Image.open(png) as image:
        assert image.size == (1200, 40 + 300)  # two panels: validation and train reward, one curve per run
        colors = {c for _, c in image.getcolors(maxcolors=1 << 16)}
    assert {report.COLORS[0], report.COLORS[1], report.COLORS[2]} <= colors


def test_min_gain_names_each_run_below_it(tmp_path, capsys):
    a = _seed_run(tmp_path, "s1", 1, {0: 0.5, 4: 0.625})
    b = _seed_run(tmp_path, "s2", 2, {0: 0.25, 4: 0.5})
    assert cli.main(["report", str(a), str(b), "--min-gain", "0.2", "--out", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"megarl report: {a}: val/reward_mean 0.500 -> 0.625 is a gain of +0.125, below --min-gain +0.200"]
    assert cli.main(["report", str(a), str(b), "--min-gain", "0.125", "--out", str(tmp_path / "x.png")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "every run gained at least +0.125"
    # one run, and a run without two validations: the check cannot pass
    c = _seed_run(tmp_path, "s3", 3, {0: 0.25})
    assert cli.main(["report", str(c), "--min-gain", "0"]) == 1
    assert "fewer than two val/reward_mean values" in capsys.readouterr().err


def test_seed_read_from_the_resolved_config(tmp_path):
    assert report.read_seed(_seed_run(tmp_path, "a", 7, {0: 0.1})) == 7
    assert report.read_seed(_seed_run(tmp_path, "b", None, {0: 0.1})) is None
    (tmp_path / "b" / "config.resolved.yaml").write_text("trainer: [unclosed\n")
    assert report.read_seed(tmp_path / "b") is None
