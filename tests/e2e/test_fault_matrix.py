"""Fault matrix: whatever goes wrong in a run, `megarl train` ends within 60 s, non-zero, names the cause, and leaves no
process behind (each process the run started is found by an environment marker and checked by pid: the ranks, the
vLLM engine child, the reward workers). Signals: SIGTERM saves and exits 0 (then the resume is exact), a second SIGINT
ends the run at once.

Every case runs the real CLI on the tiny recipe's small settings (world 1, or TP2 on two local ranks). Faults on a
rank come from the test hook MEGARL_TEST_RAISE_AT_STEP (see megarl.checkpoint.state); the others are real: a reward
file that raises, `kill -9` of a process, signals to the run's process group as a scheduler or a terminal sends them.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megarl.checkpoint.locate import complete_checkpoints
from tests.e2e.test_checkpoint_resume import _assert_same_steps
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE, SMALL

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60  # from the fault to the end of every process
MARKER = "MEGARL_TEST_FAULT_MARKER"
TP2 = ["trainer.n_gpus_per_node=2", "parallelism.tensor_model_parallel_size=2"]
RAISING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("the reward file's own error")
"""
# 32 samples over 4 workers: about 2 s of scoring per step, so that a signal sent after step 1 lands inside step 2
SLOW_REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.25)
    return float(len(solution_str.split()) % 2)
"""

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the run's processes through /proc")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


class Run:
    """`megarl train` in a session of its own (so that a signal can go to its whole process group, as a scheduler or
    a terminal sends it), with a marker in its environment that every process it starts inherits."""

    def __init__(self, tmp: Path, name: str, overrides=(), reward: str = PARITY_REWARD, env=None):
        self.run_dir = tmp / name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        reward_file = self.run_dir / "reward.py"
        reward_file.write_text(reward)
        self.marker = uuid.uuid4().hex
        self.log = self.run_dir / "console.log"
        args = [*SMALL, f"trainer.run_dir={self.run_dir}", f"model.path={tmp / 'model'}",
                f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward_file}", *overrides]
        full_env = {**os.environ, **(env or {}), MARKER: self.marker}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", str(RECIPE), *args],
                                         env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def steps_logged(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_step(self, step: int, timeout: float = 300, may_end: bool = False) -> None:
        """Until `step` is logged; with may_end, also until the run ends (a fault injected at that step may stop
        rank 0 before it logs the step)."""
        deadline = time.monotonic() + timeout
        while step not in self.steps_logged():
            if may_end and self.proc.poll() is not None:
                return
            assert self.proc.poll() is None, f"the run ended early ({self.proc.returncode}):\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"step {step} not reached in {timeout} s:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process carrying this run's marker (zombies excluded)."""
        found = {}
        needle = f"{MARKER}={self.marker}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle in (entry / "environ").read_bytes() and b"\tZ" not in _status_state(entry):
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
        return found

    def engine_pid(self) -> int:
        """The vLLM engine child: the spawned multiprocessing child of the rank that hosts it whose output goes to the
        engine's log (the rank spawns another child once it has saved a checkpoint: the writer's queue server)."""
        engines = [pid for pid, cmd in self.processes().items() if "spawn_main" in cmd and _parent_is_marked(pid, self)
                   and "vllm-engine" in _output_file(pid)]
        assert len(engines) == 1, self.processes()
        return engines[0]

    def rank_pid(self, rank: int) -> int:
        ranks = [pid for pid, cmd in self.processes().items()
                 if "megarl.launch_local" in cmd and _env(pid).get("RANK") == str(rank)]
        assert len(ranks) == 1, self.processes()
        return ranks[0]

    def finish(self, since: float, limit: float = DEADLINE_S) -> tuple[int, float]:
        """Wait for the run to end; return (exit code, seconds since `since`) once no marked process is left."""
        try:
            code = self.proc.wait(timeout=max(1.0, since + limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"the run was still going {limit} s after the fault:\n{self.output()[-4000:]}")
        while self.processes() and time.monotonic() < since + limit:
            time.sleep(0.2)
        left = self.processes()
        elapsed = time.monotonic() - since
        for pid in left:  # leave the machine clean for the next test before failing
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left {elapsed:.0f} s after the fault: {left}"
        return code, elapsed


def _status_state(entry: Path) -> bytes:
    for line in (entry / "status").read_bytes().splitlines():
        if line.startswith(b"State:"):
            return line
    return b""


def _env(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def _output_file(pid: int) -> str:
    """Where the process's stdout goes ("" when it cannot be read)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def _parent_is_marked(pid: int, run: Run) -> bool:
    import psutil

    try:
        return psutil.Process(pid).ppid() in run.processes()
    except psutil.NoSuchProcess:
        return False


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_reward_function_that_raises(tmp):
    run = Run(tmp, "reward-raises", reward=RAISING_REWARD)
    code, elapsed = run.finish(since=time.monotonic(), limit=300)  # the fault comes at step 1, after start-up
    out = run.output()
    assert code != 0
    assert "the reward file's own error" in out and "ZeroDivisionError" in out
    assert out.count("ZeroDivisionError: the reward file's own error") == 1, out[-3000:]  # printed once
    assert run.steps_logged() == []


@pytest.mark.slow  # ~23 s; engine deaths under the default (restart): tests/e2e/test_engine_restart.py
def test_kill_9_of_the_engine_child(tmp):
    run = Run(tmp, "kill-engine", ["trainer.total_steps=50", "rollout.on_engine_failure=fail"])
    run.wait_for_step(1)
    os.kill(run.engine_pid(), signal.SIGKILL)
    code, elapsed = run.finish(since=time.monotonic())
    assert code != 0
    assert "vLLM engine process died" in run.output(), run.output()[-3000:]
    print(f"kill -9 of the engine: exit {code} after {elapsed:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_exception_at_step_1_on_one_rank_at_tp2(tmp, rank):
    run = Run(tmp, f"raise-rank{rank}", [*TP2, "trainer.total_steps=50"],
              env={"MEGARL_TEST_RAISE_AT_STEP": f"1:{rank}"})
    run.wait_for_step(1, may_end=True)
    code, elapsed = run.finish(since=time.monotonic())
    out = run.output()
    assert code != 0
    cause = f"injected fault at step 1 on rank {rank}"
    assert cause in out, out[-4000:]
    # the root cause comes first: the failure report starts with the failing rank, the other one follows it
    report = out[out.index("ranks of megarl.trainer:train_entry failed"):]
    assert report.index(f"--- rank {rank} exited with 1") < report.index(f"--- rank {1 - rank} exited with")
    print(f"exception on rank {rank}: exit {code} after {elapsed:.1f} s")


@pytest.mark.slow
def test_kill_9_of_one_trainer_rank_at_tp2(tmp):
    run = Run(tmp, "kill-rank", [*TP2, "trainer.total_steps=50"])
    run.wait_for_step(1)
    os.kill(run.rank_pid(1), signal.SIGKILL)
    code, elapsed = run.finish(since=time.monotonic())
    assert code != 0
    assert "--- rank 1 exited with -9" in run.output(), run.output()[-4000:]
    print(f"kill -9 of rank 1: exit {code} after {elapsed:.1f} s")


@pytest.mark.slow
def test_sigterm_at_step_2_saves_exits_0_and_resumes_exactly(tmp):
    total = 5
    straight = Run(tmp, "straight", [f"trainer.total_steps={total}"], reward=SLOW_REWARD)
    code, _ = straight.finish(since=time.monotonic(), limit=600)
    assert code == 0, straight.output()[-3000:]
    run = Run(tmp, "sigterm", [f"trainer.total_steps={total}"], reward=SLOW_REWARD)
    run.wait_for_step(1)
    os.killpg(run.proc.pid, signal.SIGTERM)  # a scheduler's preemption: every process of the job gets it
    code, elapsed = run.finish(since=time.monotonic(), limit=180)  # it finishes the step and saves first
    assert code == 0, run.output()[-3000:]
    stopped = run.steps_logged()[-1]
    assert 2 <= stopped < total, run.steps_logged()
    assert [s for s, _ in complete_checkpoints(run.run_dir / "checkpoints")] == [stopped]
    print(f"SIGTERM after step 1: saved step {stopped}, exit 0 after {elapsed:.1f} s")

    resumed = Run(tmp, "sigterm", [f"trainer.total_steps={total}"], reward=SLOW_REWARD)
    code, _ = resumed.finish(since=time.monotonic(), limit=600)
    assert code == 0, resumed.output()[-3000:]
    assert "resumed from" in resumed.output()
    _assert_same_steps(_metrics(run.run_dir), _metrics(straight.run_dir), range(1, total + 1))


@pytest.mark.slow
def test_a_second_sigint_stops_at_once(tmp):
    run = Run(tmp, "sigint", ["trainer.total_steps=50"], reward=SLOW_REWARD)
    run.wait_for_step(1)
    os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground process group
    time.sleep(0.5)
    os.killpg(run.proc.pid, signal.SIGINT)
    code, elapsed = run.finish(since=time.monotonic(), limit=15)
    assert code == 128 + signal.SIGINT, run.output()[-3000:]
    assert "SIGINT received (a second signal): stopping now" in run.output()
    print(f"second SIGINT: exit {code} after {elapsed:.1f} s")


@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_rank_or_engine(tmp):
    """`megarl train` itself SIGKILLed (no chance to clean up): its ranks, and rank 0's engine, die with it."""
    run = Run(tmp, "kill-launcher", [*TP2, "trainer.total_steps=50"])
    run.wait_for_step(1)
    children = run.processes()
    assert len(children) >= 3, children  # two ranks and the engine at least
    os.kill(run.proc.pid, signal.SIGKILL)
    code, elapsed = run.finish(since=time.monotonic())
    assert code == -signal.SIGKILL
    print(f"kill -9 of the launcher: {len(children) - 1} processes gone after {elapsed:.1f} s")
