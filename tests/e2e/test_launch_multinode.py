"""launch/torchrun.sh: two torchrun "nodes" on this machine (2 ranks each, joined by a c10d rendezvous on localhost)
train the tiny recipe at TP2xPP2 with the same losses as one launch of 4 ranks."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "torchrun.sh"
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


def _launch(tmp: Path, name: str, node_rank: int, nnodes: int, nproc: int, port: int) -> tuple:
    log = tmp / f"{name}.node{node_rank}.log"
    env = _env(NNODES=nnodes, NODE_RANK=node_rank, NPROC_PER_NODE=nproc, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               LOCAL_ADDR="127.0.0.1", RDZV_ID=f"test-{name}", LOG_DIR=tmp / f"{name}_rank_logs")
    out = open(log, "w")
    proc = subprocess.Popen(["bash", str(SCRIPT), str(RECIPE), *_overrides(tmp, name)], cwd=ROOT, env=env,
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
