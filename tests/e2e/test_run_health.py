"""A run whose responses cannot end (rollout.response_length=2, a random model): `megarl train` warns once, the step
the response-health flag fires, and repeats it in the summary; `megarl report` shows it beside the validation's
accuracy apart from format (the gsm8k rule) and the run's real responses, which every run writes
(samples.jsonl, val_generations.jsonl; the generations also in the rank's log, not on the quiet terminal)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_grpo_loop import RECIPE, ROOT, SMALL

STEPS = 3  # report.PATIENCE steps in a row: the flag fires at the last one


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health")
    # SMALL: no SFT, so the model is random and almost never samples its eos token within 2 tokens
    proc = _run("train", str(RECIPE), *SMALL, f"trainer.run_dir={tmp / 'run'}", f"model.path={tmp / 'model'}",
                f"data.synthetic.output_dir={tmp / 'data'}", f"trainer.total_steps={STEPS}",
                f"trainer.test_freq={STEPS}", "trainer.val_before_train=true", "rollout.response_length=2",
                "reward.reward_fn=gsm8k")
    return tmp / "run", proc.stderr.splitlines(), _run("report", str(tmp / "run")).stdout.splitlines()


def test_the_flag_is_warned_once_when_it_fires_and_again_in_the_summary(run):
    run_dir, console, _ = run
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["train/truncated_frac"] > 0.2 for m in metrics if m["step"] > 0)  # the premise: every step truncates
    flagged = [i for i, line in enumerate(console) if line.startswith("health: responses hit the length cap from "
                                                                      "step 1")]
    step_lines = [i for i, line in enumerate(console) if line.startswith("step ")]
    assert len(flagged) == 2, "\n".join(console)
    # during training: right after the line of step 3, the step it fired; then in the end-of-run summary
    assert console[step_lines[-1]].startswith(f"step {STEPS}/{STEPS}") and flagged[0] == step_lines[-1] + 1
    assert "(through step 3)" in console[flagged[1]] and "rollout.response_length=2" in console[flagged[1]]


def test_report_shows_health_validation_parts_and_responses(run):
    run_dir, _, out = run
    text = "\n".join(out)
    print(text)  # the report as a user sees it (pytest -s)
    assert any(line.startswith("health: responses hit the length cap from step 1 (through step 3)") for line in out)
    at = out.index(next(line for line in out if line.startswith("validation (acc: correct final answer")))
    assert [line.split(":")[0] for line in out[at + 1:at + 3]] == ["  step 0", f"  step {STEPS}"]
    assert all(" acc " in line and " format " in line for line in out[at + 1:at + 3])  # the gsm8k rule's parts
    assert f"samples of step 1 and step {STEPS} (samples.jsonl):" in out
    assert f"validation generations of step 0 and step {STEPS} (val_generations.jsonl, the first 4 prompts of the " \
           "validation set):" in out
    shown = [line for line in out if line.startswith("  step ")]
    assert any("truncated (hit the length cap)" in line for line in shown), text


def test_every_run_writes_its_responses_and_logs_the_generations(run):
    run_dir, console, _ = run
    generations = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in generations] == [0] * 4 + [STEPS] * 4  # trainer.log_val_generations=4 by default
    assert [g["label"] for g in generations[:4]] == ["prompt 0", "prompt 1", "prompt 2", "prompt 3"]
    for g in generations:
        assert {"prompt", "response", "score", "ground_truth", "acc", "format"} <= set(g), g
        assert g["prompt"].startswith("What is ") and g["response_length"] <= 2
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, STEPS]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in (metrics[0], metrics[-1]):  # the validations: the gsm8k rule's accuracy and format apart
        assert {"val/reward_mean", "val/acc_mean", "val/format_mean"} <= set(m), m
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert f"validation at step {STEPS}, generation 4 of 4: score" in log
    assert not any("validation at step" in line for line in console)  # the log, not the quiet terminal
