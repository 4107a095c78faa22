"""Real responses in a run's files and in `megarl report`: which samples are picked, long text shortened and wrapped,
the gsm8k rule's accuracy apart from its format, samples.jsonl and val_generations.jsonl across a resume, the
validation generations in the run's log but not on a quiet terminal."""
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megarl import cli, report
from megarl.metrics import MetricsLogger
from megarl.reward import rules
from megarl.reward.compute import RewardInput
from megarl.reward.registry import RewardRouter
from megarl.steps import _fill_missing, answer_checks
from tests.unit.test_steps_rounds_remax import rt  # noqa: F401  (the one-rank process group fixture)

ROOT = Path(__file__).resolve().parents[2]
NAN = float("nan")


def test_pick_one_correct_and_one_wrong_where_the_reward_tells():
    assert report.pick_samples([0.1, 1.0, 0.0, 1.0], acc=[0.0, 1.0, NAN, 1.0]) == [(1, "correct"), (0, "wrong")]
    assert report.pick_samples([1.0, 1.0], acc=[1.0, 1.0]) == [(0, "correct")]  # no wrong one to show
    # no acc (or none known): the highest and the lowest score
    assert report.pick_samples([0.1, 1.0, -1.0, 1.0]) == [(1, "highest score"), (2, "lowest score")]
    assert report.pick_samples([0.1, 1.0, -1.0], acc=[NAN, None, NAN]) == [(1, "highest score"), (2, "lowest score")]
    assert report.pick_samples([0.0, 0.0, 0.0]) == [(0, "all scored alike")]


def test_long_text_keeps_its_start_and_end():
    text = "A" * 400 + "B" * 400 + "C" * 400
    short = report.shorten(text)
    # 600 - 20 characters kept, half from each end; the 1200 - 580 = 620 in between are counted
    assert short == "A" * 290 + " [... 620 chars ...] " + "C" * 290
    assert report.shorten("short answer #### 4") == "short answer #### 4"


def test_wrapped_text_fits_the_width_and_keeps_line_breaks():
    lines = report.wrapped("response", "step one: " + "x " * 80 + "\n#### 42", width=60)
    assert lines[0].startswith("    response: step one:")
    assert all(len(line) <= 60 for line in lines)
    assert lines[-1].strip() == "#### 42"  # the response's own last line stays a line
    assert report.wrapped("response", "") == ["    response: (empty)"]


def _inputs(data_source: str, texts: list[str], truth: str = "42") -> list[RewardInput]:
    return [RewardInput(data_source, t, truth) for t in texts]


TEXTS = ["so the total is #### 42", "the answer is 42", "#### 41", "no number at all"]


def test_gsm8k_accuracy_apart_from_format():
    router = RewardRouter()
    for fn, source in ((router, "openai/gsm8k"), (router, "gsm8k"), (rules.gsm8k, "anything")):
        checks = answer_checks(fn, _inputs(source, TEXTS), {})
        # the last number counts without '####' (verl's non-strict gsm8k); format wants the marker
        assert checks == {"acc": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0, 0.0]}
    strict = answer_checks(router, _inputs("openai/gsm8k", TEXTS), {"strict": True, "format_score": 0.1})
    assert strict["acc"] == [1.0, 0.0, 0.0, 0.0]  # a formatted wrong answer is wrong, whatever it earns


def test_rows_of_other_rules_get_no_checks():
    for fn, source in ((RewardRouter(), "megarl/arithmetic"), (RewardRouter(), "no such source"),
                       (rules.math, "openai/gsm8k"), (lambda *a, **k: 0.0, "openai/gsm8k")):
        checks = answer_checks(fn, _inputs(source, TEXTS[:2]), {})
        assert all(math.isnan(v) for values in checks.values() for v in values), (source, checks)


def test_checks_fill_only_what_the_reward_function_left_unknown():
    extras = {"acc": torch.tensor([1.0, NAN, 0.0])}
    _fill_missing(extras, {"acc": torch.tensor([0.0, 1.0, NAN]), "format": torch.tensor([1.0, 0.0, NAN]),
                           "other": torch.tensor([NAN, NAN, NAN])})
    assert extras["acc"].tolist() == [1.0, 1.0, 0.0]  # the function's own values win
    assert extras["format"][:2].tolist() == [1.0, 0.0] and extras["format"][2].isnan()
    assert "other" not in extras  # no row had it


def _sample(i: int) -> dict:
    return {"label": "correct", "prompt": f"What is {i} + 1 ?", "response": f"#### {i + 1}", "score": 1.0,
            "ground_truth": str(i + 1), "response_length": 3, "truncated": False}


def test_samples_keep_the_first_and_the_latest_step_across_a_resume(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False, samples=True)
    for step in (1, 2, 3):
        logger.log_samples(step, [_sample(step)])
        logger.log_val_generations(step, [_sample(10 + step), _sample(20 + step)])
    logger.close()
    steps = lambda name: [r["step"] for r in report.read_jsonl(tmp_path / name)]  # noqa: E731
    assert steps("samples.jsonl") == [1, 3]
    assert steps("val_generations.jsonl") == [1, 1, 2, 2, 3, 3]
    # resumed from step 2: step 3 is done again, the first step's samples stay the first
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False, samples=True, resume_step=2)
    assert steps("samples.jsonl") == [1]
    assert steps("val_generations.jsonl") == [1, 1, 2, 2]
    logger.log_samples(3, [_sample(30)])
    assert steps("samples.jsonl") == [1, 3]
    assert report.read_jsonl(tmp_path / "samples.jsonl")[1]["prompt"] == "What is 30 + 1 ?"
    logger.close()
    # a fresh run in the same run_dir starts without the old run's responses
    MetricsLogger(tmp_path, tensorboard=False, console=False, samples=True).close()
    assert not (tmp_path / "samples.jsonl").exists() and not (tmp_path / "val_generations.jsonl").exists()


def test_val_generations_go_to_the_log_one_line_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megarl.log_only")
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False, samples=True)
    logger.log_val_generations(25, [_sample(1), {**_sample(2), "response": "line one\nline two"}])
    logger.close()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("megarl.log_only")]
    assert lines == ["validation at step 25, generation 1 of 2: score 1  ground truth '2'  prompt 'What is 1 + 1 ?'  "
                     "response '#### 2'",
                     "validation at step 25, generation 2 of 2: score 1  ground truth '3'  prompt 'What is 2 + 1 ?'  "
                     "response 'line one\\nline two'"]


LOG_SCRIPT = textwrap.dedent("""
    import logging
    from megarl import console

    with console.captured("rank0"):
        console.setup_logging("INFO", is_rank0=True)
        logging.getLogger(console.LOG_ONLY + ".samples").info("a validation generation")
        logging.getLogger("megarl.metrics").warning("health: a flag")
""")


def test_log_only_lines_stay_off_a_quiet_terminal(tmp_path):
    env = dict(os.environ, MEGARL_LOG_DIR=str(tmp_path / "logs"), MEGARL_VERBOSE="0")
    proc = subprocess.run([sys.executable, "-c", LOG_SCRIPT], capture_output=True, text=True, env=env, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "a validation generation" in log and "health: a flag" in log
    assert "a validation generation" not in proc.stderr and "health: a flag" in proc.stderr


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_shows_validation_parts_and_real_responses(tmp_path, capsys):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 0, "val/reward_mean": 0.25, "val/acc_mean": 0.2, "val/format_mean": 0.5},
        *({"step": s, "train/reward_mean": 0.1, "train/truncated_frac": 0.0, "actor/entropy": 0.4} for s in (1, 2, 3)),
        {"step": 4, "val/reward_mean": 0.75, "val/acc_mean": 0.7, "val/format_mean": 1.0},
    ])
    long = "reasoning " * 100 + "#### 7"
    _write(tmp_path / "samples.jsonl", [
        {"step": 1, **_sample(1)}, {"step": 1, **_sample(2), "label": "wrong", "score": 0.0, "truncated": True,
                                    "response_length": 8},
        {"step": 3, **_sample(3), "response": long},
    ])
    _write(tmp_path / "val_generations.jsonl", [
        {"step": s, **_sample(i), "label": f"prompt {i}", "score": score, "acc": score}
        for s in (0, 2, 4) for i, score in ((0, 0.0), (1, 1.0))])
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("samples of step 1 and step 3 (samples.jsonl):")
    assert out[at - 3].startswith("validation (acc: correct final answer; format: a '####' answer present")
    assert out[at - 2:at] == ["  step 0: reward 0.250  acc 0.200  format 0.500",
                              "  step 4: reward 0.750  acc 0.700  format 1.000"]
    assert out[at + 1:at + 7] == [
        "  step 1, correct: score 1, 3 tokens, ended, ground truth '2'",
        "    prompt: What is 1 + 1 ?",
        "    response: #### 2",
        "  step 1, wrong: score 0, 8 tokens, truncated (hit the length cap), ground truth '3'",
        "    prompt: What is 2 + 1 ?",
        "    response: #### 3"]
    step3 = out[at + 7:out.index(next(line for line in out if line.startswith("validation generations")))]
    shown = " ".join(line.strip() for line in step3[2:])
    assert "[... 426 chars ...]" in shown and shown.endswith("#### 7")  # 1006 chars: 290 + 290 of them shown
    assert all(len(line) <= report.WRAP for line in step3)
    val = out[out.index(next(line for line in out if line.startswith("validation generations"))):-1]
    assert val[0] == ("validation generations of step 0 and step 4 (val_generations.jsonl, the first 2 prompts of the "
                      "validation set):")
    # of each shown validation: the correct one, then the wrong one (step 2's are in the file, not shown)
    assert [line for line in val if line.startswith("  step")] == [
        "  step 0, correct: score 1, 3 tokens, ended, ground truth '2'",
        "  step 0, wrong: score 0, 3 tokens, ended, ground truth '1'",
        "  step 4, correct: score 1, 3 tokens, ended, ground truth '2'",
        "  step 4, wrong: score 0, 3 tokens, ended, ground truth '1'"]


class WordTokenizer:
    WORDS = {9: "####", 42: "42", 41: "41", 5: "so"}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS.get(int(t), f"w{int(t)}") for t in ids)


class ScriptedEngine:
    """Validation answers: prompt [p] gets RESPONSES[p] (one sample per prompt)."""

    RESPONSES = {1: [9, 42], 2: [5, 42], 3: [9, 41], 4: [5], 5: [9, 42]}

    def start_generate(self, prompt_token_ids, validate=False, prompt_index=None, seed=None, greedy=False):
        from megarl.rollout.protocol import Deferred
        from tests.unit.test_steps_rounds_remax import _batch

        return Deferred.ready(_batch([self.RESPONSES[p[0]] for p in prompt_token_ids],
                                     [list(p) for p in prompt_token_ids], list(prompt_index)))


def test_validation_reports_gsm8k_accuracy_apart_from_format_and_its_first_generations(rt):
    from megarl import steps
    from megarl.data import PromptRecord
    from megarl.validate import load_config
    from tests.unit.test_steps_rounds_remax import TINY

    cfg = load_config(data=TINY, overrides=["rollout.n=2", "data.val_batch_size=2", "trainer.log_val_generations=3",
                                            "reward.reward_kwargs={format_score: 0.1}"])
    sources = ["openai/gsm8k"] * 4 + ["megarl/arithmetic"]
    records = [PromptRecord(index=i, uid=f"val#{i}", prompt="", data_source=s, ground_truth="42", prompt_ids=[i + 1])
               for i, s in enumerate(sources)]
    generations: list = []
    metrics = steps.validate(ScriptedEngine(), RewardRouter(), records, WordTokenizer(), cfg, rt, generations)
    # rewards: '#### 42' 1, 'so 42' 1 (the last number), '#### 41' 0.1 (format_score), 'so' 0; arithmetic '#### 42' 1
    assert metrics["val/reward_mean"] == pytest.approx(3.1 / 5)
    assert metrics["val/acc_mean"] == pytest.approx(3 / 5)  # the arithmetic rule's own acc for the last row
    assert metrics["val/format_mean"] == pytest.approx(2 / 4)  # gsm8k rows only
    assert metrics["val/formatted_mean"] == pytest.approx(1.0)  # the arithmetic rule's own, its row only
    # the first 3 prompts of the set, across the val_batch_size chunks
    assert [(g["label"], g["response"], g["score"], g["acc"], g["format"]) for g in generations] == [
        ("prompt 0", "#### 42", 1.0, 1.0, 1.0), ("prompt 1", "so 42", 1.0, 1.0, 0.0),
        ("prompt 2", "#### 41", pytest.approx(0.1), 0.0, 1.0)]
    assert generations[0]["ground_truth"] == "42" and generations[0]["truncated"] is False


def test_verls_log_val_generations_carries_over():
    from megarl.convert_verl import convert

    c = convert({"trainer.log_val_generations": 10})
    assert c.recipe["trainer"]["log_val_generations"] == 10 and not c.refused and not c.dropped


def test_validation_reports_each_val_file_apart(rt):
    """Two val files of one data_source (seen and held-out templates): each file's reward and accuracy on its own."""
    from megarl import steps
    from megarl.data import PromptRecord
    from megarl.validate import load_config
    from tests.unit.test_steps_rounds_remax import TINY

    cfg = load_config(data=TINY, overrides=["rollout.n=2"])
    # prompts 1, 2 from val.parquet ('#### 42' right, 'so 42' right by the last number); 3, 4 from val_unseen.parquet
    # ('#### 41' wrong, 'so' no answer)
    records = [PromptRecord(index=i, uid=f"{name}.parquet#{i}", prompt="", data_source="openai/gsm8k",
                            ground_truth="42", prompt_ids=[i + 1])
               for i, name in enumerate(["val", "val", "val_unseen", "val_unseen"])]
    metrics = steps.validate(ScriptedEngine(), RewardRouter(), records, WordTokenizer(), cfg, rt)
    assert metrics["val/val/reward_mean"] == pytest.approx(1.0)
    assert metrics["val/val_unseen/reward_mean"] == pytest.approx(0.0)
    assert metrics["val/val/acc_mean"] == pytest.approx(1.0) and metrics["val/val_unseen/acc_mean"] == 0.0
    assert metrics["val/val/format_mean"] == pytest.approx(0.5) and metrics["val/val_unseen/format_mean"] == 0.5
    assert metrics["val/acc_mean"] == pytest.approx(0.5)
    # one file: no per-file keys
    one = steps.validate(ScriptedEngine(), RewardRouter(), records[:2], WordTokenizer(), cfg, rt)
    assert not any(k.startswith("val/val/") for k in one)
