"""Ray-hosted rollout engines (rollout.mode=ray): the pure helpers, and the tiny recipe's loop with the engine in a Ray
actor on a local Ray instance started by the run itself (the colocated engine's loop is tests/e2e/test_grpo_loop.py)."""
import json
from pathlib import Path

import pytest
import torch

from megarl.launch_local import run_ranks
from megarl.rollout.hosting.ray import concat_rollouts, split_prompts
from megarl.types import RolloutBatch
from megarl.validate import load_config
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE
from tests.e2e.test_grpo_loop import SMALL as SMALL_LOOP

SMALL = SMALL_LOOP + ["trainer.total_steps=2"]


def test_split_prompts_contiguous_and_balanced():
    assert split_prompts(8, 1) == [(0, 8)]
    assert split_prompts(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_prompts(1, 2) == [(0, 1)]
    assert split_prompts(0, 2) == []


def _batch(rows: list[list[int]], start: int, version: int = 1) -> RolloutBatch:
    n, width = len(rows), max(len(r) for r in rows)
    resp = torch.full((n, width), 9, dtype=torch.long)
    lps = torch.zeros((n, width))
    for i, r in enumerate(rows):
        resp[i, : len(r)] = torch.tensor(r)
        lps[i, : len(r)] = -0.5
    lengths = torch.tensor([len(r) for r in rows])
    return RolloutBatch(prompt_ids=[[1, 2]] * n, response_ids=resp, response_lengths=lengths, rollout_logprobs=lps,
                        finish_reasons=["stop"] * n, truncated=torch.zeros(n, dtype=torch.bool),
                        prompt_index=torch.arange(start, start + n), prompt_truncated=torch.zeros(n, dtype=torch.bool),
                        weight_version=version, pad_token_id=9,
                        metrics={"rollout/num_samples": float(n), "rollout/response_tokens": float(lengths.sum()),
                                 "rollout/generate_seconds": 0.5})


def test_concat_rollouts_repads_and_keeps_order():
    out = concat_rollouts([_batch([[3, 4, 5]], 0), _batch([[6], [7, 8]], 1)])
    assert out.response_ids.tolist() == [[3, 4, 5], [6, 9, 9], [7, 8, 9]]
    assert out.rollout_logprobs.tolist() == [[-0.5] * 3, [-0.5, 0, 0], [-0.5, -0.5, 0]]
    assert out.prompt_index.tolist() == [0, 1, 2] and out.response_lengths.tolist() == [3, 1, 2]
    assert out.metrics["rollout/num_samples"] == 3 and out.metrics["rollout/response_tokens"] == 6
    assert out.metrics["rollout/tokens_per_second"] == 12.0  # replicas run concurrently: the longest time counts


def _run(tmp: Path, name: str, extra=()) -> list[dict]:
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    cfg = load_config(RECIPE, SMALL + [f"trainer.run_dir={tmp / name}", f"model.path={tmp / 'model'}",
                                       f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward}",
                                       *extra])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=600,
              env={"RAY_ADDRESS": ""})
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]


# ~35 s each: Ray-hosted engines are an optional placement (the colocated loop runs in test_grpo_loop)
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 1])
def test_ray_engine_loop_is_on_policy(tmp_path, ranks):
    """The acceptance bound the colocated engine meets in test_grpo_loop.py: rollout/trainer logprob agreement < 1e-4
    at the first step and after every weight sync (each step's rollout follows the previous step's update and sync),
    the weights delivered over the transfer group: bytes sent and received as the plan says, rank 0 no more than its
    share when two data-parallel ranks hold the model."""
    metrics = _run(tmp_path, "ray", ["rollout.mode=ray", f"trainer.n_gpus_per_node={ranks}"])
    first = metrics[0]
    assert first["rollout/logprob_abs_diff_mean"] < 1e-4, first  # vLLM in the actor and megatron agree
    assert first["actor/log_ratio_abs_max"] < 1e-6
    assert 0.0 < first["train/reward_mean"] < 1.0  # rewards vary: the update (and so the sync) is not trivial
    assert first["weight_sync/engine_replicas"] == 1.0 and first["weight_sync/num_buckets"] >= 1
    assert first["weight_sync/version"] == 1.0
    for m in metrics:  # after each weight sync the engine in the actor samples from the actor's distribution
        assert m["rollout/logprob_abs_diff_mean"] < 1e-4, m
        for kind in ("sent", "received", "loaded"):
            assert m[f"weight_sync/{kind}_bytes_max"] == m[f"weight_sync/plan_{kind}_bytes_max"] > 0, m
            assert m[f"weight_sync/{kind}_bytes_rank0"] == m[f"weight_sync/plan_{kind}_bytes_rank0"], m
        assert m["weight_sync/received_bytes_rank0"] == 0  # the actor receives; the trainer only sends
        assert m["weight_sync/senders"] == ranks
        if ranks == 2:  # each data-parallel rank holds the whole model and sends about half of it
            assert m["weight_sync/sent_bytes_rank0"] < 0.75 * m["weight_sync/received_bytes_max"], m
