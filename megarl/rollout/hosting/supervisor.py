"""One engine replica watched, and replaced when it is lost (rollout.on_engine_failure: restart).

An engine process that dies (killed, crashed: its pipe closes) or hangs (no reply to a call within
rollout.engine_timeout_s) raises EngineDied from whatever call met it. The supervisor stands where the engine stood
(the same methods, by delegation) and turns that into `EngineLost` with the cause; the caller (megarl.steps'
EngineGeneration, in sync mode) then has every rank agree, calls `restart` on the replica's owner, re-plans and runs
the weight sync into the new engine (the normal path, checksummed as usual), and generates the step's batch again
with the same prompts and seeds: the batch is the one an undisturbed run would have sampled with these weights.

An engine lost during a weight update does not stop the update midway: the trainer ranks are inside collectives
(gathers, barriers) that the engine's owner must finish with them. The update calls of a lost engine return at once
(`UPDATE_CALLS`), the loss is kept in `lost_in_update`, and after the update every rank learns of it and the replica
is restarted and synced again the same way (megarl.steps' EngineGeneration.sync).

Restarts are bounded: at most `max_restarts` within any `window_s` seconds; past that the run stops as it did before
(cleanly, and it resumes exactly from its last checkpoint). Each restart is logged on the console with its cause and
counted (`rollout/engine_restarts`).

Test hooks: MEGARL_TEST_KILL_ENGINE_AT_GENERATION=k[,k2,...] kills the engine process (SIGKILL) right after the k-th
generation call was sent to it (counted over the run and its restarts; validation rounds count too), as a machine
losing it mid-rollout would; MEGARL_TEST_KILL_ENGINE_AT_UPDATE=k[,...] right after the k-th weight update began (the
run's first sync is update 1).
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import time
from typing import Any, Callable, Optional

from megarl import lifecycle

log = logging.getLogger("megarl")

KILL_AT_GENERATION = "MEGARL_TEST_KILL_ENGINE_AT_GENERATION"
KILL_AT_UPDATE = "MEGARL_TEST_KILL_ENGINE_AT_UPDATE"

# the engine calls of a weight update, each with what it returns once the engine is lost: the owner rank goes on
# through the update's collectives with the other ranks, and the sync is repeated into the restarted engine
UPDATE_CALLS = {"begin_update": None, "load_bucket": None, "end_update": {}, "abort_update": None,
                "load_adapter": {}, "wake_up": None}


def engine_failure_policy(cfg) -> str:
    """"restart" or "fail": rollout.on_engine_failure, or by default restart where it is supported (trainer.mode
    sync, engine processes the trainer starts) and fail elsewhere."""
    r = cfg.rollout
    if r.on_engine_failure is not None:
        return r.on_engine_failure
    return "restart" if restart_refusal(cfg) is None else "fail"


def restart_refusal(cfg) -> Optional[str]:
    """Why engine restarts cannot serve this recipe (None: they can)."""
    if cfg.trainer.mode != "sync":
        return (f"trainer.mode={cfg.trainer.mode} generates batches ahead with older weights; a restarted engine "
                f"gets the current ones, so the batch would not be the one the schedule recorded")
    if cfg.rollout.mode == "ray":
        return "Ray-hosted engines are not restarted yet"
    return None


class EngineLost(RuntimeError):
    """The engine replica was lost during a call; its message is the cause ("during generation (...)")."""


class EngineRestartsExhausted(RuntimeError, lifecycle.Explained):
    """More restarts than rollout.max_engine_restarts allows within the window: the run stops."""


class EngineSupervisor:
    """An engine handle (EngineProcess) that can be replaced: `start()` makes a new one with the run's settings."""

    def __init__(self, start: Callable[[], Any], max_restarts: int, window_s: float, name: str = "engine"):
        self._start, self.max_restarts, self.window_s, self.name = start, max_restarts, window_s, name
        self.engine = start()
        self.restart_times: list[float] = []
        self.generations = 0
        self.updates = 0
        self.lost_in_update: Optional[str] = None  # the cause, when the engine was lost during the current update
        self._version_base = 0  # weight versions before the last restart: the count continues over restarts

    # -- the calls a lost engine can break, as EngineLost ---------------------------------------------------------
    def start_generate(self, prompt_token_ids, **kwargs):
        from megarl.rollout.protocol import Deferred

        handle = self._guard(lambda: self.engine.start_generate(prompt_token_ids, **kwargs))
        self._maybe_kill_for_test()
        return Deferred(lambda: self._guard(handle.result))

    def generate(self, prompt_token_ids, **kwargs):
        return self.start_generate(prompt_token_ids, **kwargs).result()

    def rollout_agents(self, prompt_token_ids, **kwargs):
        self.generations += 1
        return self._guard(lambda: self.engine.rollout_agents(prompt_token_ids, **kwargs))

    def _guard(self, call: Callable[[], Any]) -> Any:
        from megarl.rollout.hosting.process import EngineDied

        try:
            return call()
        except EngineDied as exc:
            raise EngineLost(f"during generation ({exc})") from exc

    def _maybe_kill_for_test(self) -> None:
        self.generations += 1
        self._kill_for_test_at(KILL_AT_GENERATION, self.generations)

    def _kill_for_test_at(self, hook: str, count: int) -> None:
        if str(count) in os.environ.get(hook, "").split(",") and self.engine.pid:
            os.kill(self.engine.pid, signal.SIGKILL)

    def _update_call(self, name: str, *args, **kwargs) -> Any:
        """One call of a weight update; after the engine was lost (now or earlier in this update) it returns at once
        with UPDATE_CALLS' value and the cause is kept in `lost_in_update`."""
        from megarl.rollout.hosting.process import EngineDied

        if name == "begin_update":
            self.lost_in_update = None
        if self.lost_in_update is None:
            try:
                out = getattr(self.engine, name)(*args, **kwargs)
            except EngineDied as exc:
                self.lost_in_update = f"during a weight update ({exc})"
            else:
                if name == "begin_update":
                    self.updates += 1
                    self._kill_for_test_at(KILL_AT_UPDATE, self.updates)
                return out
        value = UPDATE_CALLS[name]
        return dict(value) if isinstance(value, dict) else value  # a fresh dict: callers may add to it

    # -- replacement ---------------------------------------------------------------------------------------------
    def restart(self, cause: str) -> None:
        """Replace the lost engine (its process tree killed first, nothing left behind) by a new one with the run's
        settings; its weights are the checkpoint's until the caller syncs the actor's into it."""
        now = time.monotonic()
        recent = [t for t in self.restart_times if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            raise EngineRestartsExhausted(
                f"the {self.name} was lost again {cause} after {len(recent)} restarts within "
                f"{self.window_s:.0f} s (rollout.max_engine_restarts={self.max_restarts}): stopping; resume from the "
                f"last checkpoint with checkpoint.resume=auto")
        self.restart_times = recent + [now]
        log.warning("%s lost %s: restarting it (restart %d of at most %d within %.0f s)", self.name, cause,
                    len(self.restart_times), self.max_restarts, self.window_s)
        self._version_base += self._last_version()
        self.lost_in_update = None
        old, self.engine = self.engine, None
        if old.pid:
            lifecycle.kill_tree(old.pid)
        self.engine = self._start()

    def _last_version(self) -> int:
        """The lost engine's weight version, 0 where it cannot say any more (its process is gone)."""
        try:
            return int(self.engine.weight_version)
        except Exception:  # noqa: BLE001 - a dead engine cannot answer
            return 0

    @property
    def restarts(self) -> int:
        return len(self.restart_times)

    @property
    def weight_version(self) -> int:
        return self._version_base + int(self.engine.weight_version)

    def shutdown(self, timeout_s: float = 30) -> None:
        if self.engine is not None:
            self.engine.shutdown(timeout_s=timeout_s)

    def __getattr__(self, name: str) -> Any:
        # everything else is the engine's own (its sync seam, sleep/wake, abort, layouts, ...)
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        if name in UPDATE_CALLS:
            getattr(engine, name)  # an engine without the call says so, as it would unsupervised
            return functools.partial(self._update_call, name)
        return getattr(engine, name)
