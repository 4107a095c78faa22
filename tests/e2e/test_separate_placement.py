"""rollout.placement=separate: the trainer's two ranks train while the engine runs in a process of its own, on cores
of its own, and receives every update over the transfer group of the trainer ranks and the engine host
(megarl.sync.transports.remote). The tiny recipe's loop in sync mode: the engine samples from the actor's distribution
at the first step and after every sync (logprob gap < 1e-4), and the bytes each rank sent and the engine host received
are the plan's, the two data-parallel ranks sharing the sending."""
import json
import os
from pathlib import Path

import pytest

from megarl.launch_local import run_ranks
from megarl.validate import load_config
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE
from tests.e2e.test_grpo_loop import SMALL as SMALL_LOOP

SMALL = SMALL_LOOP + ["trainer.total_steps=3", "rollout.placement=separate", "trainer.n_gpus_per_node=2"]


def _run(tmp: Path, extra=()) -> list[dict]:
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    cfg = load_config(RECIPE, SMALL + [f"trainer.run_dir={tmp / 'run'}", f"model.path={tmp / 'model'}",
                                       f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward}",
                                       *extra])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=600)
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def _check(metrics: list[dict], replicas: int) -> None:
    assert len(metrics) == 3
    assert 0.0 < metrics[0]["train/reward_mean"] < 1.0  # rewards vary: the updates (and so the syncs) are not trivial
    for m in metrics:  # step s samples with the weights of the sync after step s-1
        assert m["rollout/logprob_abs_diff_mean"] < 1e-4, m
        assert m["weight_sync/version"] == m["step"], m
        assert m["weight_sync/engine_replicas"] == replicas
        for kind in ("sent", "received", "loaded"):
            assert m[f"weight_sync/{kind}_bytes_max"] == m[f"weight_sync/plan_{kind}_bytes_max"] > 0, m
            assert m[f"weight_sync/{kind}_bytes_rank0"] == m[f"weight_sync/plan_{kind}_bytes_rank0"], m
        assert m["weight_sync/received_bytes_rank0"] == m["weight_sync/loaded_bytes_rank0"] == 0  # trainer: sends
        assert m["weight_sync/senders"] == 2
        # both ranks hold the model (data parallel): each sends about its half of every replica's copy
        assert m["weight_sync/sent_bytes_max"] < 0.75 * replicas * m["weight_sync/received_bytes_max"], m


def test_separate_engine_process_learns_on_policy(tmp_path):
    _check(_run(tmp_path), replicas=1)


@pytest.mark.slow
def test_two_separate_engine_replicas(tmp_path):
    """Two engine processes, one started by each trainer rank, each receiving its copy from both ranks."""
    _check(_run(tmp_path, ["rollout.data_parallel_size=2"]), replicas=2)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 4, reason="an engine of TP2 placed apart needs a core per worker "
                    "in its half of the machine's cores")
def test_separate_engine_tp2(tmp_path):
    """An engine of TP2 (vLLM's worker processes beside the host): the host writes each worker's own shard."""
    _check(_run(tmp_path, ["rollout.tensor_model_parallel_size=2"]), replicas=1)
