"""The engine watchdog (megarl.rollout.health), the restart bounds and the curable-error rule
(megarl.rollout.hosting.supervisor, .process), on hand-derived cases."""
import multiprocessing as mp

import pytest
import torch

from megarl.rollout.health import CALL, GENERATING, IDLE, EngineHealth, HealthSettings, stall_limit, verdict
from megarl.rollout.hosting.process import curable
from megarl.rollout.hosting.supervisor import EngineRestartsExhausted, RestartBudget, hook_hits

S = HealthSettings(interval_s=1.0, timeout_s=30.0, first_wait_s=300.0, stall_floor_s=30.0, stall_factor=20.0,
                   call_timeout_s=1800.0)


def test_the_stall_limit_is_the_first_wait_then_the_factor_times_the_slowest_step_with_a_floor():
    assert stall_limit(0.0, 0, S) == 300.0  # the first generation call: the engine's warm-up
    assert stall_limit(0.0, 1, S) == 300.0  # no step measured since
    assert stall_limit(0.05, 1, S) == 30.0  # 20 x 0.05 = 1 s: the floor
    assert stall_limit(2.5, 3, S) == 50.0  # 20 x 2.5


def test_the_verdict_names_each_kind_of_loss_and_nothing_else():
    t = 1000.0
    # a generation 40 s without a step, after steps of at most 0.1 s: over the 30 s floor
    assert "no decode step for 40 s" in verdict(t, t - 0.5, t - 40, GENERATING, t - 60, 0.1, 50, S)
    assert verdict(t, t - 0.5, t - 20, GENERATING, t - 60, 0.1, 50, S) is None
    # steps of 2.5 s: the limit is 50 s, so 40 s is still fine
    assert verdict(t, t - 0.5, t - 40, GENERATING, t - 60, 2.5, 50, S) is None
    # the call began after the last step: its own start counts, not the old step
    assert verdict(t, t - 0.5, t - 500, GENERATING, t - 10, 0.1, 50, S) is None
    # in the first generation call, first_wait_s
    assert verdict(t, t - 0.5, 0.0, GENERATING, t - 299, 0.0, 0, S) is None
    assert "first_wait_s=300" in verdict(t, t - 0.5, 0.0, GENERATING, t - 301, 0.0, 0, S)
    # no heartbeat: stopped, whatever it does
    for busy in (IDLE, GENERATING, CALL):
        assert "no heartbeat" in verdict(t, t - 31, t - 1, busy, t - 1, 0.1, 50, S)
    # an idle engine that beats is fine however long ago it last stepped
    assert verdict(t, t - 0.5, t - 10_000, IDLE, t - 10_000, 0.1, 50, S) is None
    # another call: only its own limit
    assert verdict(t, t - 0.5, t - 10_000, CALL, t - 1799, 0.1, 50, S) is None
    assert "call_timeout_s=1800" in verdict(t, t - 0.5, t - 10_000, CALL, t - 1801, 0.1, 50, S)
    no_cap = HealthSettings(call_timeout_s=None)
    assert verdict(t, t - 0.5, 0.0, CALL, 0.0, 0.1, 50, no_cap) is None


def test_the_shared_record_measures_the_slowest_step_within_a_call_and_injects_faults():
    import time

    h = EngineHealth(mp.get_context("spawn"), S)
    h.busy("generate")  # the first generation call: its steps are the warm-up, not counted
    h.progress()
    time.sleep(0.05)
    h.progress()
    assert h.slowest_step_s == 0.0
    h.idle()
    h.busy("generate")
    h.progress()  # the first step of the call: no step of this call before it to measure against
    assert h.slowest_step_s == 0.0
    time.sleep(0.05)
    h.progress()
    assert 0.04 <= h.slowest_step_s < 1.0
    assert h.check() is None
    h.idle()
    h.inject("oom")
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        h.progress()
    h.progress()  # a fault fires once


def test_curable_errors_are_the_engines_own_state_not_the_callers_request():
    assert curable(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert curable(RuntimeError("CUDA error: an illegal memory access was encountered"))
    try:
        try:
            raise RuntimeError("Worker proc VllmWorker-1 died unexpectedly, shutting down executor.")
        except RuntimeError as inner:
            raise ValueError("generate failed") from inner
    except ValueError as outer:
        assert curable(outer)  # the cause decides
    assert not curable(ValueError("prompt_index has 3 entries for 4 prompts"))
    assert not curable(TypeError("generate() got an unexpected keyword argument 'foo'"))


def test_the_restart_budget_bounds_the_window_and_the_run():
    b = RestartBudget(max_restarts=2, window_s=100.0, max_per_run=3)
    b.take("x", now=0.0)
    b.take("x", now=10.0)
    with pytest.raises(EngineRestartsExhausted, match="rollout.max_engine_restarts=2"):
        b.take("x", now=50.0)  # 3 within 100 s
    b.take("x", now=200.0)  # the window has moved on
    with pytest.raises(EngineRestartsExhausted, match="rollout.max_engine_restarts_per_run=3"):
        b.take("x", now=500.0)  # the run's fourth
    assert len(b) == 3


def test_test_hooks_name_a_call_and_optionally_a_replica(monkeypatch):
    monkeypatch.setenv("MEGARL_T", "2, 5@1")
    assert hook_hits("MEGARL_T", 2, 0) and hook_hits("MEGARL_T", 2, 1)
    assert hook_hits("MEGARL_T", 5, 1) and not hook_hits("MEGARL_T", 5, 0)
    assert not hook_hits("MEGARL_T", 3, 0) and not hook_hits("MEGARL_UNSET", 1, 0)
