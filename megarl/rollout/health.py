"""Is an engine process alive and making progress? A watchdog the trainer consults while it waits on the engine.

The engine process writes a few timestamps into shared memory; the trainer reads them while it waits for a reply
(megarl.rollout.hosting.process) and before it hands the engine new work, and calls the engine lost when:

    no heartbeat for rollout.health.timeout_s       the process is stopped (SIGSTOP), frozen, or swapped out for good
    no engine step for the stall limit while it     a hung decode: a dead TP worker its peers wait on, a stuck kernel,
      generates                                     a deadlock; the process itself still beats
    one other call running rollout.health.          a weight load or sleep/wake that never returns
      call_timeout_s

The stall limit comes from the decode rate this engine showed so far: `stall_factor` times its slowest step, at
least `stall_floor_s`; `first_wait_s` during its first generation call, whose steps are not counted either (they
include the engine's warm-up: kernels chosen and compiled for each new shape, seconds where a later step takes
milliseconds). Time is
CLOCK_MONOTONIC, which every process of a machine shares, so a hang that began while the trainer trained is judged
at its first look, not a limit later.

Test hooks: `inject(kind)` makes the engine's next step raise an engine OOM ("oom") or hang for good ("hang", the
heartbeat goes on), as megarl.rollout.hosting.supervisor's MEGARL_TEST_* hooks ask; MEGARL_TEST_ENGINE_STEP_DELAY_S
in the engine's environment adds that many seconds to each of its steps (a slow engine: generations still running
when the trainer wants the next batch).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

# slots of the shared array (doubles)
_BEAT, _PROGRESS, _BUSY, _SINCE, _SLOWEST, _CALLS, _FAULT = range(7)
IDLE, GENERATING, CALL = 0.0, 1.0, 2.0
_FAULTS = {"oom": 1.0, "hang": 2.0}
GENERATION_CALLS = frozenset({"generate", "continue_generate", "rollout_agents", "sequence_logprobs"})


@dataclass(frozen=True)
class HealthSettings:
    """rollout.health (megarl.config.schema.EngineHealthConfig), in seconds."""

    interval_s: float = 1.0
    timeout_s: float = 30.0
    first_wait_s: float = 300.0
    stall_floor_s: float = 30.0
    stall_factor: float = 20.0
    call_timeout_s: Optional[float] = 1800.0

    @classmethod
    def of(cls, cfg) -> Optional["HealthSettings"]:
        """From a RolloutConfig's `health` section; None where it is turned off."""
        h = cfg.health
        if not h.enable:
            return None
        return cls(h.interval_s, h.timeout_s, h.first_wait_s, h.stall_floor_s, h.stall_factor, h.call_timeout_s)


def warming_up(slowest_step_s: float, calls: int) -> bool:
    """Whether the engine has not shown its decode rate yet (in its first generation call, or none measured)."""
    return calls < 1 or slowest_step_s <= 0


def stall_limit(slowest_step_s: float, calls: int, s: HealthSettings) -> float:
    """Seconds without an engine step that mean a hung generation: first_wait_s until the engine has finished a
    generation call (`calls`, its warm-up) and measured a step after it, then max(stall_floor_s, stall_factor x the
    slowest step it took since)."""
    if warming_up(slowest_step_s, calls):
        return s.first_wait_s
    return max(s.stall_floor_s, s.stall_factor * slowest_step_s)


def verdict(now: float, beat_at: float, progress_at: float, busy: float, busy_since: float, slowest_step_s: float,
            calls: int, s: HealthSettings) -> Optional[str]:
    """Why the engine counts as lost at time `now` (None: it is fine), from what it last wrote."""
    silent = now - beat_at
    if silent > s.timeout_s:
        return (f"no heartbeat from the engine process for {silent:.0f} s (rollout.health.timeout_s={s.timeout_s:g}): "
                f"stopped or frozen")
    if busy == GENERATING:
        limit = stall_limit(slowest_step_s, calls, s)
        still = now - max(progress_at, busy_since)
        if still > limit:
            basis = (f"rollout.health.first_wait_s={s.first_wait_s:g}, in its first generation" if warming_up(
                slowest_step_s, calls) else
                     f"{s.stall_factor:g} x its slowest step of {slowest_step_s:.2f} s, at least "
                     f"rollout.health.stall_floor_s={s.stall_floor_s:g}")
            return f"no decode step for {still:.0f} s while generating (stall limit {limit:.0f} s: {basis}): hung"
    if busy == CALL and s.call_timeout_s is not None and now - busy_since > s.call_timeout_s:
        return (f"one engine call has run for {now - busy_since:.0f} s (rollout.health.call_timeout_s="
                f"{s.call_timeout_s:g}): hung")
    return None


class EngineHealth:
    """The shared record of one engine process: made by the trainer (`EngineHealth(ctx)`), handed to the child, which
    calls `start_beating`, `busy`, `progress` and `idle`; the trainer calls `check`."""

    def __init__(self, ctx, settings: HealthSettings):
        self.settings = settings
        self._delay_s = 0.0  # the slow-engine test hook's, read in the engine process (start_beating)
        self._shared = ctx.Array("d", 7, lock=False)  # single-slot writes of doubles need no lock
        self._shared[_BEAT] = time.monotonic()  # the start counts as a beat: start-up has its own timeout

    # -- the engine process's side -------------------------------------------------------------------------------------
    def start_beating(self) -> None:
        self._delay_s = float(os.environ.get("MEGARL_TEST_ENGINE_STEP_DELAY_S", 0) or 0)

        def beat():
            while True:
                self._shared[_BEAT] = time.monotonic()
                time.sleep(self.settings.interval_s)

        threading.Thread(target=beat, name="engine-heartbeat", daemon=True).start()

    def busy(self, method: str) -> None:
        a = self._shared
        a[_SINCE] = time.monotonic()
        a[_BUSY] = GENERATING if method in GENERATION_CALLS else CALL

    def idle(self) -> None:
        a = self._shared
        if a[_BUSY] == GENERATING:
            a[_CALLS] += 1
        a[_BUSY] = IDLE

    def progress(self) -> None:
        """One engine step taken (called by the engines' step loops)."""
        a = self._shared
        now = time.monotonic()
        if a[_CALLS] >= 1 and a[_PROGRESS] >= a[_SINCE]:  # since the call's previous step: the decode rate
            a[_SLOWEST] = max(a[_SLOWEST], now - a[_PROGRESS])
        a[_PROGRESS] = now
        fault, a[_FAULT] = a[_FAULT], 0.0
        if fault == _FAULTS["oom"]:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected into the engine's "
                                         "step by a megarl test hook)")
        while fault == _FAULTS["hang"]:  # the process stays alive and beating, the generation never ends
            time.sleep(3600)
        if self._delay_s:
            time.sleep(self._delay_s)

    def inject(self, kind: str) -> None:
        self._shared[_FAULT] = _FAULTS[kind]

    # -- the trainer's side ------------------------------------------------------------------------------------------
    def check(self, now: Optional[float] = None) -> Optional[str]:
        a = self._shared
        return verdict(time.monotonic() if now is None else now, a[_BEAT], a[_PROGRESS], a[_BUSY], a[_SINCE],
                       a[_SLOWEST], int(a[_CALLS]), self.settings)

    @property
    def slowest_step_s(self) -> float:
        return float(self._shared[_SLOWEST])
