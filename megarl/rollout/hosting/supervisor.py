"""One engine replica watched, and replaced when it is lost (rollout.on_engine_failure: restart).

An engine is lost when its process dies (killed, crashed: its pipe closes), hangs or stops (the watchdog,
megarl.rollout.health, or rollout.engine_timeout_s), or a call fails inside it with an error a fresh engine does not
have (an OOM in the engine, a dead TP worker, a CUDA error: megarl.rollout.hosting.process.EngineCrashed). Whatever
call met the loss raises EngineDied; the supervisor stands where the engine stood (the same methods, by delegation)
and turns that into `EngineLost` with the cause. A failed call's other errors (a refused request, a configuration)
end the run as before.

The caller (megarl.steps' EngineGeneration) has every rank agree on which replicas were lost, calls `restart` on
their owners (the lost process tree is killed first; nothing is asked of it), delivers the actor's weights to the
restarted engines only, and generates again only the lost replicas' shares (the same prompts and seeds: the batch is
the one an undisturbed run would have sampled with these weights); the other replicas' samples are kept.

An engine lost during a weight update does not stop the update midway: the trainer ranks are inside collectives
(gathers, barriers) that the engine's owner must finish with them. The update calls of a lost engine return at once
(`UPDATE_CALLS`), the loss is kept in `lost_in_update`, and after the update every rank learns of it and the replica
is restarted and synced again the same way.

The weight version is the trainer's: `restart(cause, version)` sets the new engine's to the number of deliveries it
had received, and the resync makes it the current one. Handles of calls sent to an engine that was since replaced
raise EngineLost at once (`stale`), so a batch queued on the old engine is generated again without a second restart.

Restarts are bounded over all replicas (`RestartBudget`, kept by the caller on every rank alike): at most
rollout.max_engine_restarts within any rollout.engine_restart_window_s seconds and at most
rollout.max_engine_restarts_per_run in the run; past either the run stops (cleanly, and it resumes exactly from its
last checkpoint). Each restart is logged on the console with its cause and counted (`rollout/engine_restarts`).

Test hooks, each a list of k or k@r (the k-th call counted over the run and its restarts, validation rounds too; @r:
replica r only):
    MEGARL_TEST_KILL_ENGINE_AT_GENERATION  SIGKILL right after the k-th generation call was sent (a lost machine)
    MEGARL_TEST_STOP_ENGINE_AT_GENERATION  SIGSTOP right after it (alive, answers nothing: the heartbeat stops)
    MEGARL_TEST_OOM_ENGINE_AT_GENERATION   the engine's first step of that call raises an OOM (megarl.rollout.health)
    MEGARL_TEST_HANG_ENGINE_AT_GENERATION  the engine's first step of that call never returns (it still beats)
    MEGARL_TEST_KILL_ENGINE_AT_UPDATE      SIGKILL right after the k-th weight update began (the first sync is 1)
    MEGARL_TEST_KILL_ENGINE_AT_CONTINUATION  SIGKILL right after the k-th continuation was sent (async_training.
                                           partial_rollout=abort_resume: samples an abort cut short, re-issued from
                                           their prefix to the restarted engine)
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
STOP_AT_GENERATION = "MEGARL_TEST_STOP_ENGINE_AT_GENERATION"
OOM_AT_GENERATION = "MEGARL_TEST_OOM_ENGINE_AT_GENERATION"
HANG_AT_GENERATION = "MEGARL_TEST_HANG_ENGINE_AT_GENERATION"
KILL_AT_UPDATE = "MEGARL_TEST_KILL_ENGINE_AT_UPDATE"
KILL_AT_CONTINUATION = "MEGARL_TEST_KILL_ENGINE_AT_CONTINUATION"

# the engine calls of a weight update, each with what it returns once the engine is lost: the owner rank goes on
# through the update's collectives with the other ranks, and the sync is repeated into the restarted engine
UPDATE_CALLS = {"begin_update": None, "load_bucket": None, "end_update": {}, "abort_update": None,
                "load_adapter": {}, "wake_up": None}


def engine_failure_policy(cfg) -> str:
    """"restart" or "fail": rollout.on_engine_failure (restart by default: every placement and trainer mode)."""
    return cfg.rollout.on_engine_failure


def hook_hits(hook: str, count: int, replica: int) -> bool:
    """Whether test hook `hook` (a list of k or k@r) names call `count` of replica `replica`."""
    for item in os.environ.get(hook, "").split(","):
        k, _, r = item.strip().partition("@")
        if k and int(k) == count and (not r or int(r) == replica):
            return True
    return False


class EngineLost(RuntimeError):
    """The engine replica was lost during a call; its message is the cause ("during generation (...)"). `stale`: the
    call was made to an engine that has since been replaced (nothing is left to restart). `kept`: prompts of the call
    whose samples the replica still has (Ray-hosted replicas: the surviving actors' chunks), not generated again."""

    def __init__(self, message: str, stale: bool = False, kept: int = 0):
        super().__init__(message)
        self.stale, self.kept = stale, kept


class EngineRestartsExhausted(RuntimeError, lifecycle.Explained):
    """More restarts than rollout.max_engine_restarts allows within the window, or than
    rollout.max_engine_restarts_per_run in the run: the run stops."""


class RestartBudget:
    """The restart bounds: at most `max_restarts` within any `window_s` seconds, at most `max_per_run` (None: no
    limit) in the run."""

    def __init__(self, max_restarts: int, window_s: float, max_per_run: Optional[int] = None):
        self.max_restarts, self.window_s, self.max_per_run = max_restarts, window_s, max_per_run
        self.times: list[float] = []  # every restart of the run

    def take(self, what: str, now: Optional[float] = None) -> None:
        """Count one restart of `what`, or raise EngineRestartsExhausted if a bound forbids it."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self.times if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            raise EngineRestartsExhausted(
                f"{what} after {len(recent)} restarts within {self.window_s:.0f} s "
                f"(rollout.max_engine_restarts={self.max_restarts}): stopping; resume from the last checkpoint with "
                f"checkpoint.resume=auto")
        if self.max_per_run is not None and len(self.times) >= self.max_per_run:
            raise EngineRestartsExhausted(
                f"{what} after {len(self.times)} restarts in this run "
                f"(rollout.max_engine_restarts_per_run={self.max_per_run}): stopping; resume from the last checkpoint "
                f"with checkpoint.resume=auto")
        self.times.append(now)

    def __len__(self) -> int:
        return len(self.times)


class EngineSupervisor:
    """An engine handle (EngineProcess) that can be replaced: `start()` makes a new one with the run's settings."""

    def __init__(self, start: Callable[[], Any], name: str = "engine", replica: int = 0):
        self._start, self.name, self.replica = start, name, replica
        self.engine = start()
        self.incarnation = 0  # how many times the engine was replaced
        self.generations = 0
        self.continuations = 0
        self.updates = 0
        self.lost_in_update: Optional[str] = None  # the cause, when the engine was lost during the current update

    # -- the calls a lost engine can break, as EngineLost ---------------------------------------------------------
    def start_generate(self, prompt_token_ids, **kwargs):
        return self._start_call(lambda: self.engine.start_generate(prompt_token_ids, **kwargs))

    def start_continue(self, *args):
        handle = self._start_call(lambda: self.engine.start_continue(*args))
        self.continuations += 1
        if hook_hits(KILL_AT_CONTINUATION, self.continuations, self.replica) and self.engine.pid:
            os.kill(self.engine.pid, signal.SIGKILL)
        return handle

    def generate(self, prompt_token_ids, **kwargs):
        return self.start_generate(prompt_token_ids, **kwargs).result()

    def rollout_agents(self, prompt_token_ids, **kwargs):
        self._before_generation()
        return self._guard(lambda: self.engine.rollout_agents(prompt_token_ids, **kwargs))

    def _start_call(self, start: Callable[[], Any]):
        from megarl.rollout.protocol import Deferred

        self._before_generation()
        handle = self._guard(start)
        self._after_generation_sent()
        born = self.incarnation

        def wait():
            if self.incarnation != born:  # sent to an engine replaced since: its work is gone with it
                raise EngineLost("during generation (sent to an engine that was replaced since)", stale=True)
            return self._guard(handle.result)

        return Deferred(wait)

    def _guard(self, call: Callable[[], Any]) -> Any:
        from megarl.rollout.hosting.process import EngineDied

        try:
            return call()
        except EngineDied as exc:
            raise EngineLost(f"during generation ({exc})") from exc

    def _before_generation(self) -> None:
        """The watchdog's ping before new work, and the fault hooks that act inside the engine's next steps."""
        self.generations += 1
        check = getattr(self.engine, "check_health", None)
        if check is not None:
            self._guard(check)
        for hook, kind in ((OOM_AT_GENERATION, "oom"), (HANG_AT_GENERATION, "hang")):
            if hook_hits(hook, self.generations, self.replica):
                self.engine.inject_fault(kind)

    def _after_generation_sent(self) -> None:
        for hook, sig in ((KILL_AT_GENERATION, signal.SIGKILL), (STOP_AT_GENERATION, signal.SIGSTOP)):
            if hook_hits(hook, self.generations, self.replica) and self.engine.pid:
                os.kill(self.engine.pid, sig)

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
                    self._update_began()
                return out
        value = UPDATE_CALLS[name]
        return dict(value) if isinstance(value, dict) else value  # a fresh dict: callers may add to it

    def start_receive_weights(self, sync: int, verify: bool = False):
        """An update over the transfer group (engines placed apart): a lost host's error reaches the remote sync, which
        tells every trainer rank (megarl.sync.transports.remote.EngineHostLost); counted for the update kill hook."""
        pending = self.engine.start_receive_weights(sync, verify)
        self._update_began()
        return pending

    def _update_began(self) -> None:
        self.updates += 1
        if hook_hits(KILL_AT_UPDATE, self.updates, self.replica) and self.engine.pid:
            os.kill(self.engine.pid, signal.SIGKILL)

    # -- replacement ---------------------------------------------------------------------------------------------
    def kill(self) -> None:
        """Kill the lost engine's process tree; nothing is asked of it (a hung engine would cost another timeout, a
        dead one cannot answer). Its handles' calls fail as stale from now on."""
        old, self.engine = self.engine, None
        if old is not None and old.pid:
            lifecycle.kill_tree(old.pid)
        if old is not None:
            self.incarnation += 1
        self.lost_in_update = None

    def restart(self, version: int) -> None:
        """Replace the lost engine (killed first, if `kill` was not called yet) by a new one with the run's settings
        and the trainer's weight version `version` (the deliveries the lost one had received); its weights are the
        checkpoint's until the caller syncs the actor's into it."""
        self.kill()
        t0 = time.monotonic()
        self.engine = self._start()
        self.engine.set_weight_version(version)
        log.info("%s restarted in %.1f s; it gets the actor's weights next", self.name, time.monotonic() - t0)

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
