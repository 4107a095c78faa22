"""Response-health flags (megarl.report.health_flags) on hand-built metric rows: a healthy run, responses truncating
from step 7, entropy blowing up from step 12, short blips that must not fire; the trainer's logger warns once per
flag the step it fires, and the end-of-run summary and `megarl report` show the same flags."""
import json
import logging

from megarl import cli, report
from megarl.metrics import MetricsLogger

CAP = 512  # rollout.response_length of the hand-built runs


def _healthy(steps: int = 20) -> list[dict]:
    """A run whose responses end well before the cap and whose entropy wobbles around 0.47 (0.45, 0.47 or 0.49)."""
    rows = [{"step": 0, "val/reward_mean": 0.3}]  # validation before training: no train metrics
    for step in range(1, steps + 1):
        rows.append({"step": step, "train/truncated_frac": 0.05, "train/response_length_mean": 120.0,
                     "actor/entropy": 0.45 + 0.02 * (step % 3), "train/reward_mean": 0.1})
    return rows


def _set(rows: list[dict], steps, **values) -> list[dict]:
    for row in rows:
        if row["step"] in steps:
            row.update({k.replace("__", "/"): v for k, v in values.items()})
    return rows


def test_a_healthy_run_has_no_flags():
    assert report.health_flags(_healthy(), CAP) == []
    assert report.health_flags(_healthy(), None) == []


def test_truncation_from_step_7_is_flagged_at_step_7():
    rows = _set(_healthy(), range(7, 21), train__truncated_frac=0.6, train__response_length_mean=500.0)
    [flag] = report.health_flags(rows, CAP)
    assert (flag.kind, flag.step, flag.until) == ("length_cap", 7, 20)
    line = flag.line()
    assert "from step 7" in line and "train/truncated_frac 0.6" in line and "rollout.response_length=512" in line
    assert "eos" in line and "rollout.response_length" in line  # what to do


def test_mean_length_at_the_cap_alone_is_flagged_when_the_cap_is_known():
    rows = _set(_healthy(), range(5, 9), train__truncated_frac=0.1, train__response_length_mean=0.96 * CAP)
    [flag] = report.health_flags(rows, CAP)
    assert (flag.kind, flag.step, flag.until) == ("length_cap", 5, 8)  # back to healthy at step 9
    assert report.health_flags(rows, None) == []  # without the cap only the truncated share can tell


def test_entropy_blow_up_from_step_12_is_flagged_at_step_12():
    rows = _set(_healthy(), range(12, 21), actor__entropy=2.5)
    [flag] = report.health_flags(rows, CAP)
    assert (flag.kind, flag.step, flag.until) == ("entropy", 12, 20)
    # early level: steps 1-5 have 0.47, 0.49, 0.45, 0.47, 0.49 -> mean 0.474
    assert "early level 0.474" in flag.line() and "actor/entropy 2.5 -> 2.5" in flag.line()


def test_both_flags_in_one_run():
    rows = _set(_healthy(), range(7, 21), train__truncated_frac=0.6)
    rows = _set(rows, range(12, 21), actor__entropy=2.5)
    assert [(f.kind, f.step) for f in report.health_flags(rows, CAP)] == [("length_cap", 7), ("entropy", 12)]
    # the logger stops scanning once it has warned of every kind: HEALTH_KINDS must name them all
    assert {f.kind for f in report.health_flags(rows, CAP)} == set(report.HEALTH_KINDS)


def test_short_noisy_blips_do_not_fire():
    rows = _set(_healthy(), (4, 5, 7, 8), train__truncated_frac=0.5)  # two steps, a healthy one, two again
    rows = _set(rows, (9, 10), actor__entropy=3.0)  # two steps of high entropy
    rows = _set(rows, (15,), train__response_length_mean=float(CAP), actor__entropy=4.0)  # one step of both
    assert report.health_flags(rows, CAP) == []


def test_entropy_below_the_floor_is_not_a_blow_up():
    rows = _set(_healthy(), range(1, 21), actor__entropy=0.1)
    rows = _set(rows, range(10, 21), actor__entropy=0.5)  # 5x its early level, still a low entropy
    assert report.health_flags(rows, CAP) == []


def test_the_logger_warns_once_the_step_a_flag_fires(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="megarl.metrics")
    rows = _set(_healthy(), range(7, 21), train__truncated_frac=0.6)
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False, response_length=CAP)
    warned_at = []
    for row in rows:
        before = len(caplog.records)
        logger.log(row["step"], {k: v for k, v in row.items() if k != "step"})
        warned_at += [row["step"]] * (len(caplog.records) - before)
    logger.close()
    assert warned_at == [9]  # steps 7, 8 and 9 in a row: once, never again
    assert caplog.records[0].getMessage().startswith("health: responses hit the length cap from step 7")


def test_the_summary_ends_with_the_flags():
    rows = _set(_healthy(), range(12, 21), actor__entropy=2.5)
    last = report.summary_lines(rows, 10.0, CAP)[-1]
    assert last.startswith("health: entropy blew up from step 12 (through step 20)")
    assert not any(line.startswith("health:") for line in report.summary_lines(_healthy(), 10.0, CAP))


def test_report_shows_the_health_section(tmp_path, capsys):
    rows = _set(_healthy(), range(7, 21), train__truncated_frac=0.6)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.resolved.yaml").write_text(f"rollout: {{response_length: {CAP}}}\ntrainer: {{seed: 1}}\n")
    assert report.read_response_length(tmp_path) == CAP
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "health: responses hit the length cap from step 7 (through step 20)" in out
    assert "rollout.response_length=512" in " ".join(out.split())  # read from the resolved config
    assert all(len(line) <= report.WRAP for line in out.splitlines()[:-1])  # wrapped (the last: the PNG's path)

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _healthy()))
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "health: no flags" in capsys.readouterr().out
