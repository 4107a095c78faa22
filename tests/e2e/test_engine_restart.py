"""rollout.on_engine_failure=restart (the default in sync mode): a lost engine costs a restart, not the run
(megarl.rollout.hosting.supervisor). Each case runs the real CLI on the tiny recipe's small settings and checks that the
run ends normally with every step's batch complete (the same number of samples as an undisturbed step), the engine vs
actor logprob gap after the restart as small as before (the restarted engine got the actor's weights), the restart
named on the console and counted in the metrics, and no process left behind. A loss past rollout.max_engine_restarts
stops the run as before."""
import json
import os
import signal
import time

import pytest

from tests.e2e.test_checkpoint_resume import _assert_same_steps
from tests.e2e.test_fault_matrix import SLOW_REWARD, Run

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the run's processes through /proc")

SAMPLES = 8 * 4  # data.train_batch_size x rollout.n of the small settings
GAP = 1e-4  # the engine vs actor logprob gap bound the small loop's tests use (float32, same weights)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("restarts")


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_recovered(run, steps: int, restarts: int) -> None:
    code, _ = run.finish(since=time.monotonic(), limit=300)
    out = run.output()
    assert code == 0, out[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["rollout/num_samples"] == SAMPLES, r  # the step's batch is whole: no silent drop
        assert r["rollout/logprob_abs_diff_mean"] < GAP, r  # restarted engines sample from the actor's weights
    assert rows[-1]["rollout/engine_restarts"] == restarts
    assert out.count("restarting it (restart") == restarts, out[-3000:]


def test_engine_killed_during_generation_and_during_a_weight_update_is_restarted_each_time(tmp):
    """Two losses in one run, one in a generation call and one in a weight update (each would stop a run without
    restarts): each restarted engine is synced with the actor's weights, the lost batch generated again."""
    run = Run(tmp, "kill-mid-update-and-rollout", ["trainer.total_steps=3"],
              env={"MEGARL_TEST_KILL_ENGINE_AT_UPDATE": "2", "MEGARL_TEST_KILL_ENGINE_AT_GENERATION": "2"})
    _assert_recovered(run, 3, 2)
    out = run.output()
    assert "engine replica 0 lost during a weight update (the vLLM engine process died" in out, out[-3000:]
    assert "engine replica 0 lost during generation (the vLLM engine process died" in out, out[-3000:]


# The faults below are sent from outside once step 1 is logged. They must land while the run goes on, whatever the
# machine's speed: the small settings' steps take 0.1 s where the CPU is fast, and SLOW_REWARD's sleeps give each step
# 2 s of scoring (the engine idle meanwhile).


@pytest.mark.slow
def test_engine_killed_while_idle_is_restarted(tmp):
    run = Run(tmp, "kill-idle", ["trainer.total_steps=3"], reward=SLOW_REWARD)
    run.wait_for_step(1)
    os.kill(run.engine_pid(), signal.SIGKILL)
    _assert_recovered(run, 3, 1)


@pytest.mark.slow
def test_hung_engine_is_restarted_after_the_timeout(tmp):
    run = Run(tmp, "stopped", ["trainer.total_steps=3", "rollout.engine_timeout_s=20"], reward=SLOW_REWARD)
    run.wait_for_step(1)
    os.kill(run.engine_pid(), signal.SIGSTOP)  # alive, but answers nothing
    _assert_recovered(run, 3, 1)


@pytest.mark.slow
def test_a_loss_past_the_bound_stops_the_run_and_it_resumes_exactly(tmp):
    """Steps 1-3 as an undisturbed run's although step 2's batch was generated again by a restarted engine (the same
    prompts and seeds, the same weights); the second loss (step 4's rollout) stops the run without a traceback, and
    the resumed run's step 4 is the undisturbed run's."""
    every = ["trainer.total_steps=4", "checkpoint.save_freq=1"]
    straight = Run(tmp, "bound-straight", every)
    code, _ = straight.finish(since=time.monotonic(), limit=300)
    assert code == 0, straight.output()[-3000:]
    run = Run(tmp, "past-bound", [*every, "rollout.max_engine_restarts=1"],
              env={"MEGARL_TEST_KILL_ENGINE_AT_GENERATION": "2,5"})  # step 2's rollout, then step 4's (its 2nd: 3)
    code, _ = run.finish(since=time.monotonic(), limit=300)
    out = run.output()
    assert code != 0
    assert "after 1 restarts within" in out and "rollout.max_engine_restarts=1" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]  # a known cause, said in its message
    assert run.steps_logged() == [1, 2, 3]
    resumed = Run(tmp, "past-bound", every)
    code, _ = resumed.finish(since=time.monotonic(), limit=300)
    assert code == 0, resumed.output()[-3000:]
    assert "resumed from" in resumed.output()
    ref = [{k: v for k, v in m.items() if "engine_restarts" not in k} for m in _rows(straight)]
    _assert_same_steps(_rows(resumed), ref, range(1, 5))
