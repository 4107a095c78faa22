"""Batched reward evaluation with a per-sample time limit and loud, specific failures.

Timeouts use worker processes: each sample runs in a worker forked from the caller, and the caller waits at most
timeout_s from the moment that sample started. A sample over the limit scores 0.0, its metrics are None, and it is
counted in report["num_timed_out"]; its worker (with anything it started) is killed and a fresh one takes its place,
so no call outlives its limit. Python cannot stop a thread, hence processes; forked, so reward functions loaded from
files and closures need not be picklable (the samples travel to the workers and the return values back, pickled).
The workers are kept from one call to the next (forking a trainer-sized process costs more than a batch of rule
rewards): forked at the first call for a reward function and reward_kwargs, idle between calls. A worker dies with the
trainer (parent-death signal) and ignores the SIGINT/SIGTERM meant for the trainer; `close_workers()` (also run at
exit) ends them. What a worker changes in its own memory (a counter in the reward function, say) does not reach the
caller. Reward functions must not use CUDA (a forked child cannot).

A reward function that raises, or returns NaN/inf/None/a non-number/a dict without "score", raises RewardError
naming the sample: a silently zeroed reward would train the policy on a bug.
"""
from __future__ import annotations

import atexit
import inspect
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import numbers
import os
import pickle
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megarl import lifecycle
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
    """(True, the return value) or (False, the exception's traceback summary)."""
    try:
        return True, fn(sample.data_source, sample.solution_str, sample.ground_truth, sample.extra_info, **kwargs)
    except BaseException as e:  # noqa: BLE001 - a SystemExit in user code must not kill the worker silently either
        return False, _traceback_summary(e)


def _serve(conn, fns: Sequence[RewardFn], kwargs: dict[str, Any], parent: int) -> None:
    """A forked worker: score the (index, function index, sample) it is sent until it receives None."""
    import signal

    lifecycle.bind_to_parent(parent)
    signal.set_wakeup_fd(-1)  # the parent's signal pipe is not ours to write to
    while True:
        job = conn.recv()
        if job is None:
            return
        i, f, sample = job
        ok, value = _call(fns[f], sample, kwargs)
        try:
            conn.send((i, ok, value))
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send((i, False, f"  the return value {value!r:.200} cannot be sent back: {type(e).__name__}: {e}"))


_DEPTH = 8  # samples queued per worker: it starts the next one without waiting for the parent's reply
_WAITING_BYTES = 32 << 10  # well under what a pipe buffers


class _Worker:
    """A forked scoring process with the sample indices sent to it, in the order it scores them; the first one is
    the sample it works on, since `started`."""

    def __init__(self, fns: Sequence[RewardFn], kwargs: dict[str, Any]):
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, fns, kwargs, os.getpid()), daemon=True,
                                name="megarl-reward")
        self.proc.start()
        child.close()
        self.queue: deque = deque()
        self.sizes: deque = deque()  # the pickled size of each queued job
        self.started = 0.0
        self.dead = False  # killed (Process.is_alive cannot tell: kill_tree reaps it)

    @property
    def usable(self) -> bool:
        """Not killed and still running (a worker can also end outside a call, e.g. killed by hand)."""
        return not self.dead and self.proc.exitcode is None

    def fits(self, size: int) -> bool:
        """Room for one more job of `size` pickled bytes: an idle worker takes any; a busy one up to _DEPTH, with at
        most _WAITING_BYTES waiting in its pipe, so a send never blocks on a worker stuck in a call (the timeout is
        enforced by this process, which must not be blocked)."""
        return not self.queue or (len(self.queue) < _DEPTH and sum(self.sizes) - self.sizes[0] + size <= _WAITING_BYTES)

    def give(self, i: int, job: bytes) -> None:
        if not self.queue:
            self.started = time.monotonic()
        self.queue.append(i)
        self.sizes.append(len(job))
        self.conn.send_bytes(job)

    def done(self) -> int:
        """The sample it was working on ended (scored, timed out or crashed): the next one starts now."""
        self.started = time.monotonic()
        self.sizes.popleft()
        return self.queue.popleft()

    def kill(self) -> None:
        self.dead = True
        lifecycle.kill_tree(self.proc.pid)
        self.proc.join()
        self.conn.close()

    def close(self) -> None:
        """Ask an idle worker to end; kill it if it does not (or is busy)."""
        if not self.dead and self.proc.is_alive() and not self.queue:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(timeout=1)
        if not self.dead and self.proc.is_alive():
            self.kill()
        self.conn.close()


class _Pool:
    """Scoring workers kept from one call to the next (forking a trainer-sized process costs more than scoring a
    batch of rule rewards). They are forked with the reward functions (`fns`) and reward_kwargs of the calls they
    serve, so a call needing another function or other kwargs gets a new pool; a worker killed for a timeout or dead
    is replaced when work is next given out. Workers belong to the process and thread that forked them (a forked
    child dies with the thread that started it, see lifecycle.die_with_parent)."""

    def __init__(self, fns: Sequence[RewardFn], kwargs: dict[str, Any]):
        self.fns, self.kwargs = list(fns), dict(kwargs)
        self.owner = (os.getpid(), threading.get_ident())
        self.workers: list[_Worker] = []

    def serves(self, fns: Sequence[RewardFn], kwargs: dict[str, Any]) -> bool:
        return (self.owner == (os.getpid(), threading.get_ident()) and self.kwargs == kwargs
                and all(any(f is g for g in self.fns) for f in fns))

    def index(self, fn: RewardFn) -> int:
        return next(k for k, g in enumerate(self.fns) if g is fn)

    def take(self, n: int) -> list[_Worker]:
        """n workers, started where fewer are alive. A worker that ended outside a call is replaced."""
        for k, w in enumerate(self.workers):
            if not w.usable:
                w.close()
                self.workers[k] = _Worker(self.fns, self.kwargs)
        self.workers += [_Worker(self.fns, self.kwargs) for _ in range(n - len(self.workers))]
        return self.workers[:n]

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []


_pool: Optional[_Pool] = None


def _pool_for(fns: Sequence[RewardFn], kwargs: dict[str, Any]) -> _Pool:
    """The kept pool if it serves these functions and kwargs, else a new one (the previous one is closed; it keeps the
    functions it had, so alternating sets of data_sources do not fork anew each time)."""
    global _pool
    if _pool is not None and _pool.serves(fns, kwargs):
        return _pool
    keep: list = []
    if _pool is not None:
        if _pool.owner[0] == os.getpid():  # in a forked child the parent's workers are not ours to close
            _pool.close()
        if _pool.kwargs == kwargs:
            keep = _pool.fns
    _pool = _Pool(keep + [f for f in fns if not any(f is g for g in keep)], kwargs)
    return _pool


@atexit.register
def close_workers() -> None:
    """End the kept reward workers (at exit: they ignore the SIGTERM multiprocessing would send them, then join)."""
    global _pool
    if _pool is not None and _pool.owner[0] == os.getpid():
        _pool.close()
    _pool = None


def _jobs(samples: Sequence[RewardInput], fn_index: Sequence[int]) -> list[bytes]:
    """Each sample's message to a worker, pickled once: (index, which function, sample)."""
    jobs = []
    for i, (f, sample) in enumerate(zip(fn_index, samples)):
        try:
            jobs.append(pickle.dumps((i, f, sample), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - e.g. an extra_info holding an open file
            raise RewardError(f"{_describe(i, sample)} cannot be sent to a reward worker process ({type(e).__name__}: "
                              f"{e}); its ground_truth and extra_info must be picklable, or set reward.num_workers=0"
                              ) from e
    return jobs


def _run_with_timeouts(fns: Sequence[RewardFn], samples: Sequence[RewardInput], kwargs: dict[str, Any],
                       timeout_s: float, num_workers: int) -> tuple[dict[int, tuple[bool, Any]], list[int]]:
    """Run fns[i](samples[i]) on the kept worker processes; returns (outcomes by index, indices that timed out). When
    this returns (or raises), no call is running: a worker is idle, or killed with anything it started.

    Each worker holds up to _DEPTH samples, so it never waits for the parent between two samples (a round trip per
    sample cost more than a rule reward). Time limits stay per sample: a sample's clock starts when the previous one
    of its worker ended; a worker killed for a timeout or dead hands its other samples back to the queue."""
    pending = deque(range(len(samples)))
    outcomes: dict[int, tuple[bool, Any]] = {}
    timed_out: list[int] = []
    pool = _pool_for(fns, kwargs)
    jobs = _jobs(samples, [pool.index(f) for f in fns])
    workers = pool.take(min(num_workers, len(samples)))

    def retire(w: _Worker) -> None:
        w.kill()
        pending.extendleft(reversed(w.queue))
        w.queue.clear()
        w.sizes.clear()

    try:
        while len(outcomes) + len(timed_out) < len(samples):
            for k, w in enumerate(workers):
                if pending and w.dead:  # replaced after a timeout or a crash
                    w = workers[k] = pool.workers[k] = _Worker(pool.fns, pool.kwargs)
                while pending and w.fits(len(jobs[pending[0]])):
                    i = pending.popleft()
                    w.give(i, jobs[i])
            busy = [w for w in workers if w.queue]
            now = time.monotonic()
            wait = max(0.0, min(w.started + timeout_s for w in busy) - now)
            for conn in mp_connection.wait([w.conn for w in busy], timeout=wait):
                w = next(w for w in busy if w.conn is conn)
                try:
                    while True:  # every result that arrived
                        i, ok, value = conn.recv()
                        if i != w.queue[0]:
                            raise RuntimeError(f"reward worker answered sample {i} while {w.queue[0]} was first")
                        w.done()
                        outcomes[i] = (ok, value)
                        if not w.queue or not conn.poll():
                            break
                except EOFError:  # the function ended its worker (os._exit, a crash)
                    w.proc.join(timeout=1)
                    outcomes[w.done()] = (False, f"  the worker process died (exit code {w.proc.exitcode})")
                    retire(w)
            now = time.monotonic()
            for w in busy:
                if w.queue and now - w.started >= timeout_s:
                    timed_out.append(w.done())
                    retire(w)
    except BaseException:
        # an error (or KeyboardInterrupt) mid-call: workers may still hold samples, so none of them is kept
        close_workers()
        raise
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
        raise RewardError(f"reward function raised for {_describe(i, samples[i])}{more}:\n{outcomes[i][1]}")

    scores: list[float] = [0.0] * len(samples)
    per_sample: list[dict[str, Any]] = [{} for _ in samples]
    for i, (_, value) in sorted(outcomes.items()):
        scores[i], per_sample[i] = to_score(value, i, samples[i])
    names = sorted({k for m in per_sample for k in m})
    metrics = {k: [m.get(k) for m in per_sample] for k in names}
    report = {"num_samples": len(samples), "num_timed_out": len(timed_out), "timed_out_indices": timed_out,
              "seconds": time.monotonic() - start}
    return scores, metrics, report
