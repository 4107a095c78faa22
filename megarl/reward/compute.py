"""Batched reward evaluation with a per-sample time limit and loud, specific failures.

Timeouts use threads: each sample runs in a daemon worker thread and the caller waits at most timeout_s from the
moment that sample started. A sample over the limit scores 0.0, its metrics are None, and it is counted in
report["num_timed_out"]. Python cannot kill a thread, so the slow call keeps running in the background (its result is
discarded, a fresh worker takes its place, and being a daemon it never blocks exit). Threads, not processes, because
custom reward functions loaded from files and closures need not be picklable and rule-based rewards are short;
the limit: a call that never releases the GIL (one huge C-level regex match) stalls every thread, timer included.

A reward function that raises, or returns NaN/inf/None/a non-number/a dict without "score", raises RewardError
naming the sample: a silently zeroed reward would train the policy on a bug.
"""
from __future__ import annotations

import inspect
import math
import numbers
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megarl.reward.registry import RewardError, RewardFn, RewardRouter


@dataclass(frozen=True)
class RewardInput:
    """One response to score. uid (e.g. the prompt's 'train.parquet#12') only appears in error messages."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Optional[dict] = None
    uid: Optional[str] = None


def _describe(index: int, sample: RewardInput) -> str:
    uid = f", uid {sample.uid}" if sample.uid else ""
    return (f"sample {index} (data_source {sample.data_source!r}{uid}; response starts "
            f"{sample.solution_str[:200]!r})")


def _traceback_summary(exc: BaseException, frames: int = 3) -> str:
    tb = traceback.extract_tb(exc.__traceback__)[-frames:]
    lines = [f"  {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in tb]
    return "\n".join(lines + [f"  {type(exc).__name__}: {exc}"])


def check_reward_kwargs(fn: RewardFn, reward_kwargs: dict[str, Any], name: str = "") -> None:
    """Fail before any call if reward.reward_kwargs has a key fn does not accept (a typo would otherwise raise in
    every sample)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature; let the call decide
        return
    try:
        sig.bind("data_source", "solution", "truth", None, **reward_kwargs)
    except TypeError as e:
        label = name or getattr(fn, "__name__", repr(fn))
        raise RewardError(f"reward.reward_kwargs {sorted(reward_kwargs)} do not fit reward function {label}{sig}: "
                          f"{e}; fix reward.reward_kwargs") from e


def to_score(value: Any, index: int, sample: RewardInput) -> tuple[float, dict[str, Any]]:
    """(score, extra metrics) from a reward function's return value, or RewardError naming the sample and value."""
    metrics: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"reward for {_describe(index, sample)} returned a dict without 'score': {value!r:.300}; "
                              f"a dict result needs a 'score' key (other keys become metrics)")
        metrics = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    # bool counts as a number (True -> 1.0): a pass/fail check is a legitimate reward
    if not isinstance(value, numbers.Real):
        raise RewardError(f"reward for {_describe(index, sample)} returned {value!r:.300} of type "
                          f"{type(value).__name__}; it must return a finite number or a dict with a 'score' number")
    score = float(value)
    if not math.isfinite(score):
        raise RewardError(f"reward for {_describe(index, sample)} returned {score!r}; rewards must be finite")
    return score, metrics


def _call(fn: RewardFn, sample: RewardInput, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return True, fn(sample.data_source, sample.solution_str, sample.ground_truth, sample.extra_info, **kwargs)
    except BaseException as e:  # noqa: BLE001 - a SystemExit in user code must not kill the worker silently either
        return False, e


def _run_with_timeouts(fns: Sequence[RewardFn], samples: Sequence[RewardInput], kwargs: dict[str, Any],
                       timeout_s: float, num_workers: int) -> tuple[dict[int, tuple[bool, Any]], list[int]]:
    """Run fns[i](samples[i]) on worker threads; returns (outcomes by index, indices that timed out)."""
    cond = threading.Condition()
    pending = deque(range(len(samples)))
    running: dict[int, tuple[float, threading.Thread]] = {}
    outcomes: dict[int, tuple[bool, Any]] = {}
    timed_out: list[int] = []
    abandoned: set[threading.Thread] = set()

    def worker() -> None:
        me = threading.current_thread()
        while True:
            with cond:
                if me in abandoned or not pending:
                    return
                i = pending.popleft()
                running[i] = (time.monotonic(), me)
                cond.notify_all()  # the timer must learn this sample's deadline now, not at its next wake-up
            outcome = _call(fns[i], samples[i], kwargs)
            with cond:
                if i in running:  # not already given up on by the timer
                    del running[i]
                    outcomes[i] = outcome
                cond.notify_all()

    def start_worker() -> None:
        threading.Thread(target=worker, name="megarl-reward", daemon=True).start()

    with cond:
        for _ in range(min(num_workers, len(samples))):
            start_worker()
        while True:
            now = time.monotonic()
            for i, (t0, thread) in list(running.items()):
                if now - t0 >= timeout_s:
                    del running[i]
                    timed_out.append(i)
                    abandoned.add(thread)
                    if pending:
                        start_worker()
            if len(outcomes) + len(timed_out) == len(samples):
                break
            deadlines = [t0 + timeout_s for t0, _ in running.values()]
            # the 1 s cap is only a safety net; workers notify on every result
            cond.wait(timeout=min([d - now for d in deadlines] + [1.0]) if deadlines else 1.0)
    return outcomes, sorted(timed_out)


def compute_rewards(fn: RewardFn, samples: Sequence[RewardInput], timeout_s: float = 10.0, num_workers: int = 4,
                    reward_kwargs: Optional[dict[str, Any]] = None,
                    ) -> tuple[list[float], dict[str, list[Any]], dict[str, Any]]:
    """Score every sample with fn (a reward function or a RewardRouter).

    num_workers=0 runs inline in the caller's thread with no time limit (for debugging with pdb).
    Returns (scores [N] floats, metrics {name: [N] values, None where a sample did not report it or timed out},
    report {num_samples, num_timed_out, timed_out_indices, seconds}).
    Raises RewardError for an unknown data_source (before scoring anything), a function that raises (naming the
    sample, its data_source, the start of the response and the last traceback frames) or a bad return value.
    """
    if timeout_s <= 0:
        raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
    if num_workers < 0:
        raise ValueError(f"reward.num_workers must be >= 0, got {num_workers}")
    kwargs = dict(reward_kwargs or {})
    start = time.monotonic()
    # Routing is resolved up front: an unknown data_source is a config error, not a per-sample failure.
    if isinstance(fn, RewardRouter):
        fns = [fn.resolve(s.data_source) for s in samples]
    else:
        fns = [fn] * len(samples)
    for f in {id(f): f for f in fns}.values():
        check_reward_kwargs(f, kwargs)

    if num_workers == 0:
        outcomes = {i: _call(fns[i], s, kwargs) for i, s in enumerate(samples)}
        timed_out: list[int] = []
    else:
        outcomes, timed_out = _run_with_timeouts(fns, samples, kwargs, timeout_s, num_workers)

    failed = [i for i in sorted(outcomes) if not outcomes[i][0]]
    if failed:
        i = failed[0]
        more = f" ({len(failed) - 1} more samples also failed)" if len(failed) > 1 else ""
        raise RewardError(f"reward function raised for {_describe(i, samples[i])}{more}:\n"
                          f"{_traceback_summary(outcomes[i][1])}") from outcomes[i][1]

    scores: list[float] = [0.0] * len(samples)
    per_sample: list[dict[str, Any]] = [{} for _ in samples]
    for i, (_, value) in sorted(outcomes.items()):
        scores[i], per_sample[i] = to_score(value, i, samples[i])
    names = sorted({k for m in per_sample for k in m})
    metrics = {k: [m.get(k) for m in per_sample] for k in names}
    report = {"num_samples": len(samples), "num_timed_out": len(timed_out), "timed_out_indices": timed_out,
              "seconds": time.monotonic() - start}
    return scores, metrics, report
