"""R2 routing replay in the RL loop: a tiny Qwen3-MoE actor at EP2 (each rank its own rows), with a reference model.
The old-logprob pass records the routing, the reference and update forwards replay it; the metrics say how much."""
import json

import pytest

from megarl.launch_local import run_ranks
from megarl.validate import load_config
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE, SMALL

MOE = ["model.create_tiny.architecture=qwen3_moe", "model.create_tiny.hidden_size=128",
       "model.create_tiny.intermediate_size=64", "model.create_tiny.num_experts=4",
       "model.create_tiny.num_experts_per_tok=2", "model.create_tiny.tie_word_embeddings=false"]


@pytest.mark.slow  # two GRPO steps of a 2-rank MoE actor, a reference model and a vLLM engine: minutes on 2 cores
def test_r2_records_then_replays_at_ep2(tmp_path):
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    run_dir = tmp_path / "run"
    cfg = load_config(RECIPE, SMALL + MOE + [
        f"trainer.run_dir={run_dir}", f"model.path={tmp_path / 'model'}", f"data.synthetic.output_dir={tmp_path / 'd'}",
        f"reward.reward_fn={reward}", "trainer.total_steps=2", "actor.router_replay.mode=R2",
        "parallelism.expert_model_parallel_size=2", "trainer.n_gpus_per_node=2", "actor.use_kl_loss=true",
        # fixed micro-batches: the EP ranks' MoE layers exchange equal token counts (validate refuses token budgets)
        "actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=4"])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=900)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # the figures, for the record (pytest -s)
        print({k: round(v, 6) for k, v in m.items() if k.startswith("router_replay/") or k in (
            "rollout/logprob_abs_diff_mean", "actor/log_ratio_abs_max", "actor/kl")})
    for m in metrics:
        # the old-logprob pass records (replays nothing); every needed token of the later passes has a route
        assert m["router_replay/old_log_prob_replayed_share"] == 0.0
        assert m["router_replay/update_replayed_share"] == 1.0 and m["router_replay/update_fallback_share"] == 0.0
        assert m["router_replay/ref_replayed_share"] == 1.0
        assert m["rollout/logprob_abs_diff_mean"] < 1e-4, m  # the old-logprob pass ran without replay
    first = metrics[0]
    # step 1: one optimizer step per batch, so the update's forwards run on the recording weights: the router agrees
    assert first["router_replay/update_agreement"] > 0.999, first
    assert first["router_replay/ref_agreement"] > 0.999, first  # the reference is the actor before any update
    assert first["actor/log_ratio_abs_max"] < 1e-5, first
    assert "router_replay/old_log_prob_fallback_share" not in first  # a recording pass has nothing to fall back from
    # step 2: the update's forwards still replay exactly what the recording forward chose (same weights)
    assert metrics[1]["router_replay/update_agreement"] > 0.999 and metrics[1]["actor/log_ratio_abs_max"] < 1e-5
