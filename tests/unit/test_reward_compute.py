"""compute_rewards: batching, metrics, timeouts, and the errors for raising or bad-valued reward functions."""
import math
import threading
import time

import pytest

from megarl.reward import RewardError, RewardInput, RewardRouter, compute, compute_rewards


def _samples(*texts, data_source="arithmetic", truth="21"):
    return [RewardInput(data_source, t, truth, {"i": i}, uid=f"train.parquet#{i}") for i, t in enumerate(texts)]


@pytest.mark.parametrize("workers", [0, 3])
def test_scores_and_metrics_in_sample_order(workers):
    samples = _samples("#### 21", "#### 20", "junk") + [RewardInput("openai/gsm8k", "#### 7", "7")]
    scores, metrics, report = compute_rewards(RewardRouter(), samples, timeout_s=5, num_workers=workers)
    assert scores == [1.0, 0.0, 0.0, 1.0]
    # gsm8k returns a float: no metrics for that sample
    assert metrics == {"acc": [1.0, 0.0, 0.0, None], "formatted": [1.0, 1.0, 0.0, None]}
    assert report["num_samples"] == 4 and report["num_timed_out"] == 0


def test_timeout_scores_zero_and_is_counted():
    release = threading.Event()

    def slow_on_odd(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info["i"] % 2:
            release.wait(120)  # "sleeps" until the test ends; the worker is abandoned, not joined
        return 1.0

    t0 = time.monotonic()
    scores, metrics, report = compute_rewards(slow_on_odd, _samples(*"abcd"), timeout_s=0.2, num_workers=2)
    release.set()
    # the slow calls (120 s) were not waited for; the margin absorbs a heavily loaded machine
    assert time.monotonic() - t0 < 60
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert report["num_timed_out"] == 2 and report["timed_out_indices"] == [1, 3]


def test_raising_function_names_sample_source_response_and_traceback():
    def helper(x):
        raise ZeroDivisionError("bad denominator")

    def buggy(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            helper(solution_str)
        return 0.0

    long_response = "boom " + "x" * 500
    with pytest.raises(RewardError) as e:
        compute_rewards(buggy, _samples("fine", long_response, "boom again"), num_workers=2)
    msg = str(e.value)
    assert "sample 1 (data_source 'arithmetic', uid train.parquet#1" in msg
    assert repr(long_response[:200]) in msg and "x" * 201 not in msg
    assert "(1 more samples also failed)" in msg
    assert "in helper" in msg and "in buggy" in msg and "ZeroDivisionError: bad denominator" in msg


@pytest.mark.parametrize("value, pattern", [
    (math.nan, r"sample 0 .* returned nan; rewards must be finite"),
    (math.inf, r"returned inf"),
    (None, r"returned None of type NoneType"),
    ("1.0", r"returned '1.0' of type str"),
    ({"acc": 1.0}, r"returned a dict without 'score': \{'acc': 1.0\}"),
    ({"score": math.nan}, r"returned nan"),
])
def test_bad_return_values_are_errors(value, pattern):
    with pytest.raises(RewardError, match=pattern):
        compute_rewards(lambda *a, **k: value, _samples("#### 21"), num_workers=1)


def test_bool_and_int_are_numbers():
    scores, _, _ = compute_rewards(lambda *a, **k: True, _samples("a"), num_workers=0)
    assert scores == [1.0]


def test_unknown_data_source_fails_before_scoring():
    calls = []
    router = RewardRouter(overrides={"mine": lambda *a, **k: calls.append(1) or 1.0})
    with pytest.raises(RewardError, match=r"no reward function for data_source='other'"):
        compute_rewards(router, _samples("a", data_source="mine") + _samples("b", data_source="other"))
    assert calls == []


def test_reward_kwargs_passed_and_checked():
    scores, _, _ = compute_rewards(RewardRouter(), _samples("#### 20"), reward_kwargs={"format_score": 0.1})
    assert scores == [0.1]
    with pytest.raises(RewardError, match=r"reward.reward_kwargs \['formatscore'\] do not fit reward function "
                                          r"arithmetic.*unexpected keyword"):
        compute_rewards(RewardRouter(), _samples("#### 20"), reward_kwargs={"formatscore": 0.1})


def test_no_reward_worker_outlives_its_timeout(tmp_path):
    """A call over the limit is stopped with its worker process (and what it started), not left running: Python
    cannot stop a thread, so a thread-based timeout would leave this sleep going for a minute."""
    import os
    import subprocess

    import psutil

    pids = tmp_path / "pids"

    def stuck(data_source, solution_str, ground_truth, extra_info=None):
        child = subprocess.Popen(["sleep", "60"])  # something the call started is stopped too
        with open(pids, "a") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(60)
        return 1.0

    threads_before = threading.active_count()
    children_before = set(psutil.Process().children(recursive=True))  # e.g. a checkpoint writer of an earlier test
    t0 = time.monotonic()
    scores, _, report = compute_rewards(stuck, _samples("a", "b"), timeout_s=2, num_workers=2)
    assert time.monotonic() - t0 < 30  # not the 60 s of the calls
    assert scores == [0.0, 0.0] and report["timed_out_indices"] == [0, 1]
    started = [int(p) for line in pids.read_text().splitlines() for p in line.split()]
    # each call that got as far as starting its child within the limit (on a loaded machine maybe not both) ran in a
    # worker of its own
    assert len(started) in (2, 4) and os.getpid() not in started
    alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert threading.active_count() == threads_before
    # what remains are the idle workers kept for the next call, with nothing running under them
    kept = {w.proc.pid for w in compute._pool.workers if w.usable}
    assert {p.pid for p in set(psutil.Process().children(recursive=True)) - children_before} <= kept
    assert not any(psutil.Process(pid).children() for pid in kept)
    assert not set(started) & kept


def test_worker_that_dies_is_a_named_failure():
    import os

    def exits(data_source, solution_str, ground_truth, extra_info=None):
        os._exit(3)

    with pytest.raises(RewardError, match=r"(?s)sample 0 .*worker process died \(exit code 3\)"):
        compute_rewards(exits, _samples("a"), num_workers=1)


def test_workers_are_kept_between_calls_and_replaced_after_a_timeout():
    """Forking a trainer-sized process per call cost more than the rule rewards it runs: the workers are kept; one
    killed for a timeout is replaced by the next call; another function gets workers of its own."""
    import os

    def pid(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "stuck":
            time.sleep(60)
        return {"score": 1.0, "pid": os.getpid()}

    def pids(texts, timeout_s=30.0):
        _, metrics, report = compute_rewards(pid, _samples(*texts), timeout_s=timeout_s, num_workers=2)
        return metrics.get("pid", []), report

    first, _ = pids("ab" * 20)
    second, _ = pids("ab" * 20)
    assert set(first) == set(second) and os.getpid() not in first
    _, report = pids(["stuck"], timeout_s=1)
    assert report["timed_out_indices"] == [0]
    third, _ = pids("ab" * 20)
    assert len(set(third)) <= 2 and set(third) != set(first)  # the killed worker was replaced
    other = compute_rewards(lambda *a, **k: {"score": 0.0, "pid": os.getpid()}, _samples("a"), num_workers=1)[1]
    assert not set(other["pid"]) & set(third)
    compute.close_workers()
    assert compute._pool is None
