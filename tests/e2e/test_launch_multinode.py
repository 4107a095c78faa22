"""Two nodes on one machine, started by the launch scripts as on a cluster:

- launch/torchrun.sh twice (node 0 and node 1, 2 ranks each, joined by a c10d rendezvous on localhost) trains the tiny
  recipe at TP2xPP2 with the same losses as one launch of 4 ranks, and each colocated engine's start line names its
  node;
- launch/ray_node.sh twice (a Ray head and a worker, one CPU each) hosts the engines of a run that launch/torchrun.sh
  starts twice (node 0 and node 1, one rank each) with rollout.mode=ray and one engine replica per Ray node: the run
  finishes, names each replica's Ray node, and a second launch resumes it from its checkpoint.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from megarl.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "torchrun.sh"
RAY_SCRIPT = ROOT / "launch" / "ray_node.sh"
RAY = Path(sys.executable).parent / "ray"
RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"
TORCHRUN = Path(sys.executable).parent / "torchrun"
# the small overrides of test_grpo_loop.py, two steps
SMALL = ["sft.enable=false", "data.synthetic.num_train=64", "data.synthetic.num_val=8", "data.train_batch_size=8",
         "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
         "rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.total_steps=2", "trainer.test_freq=0",
         "trainer.val_before_train=false", "logging.tensorboard=false", "actor.optim.lr=1e-3",
         "parallelism.tensor_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2"]
# rewards that vary on a random model, so the updates are not zero (see test_grpo_loop.py)
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str.split()) % 2)
"""
TIMEOUT_S = 900

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bash") is None or not TORCHRUN.exists(), reason="needs bash, torchrun")]


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHRUN=str(TORCHRUN), PYTHONPATH=str(ROOT), MEGARL_COMMAND="train")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK",
                "NPROC_PER_NODE"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _overrides(tmp: Path, name: str) -> list[str]:
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    return SMALL + [f"trainer.run_dir={tmp / name}", f"model.path={tmp / 'model'}",
                    f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward}"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=TIMEOUT_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        tails = "\n".join(f"--- {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
                          for log in logs)
        pytest.fail(f"launch exited with {codes}\n{tails}")


def _launch(tmp: Path, name: str, node_rank: int, nnodes: int, nproc: int, port: int, extra=(), env=None,
            tag: str = "") -> tuple:
    log = tmp / f"{name}{tag}.node{node_rank}.log"
    env = _env(NNODES=nnodes, NODE_RANK=node_rank, NPROC_PER_NODE=nproc, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               LOCAL_ADDR="127.0.0.1", RDZV_ID=f"test-{name}{tag}", LOG_DIR=tmp / f"{name}{tag}_rank_logs",
               **(env or {}))
    out = open(log, "w")
    proc = subprocess.Popen(["bash", str(SCRIPT), str(RECIPE), *_overrides(tmp, name), *extra], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return proc, log


def test_two_node_launch_matches_one_node(tmp_path):
    one, one_log = _launch(tmp_path, "one_node", 0, 1, 4, free_port())
    _check([one], [one_log])
    ref = _metrics(tmp_path / "one_node")

    port = free_port()
    nodes = [_launch(tmp_path, "two_nodes", r, 2, 2, port) for r in range(2)]
    _check([p for p, _ in nodes], [log for _, log in nodes])
    got = _metrics(tmp_path / "two_nodes")

    assert [m["step"] for m in ref] == [m["step"] for m in got] == [1, 2]
    assert any(abs(m["actor/pg_loss"]) > 1e-4 for m in ref)  # non-trivial losses, not 0 == 0
    for a, b in zip(ref, got):
        assert a["train/reward_mean"] == b["train/reward_mean"]
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < 1e-5, (a["actor/pg_loss"], b["actor/pg_loss"])
        assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) < 1e-5 * max(1.0, a["actor/grad_norm"])
    # per-rank logs are written by torchrun for every local rank of every node
    for name in ("one_node", "two_nodes"):
        logs = list((tmp_path / f"{name}_rank_logs").rglob("stdout.log"))
        assert len(logs) == 4, logs
    # one engine replica per rank (engine TP1): replicas 0, 1 start on node 0's ranks, 2, 3 on node 1's, and each
    # start line says so (on CPU without GPUs, the node alone)
    engines = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "two_nodes" / "logs").glob("*engine*.log"))
    for replica in range(4):
        assert f"replica {replica}: node {replica // 2}, no GPU (CPU engine)" in engines, engines[-3000:]


def _ray_nodes(address: str, env: dict) -> list:
    """[(node id, is the head)] of the live nodes of the Ray cluster at address."""
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); print(json.dumps([[n['NodeID'], "
            "'node:__internal_head__' in n['Resources']] for n in ray.nodes() if n['Alive']]))" % address)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else []


def _stop(procs: list) -> None:
    for p in reversed(procs):  # SIGTERM: `ray start --block` stops its node's processes, then exits
        if p.poll() is None:
            p.terminate()
    for p in reversed(procs):
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextmanager
def _ray_cluster(tmp: Path):
    """A head and a worker started by launch/ray_node.sh on this machine, one CPU each (so Ray places one engine
    replica on each); yields (address, env for its drivers, [(node id, is the head)])."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    # Ray's token authentication is off for this test cluster, which lives as long as the test: a token file another
    # Ray cluster of this machine may have left in the home directory is not this cluster's
    env = _env(RAY_AUTH_MODE="disabled", RAY_BIN=RAY, NODE_IP="127.0.0.1", NUM_CPUS=1, RAY_PORT=port, RAY_HEAD=address)
    env.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="megarl-ray-")  # short: Ray's socket paths live under it (at most 107 characters)
    procs = []
    try:
        for role in ("head", "worker"):
            args = ["bash", str(RAY_SCRIPT), role] + ([f"--temp-dir={temp}"] if role == "head" else [])
            with open(tmp / f"ray-{role}.log", "w") as out:
                procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT))
            want = 1 if role == "head" else 2
            deadline = time.monotonic() + 180
            while len(nodes := _ray_nodes(address, env)) < want:
                assert time.monotonic() < deadline and procs[-1].poll() is None, \
                    (tmp / f"ray-{role}.log").read_text()[-3000:]
                time.sleep(2)
        yield address, env, nodes
    finally:
        _stop(procs)
        shutil.rmtree(temp, ignore_errors=True)


def _launch_two_nodes(tmp: Path, name: str, extra: list, env: dict, tag: str) -> str:
    """launch/torchrun.sh as node 0 and node 1 (one rank each); both must exit 0. Returns every log's text."""
    port = free_port()
    nodes = [_launch(tmp, name, r, 2, 1, port, extra, env, tag) for r in range(2)]
    _check([p for p, _ in nodes], [log for _, log in nodes])
    # the launchers' output, torchrun's per-rank logs and the run's own (megarl's rank logs in <run_dir>/logs)
    logs = [log for _, log in nodes] + sorted((tmp / f"{name}{tag}_rank_logs").rglob("*.log")) \
        + sorted((tmp / name / "logs").glob("*.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


RAY_LINE = re.compile(r"Ray rollout engine replica (\d+): Ray node \S+ \(id ([0-9a-f]{8})\), no GPU \(CPU engine\)")


def test_two_nodes_with_a_two_node_ray_cluster_finish_and_resume(tmp_path):
    with _ray_cluster(tmp_path) as (address, ray_env, ray_nodes):
        assert sorted(head for _, head in ray_nodes) == [False, True]
        env = {"RAY_ADDRESS": address, "RAY_AUTH_MODE": ray_env["RAY_AUTH_MODE"]}
        # one trainer rank per node (DP2: SMALL's TP2 x PP2 undone), two engine replicas hosted by Ray
        ray = ["parallelism.tensor_model_parallel_size=1", "parallelism.pipeline_model_parallel_size=1",
               "rollout.mode=ray", "rollout.data_parallel_size=2"]
        first = _launch_two_nodes(tmp_path, "ray", ray, env, "")
        run_dir = tmp_path / "ray"
        assert [m["step"] for m in _metrics(run_dir)] == [1, 2]
        assert (run_dir / "checkpoints" / "step_2" / "meta.json").exists()
        # one replica on each Ray node, each named with its node
        placed = dict(RAY_LINE.findall(first))
        assert sorted(placed) == ["0", "1"], first[-3000:]
        assert sorted(placed.values()) == sorted(node_id[:8] for node_id, _ in ray_nodes), (placed, ray_nodes)

        again = _launch_two_nodes(tmp_path, "ray", [*ray, "trainer.total_steps=3"], env, "-resume")
        assert "resumed from" in again, again[-3000:]
        assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3]  # step 3 added to the first run's steps
        assert (run_dir / "checkpoints" / "step_3" / "meta.json").exists()
        assert sorted(dict(RAY_LINE.findall(again)).values()) == sorted(placed.values())
