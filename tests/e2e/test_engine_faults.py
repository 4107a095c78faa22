"""The engine fault matrix: a fault x where the engines run x trainer.mode x engine replicas, each cell the real CLI on
the tiny recipe's small settings with a fault injected into an engine's third generation call (step 3's batch in
sync mode; the watchdog has measured the engine's decode rate in the second: the first is its warm-up)
(megarl.rollout.hosting.supervisor's test hooks):

    kill   SIGKILL of the engine process (a lost machine)
    stop   SIGSTOP (alive, silent: the watchdog's heartbeat limit)
    oom    an OOM raised inside the engine's step (an error a restart cures)
    hang   the engine's step never returns while its process beats (the stall limit; rollout.engine_timeout_s unset)
    update SIGKILL right after the engine's second weight update began (placed apart: inside a transfer, with the
           bf16 engine's delta updates: the new engine gets a whole update, the other replica keeps its deltas)

Placements: colocated engine processes, engines placed apart (rollout.placement=separate), and Ray-hosted engines
(rollout.mode=ray, a local Ray instance; sync mode only, as validate allows). With two replicas the fault hits
replica 1 only (Ray: the actor of replica 1). Every cell must finish all its steps with no process left, the
restart named on the console and counted; in sync mode with the same metrics (so the same weights) and weight
versions as an undisturbed run, with two replicas keeping replica 0's share; in the async modes within the staleness
bound. Each cell prints its row of the matrix (FAULT-MATRIX | ...), which `pytest -s` shows.

The watchdog's limits are lowered (a 3 s stall floor, an 8 s heartbeat limit) so that a hang costs seconds here; the
defaults are for real engines (megarl.config.schema.EngineHealthConfig).
"""
import json
import os
import time

import pytest

from tests.e2e.test_checkpoint_resume import _assert_same_steps
from tests.e2e.test_fault_matrix import Run

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the run's processes through /proc")

STEPS = 3
HOOKS = {"kill": "MEGARL_TEST_KILL_ENGINE_AT_GENERATION", "stop": "MEGARL_TEST_STOP_ENGINE_AT_GENERATION",
         "oom": "MEGARL_TEST_OOM_ENGINE_AT_GENERATION", "hang": "MEGARL_TEST_HANG_ENGINE_AT_GENERATION",
         "update": "MEGARL_TEST_KILL_ENGINE_AT_UPDATE"}
WATCHDOG = ["rollout.health.stall_floor_s=3", "rollout.health.timeout_s=8", "rollout.health.interval_s=0.5"]
PLACEMENTS = {"colocated": [], "separate": ["rollout.placement=separate"], "ray": ["rollout.mode=ray"]}
MODES = {"sync": [], "one_step_off": ["trainer.mode=one_step_off_policy"], "async": ["trainer.mode=async"]}
# a stopped engine that was generating misses its steps before its heartbeats (the 3 s stall floor < the 8 s limit)
CAUSES = {"kill": ("engine process died", "Ray actor of replica"), "stop": ("no heartbeat", "no decode step for"),
          "oom": ("a restart cures: OutOfMemoryError",), "hang": ("no decode step for",),
          "update": ("during a weight transfer", "during a weight update")}
_refs: dict = {}


def _config(placement: str, mode: str, replicas: int, dtype: str = "auto") -> list:
    out = [f"trainer.total_steps={STEPS}", *WATCHDOG, *PLACEMENTS[placement], *MODES[mode], f"rollout.dtype={dtype}"]
    if replicas == 2:
        out += ["trainer.n_gpus_per_node=2", "rollout.data_parallel_size=2"]
    return out


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]


def _reference(tmp, placement: str, mode: str, replicas: int, dtype: str) -> tuple:
    """The undisturbed run of a configuration (once per module): its metrics and seconds."""
    key = (placement, mode, replicas, dtype)
    if key not in _refs:
        t0 = time.monotonic()
        run = Run(tmp, f"ref-{placement}-{mode}-{replicas}-{dtype}", _config(placement, mode, replicas, dtype))
        code, _ = run.finish(since=t0, limit=600)
        assert code == 0, run.output()[-3000:]
        _refs[key] = (_rows(run), time.monotonic() - t0)
    return _refs[key]


def cell(tmp, fault: str, placement: str, mode: str, replicas: int) -> dict:
    """Run one cell and check it against the undisturbed run of its configuration; returns its row of the matrix."""
    dtype = "bfloat16" if fault == "update" else "auto"  # a bf16 engine placed apart takes delta updates
    ref, ref_s = _reference(tmp, placement, mode, replicas, dtype)
    k = "2" if fault == "update" else "3"  # update 2 is step 2's sync: step 3 then trains on the restarted engine
    hit = f"{k}@1" if replicas == 2 else k
    t0 = time.monotonic()
    run = Run(tmp, f"{fault}-{placement}-{mode}-{replicas}", _config(placement, mode, replicas, dtype),
              env={HOOKS[fault]: hit})
    code, _ = run.finish(since=t0, limit=600)  # asserts that no process of the run is left
    seconds = time.monotonic() - t0
    out = run.output()
    assert code == 0, out[-4000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), out[-3000:]
    assert out.count("restarting it (restart") == 1, out[-3000:]
    assert any(cause in out for cause in CAUSES[fault]), out[-3000:]
    restarts = max(r.get("rollout/engine_restarts", 0) for r in rows)
    assert restarts == 1, rows
    redone = max(r.get("rollout/prompts_redone", 0) for r in rows)
    kept = max(r.get("rollout/prompts_kept_on_loss", 0) for r in rows)
    if fault == "update":  # lost in a sync: no generation was lost
        assert (redone, kept) == (0, 0), (redone, kept)
    elif replicas == 2:  # replica 1's half of the step's 8 prompts redone, replica 0's kept (Ray: actor 1's, actor 0's)
        assert (redone, kept) == (4, 4), (redone, kept)
    else:
        assert (redone, kept) == (8, 0), (redone, kept)
    if mode == "sync":
        # the same prompts, seeds and weights: every metric an undisturbed run logs, and its weight versions
        # the trainer's resident memory is the process's, not the run's; a restart adds a whole delivery (the
        # weight_sync/* figures of its step), after which the weights are the undisturbed run's
        ignore = ("rollout/engine_restarts", "rollout/prompts_redone", "rollout/prompts_kept_on_loss", "rss_bytes",
                  "weight_sync/")
        def kept(metrics: list) -> list:
            return [{k: v for k, v in r.items() if not any(i in k for i in ignore)} for r in metrics]

        _assert_same_steps(kept(rows), kept(ref), range(1, STEPS + 1))
        # the weight version is the trainer's: the step, on a restarted engine too (replica 0's is the one logged)
        assert [r["weight_sync/version"] for r in rows] == [r["weight_sync/version"] for r in ref] \
            == list(range(1, STEPS + 1))
    if mode != "sync":
        for r in rows:
            assert r["async/staleness_max"] <= 1, r  # both async settings here allow one version
    row = {"fault": fault, "placement": placement, "mode": mode, "replicas": replicas, "finished": code == 0,
           "steps": len(rows), "restarts": int(restarts), "seconds": round(seconds, 1),
           "seconds_lost": round(seconds - ref_s, 1), "processes_left": 0}
    print("FAULT-MATRIX | " + " | ".join(f"{k}={v}" for k, v in row.items()))
    return row


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-faults")


def test_a_hung_engine_is_found_by_its_stall_limit_and_replaced(tmp):
    """engine_timeout_s unset: the step that never returns is caught by the decode-rate stall limit."""
    cell(tmp, "hang", "colocated", "sync", 1)


def test_two_replicas_one_lost_the_other_keeps_its_samples(tmp):
    cell(tmp, "kill", "colocated", "sync", 2)


# the slow tier's cells: every fault, placement, mode and replica count at least once; MEGARL_FAULT_MATRIX=all runs
# every combination (58 cells: 48 with engine processes, 10 Ray-hosted in sync mode; about 50 minutes on 2 cores)
SLOW_CELLS = [("stop", "colocated", "sync", 1), ("oom", "colocated", "sync", 1), ("kill", "colocated", "one_step_off", 1),
              ("oom", "colocated", "async", 1), ("hang", "colocated", "async", 2), ("stop", "colocated", "one_step_off", 2),
              ("kill", "separate", "sync", 1), ("oom", "separate", "sync", 1), ("update", "separate", "sync", 1),
              ("update", "separate", "sync", 2),
              ("kill", "ray", "sync", 2), ("stop", "ray", "sync", 1), ("oom", "ray", "sync", 1), ("hang", "ray", "sync", 1),
              ("update", "ray", "sync", 2)]


# Ray-hosted engines generate in sync mode only (validate refuses the async modes with rollout.mode=ray)
ALL_CELLS = [(f, p, m, r) for p in PLACEMENTS for m in MODES for r in (1, 2) for f in HOOKS
             if (f != "update" or p == "ray") and (p != "ray" or m == "sync")]


@pytest.mark.slow
@pytest.mark.parametrize("fault,placement,mode,replicas",
                         ALL_CELLS if os.environ.get("MEGARL_FAULT_MATRIX") == "all" else SLOW_CELLS)
def test_fault_matrix_cell(tmp, fault, placement, mode, replicas):
    cell(tmp, fault, placement, mode, replicas)


@pytest.mark.slow
def test_a_lost_continuation_is_reissued_from_its_prefix(tmp):
    """async_training.partial_rollout=abort_resume: samples an abort cut short are continued from prompt + partial
    response; the engine is killed right after its first continuation was sent, and the restarted engine continues the
    same rows from their prefixes: every response still gets its full length, nothing is left aborted. Two batches
    ahead (max_staleness 2), responses of 256 tokens (ignore_eos) and an engine slowed to 20 ms a step (a 256-token
    generation then takes longer than the tiny model's update): a batch is still generating when the weights change,
    and the abort cuts it short."""
    overrides = ["trainer.total_steps=4", *WATCHDOG, "trainer.mode=async", "async_training.max_staleness=2",
                 "algorithm.rollout_correction.is_level=token", "async_training.partial_rollout=abort_resume",
                 "rollout.response_length=256", "rollout.ignore_eos=true"]
    t0 = time.monotonic()
    run = Run(tmp, "kill-continuation", overrides, env={"MEGARL_TEST_KILL_ENGINE_AT_CONTINUATION": "1",
                                                       "MEGARL_TEST_ENGINE_STEP_DELAY_S": "0.02"})
    code, _ = run.finish(since=t0, limit=900)  # asserts that no process of the run is left
    out = run.output()
    assert code == 0, out[-4000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], out[-3000:]
    assert any(r.get("async/resumed_samples", 0) > 0 for r in rows), \
        "no generation was cut short by an abort in this run, so no continuation was sent: nothing was tested"
    assert out.count("restarting it (restart") == 1 and "engine process died" in out, out[-3000:]
    assert max(r.get("rollout/engine_restarts", 0) for r in rows) == 1
    for r in rows:
        assert r["train/response_length_mean"] == 256 and r["rollout/num_aborted"] == 0, r
        assert r["async/staleness_max"] <= 2, r
    print(f"FAULT-MATRIX | fault=kill-continuation | placement=colocated | mode=async abort_resume | replicas=1 | "
          f"finished=True | steps={len(rows)} | restarts=1 | seconds={time.monotonic() - t0:.1f} | processes_left=0")
