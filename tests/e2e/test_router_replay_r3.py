"""R3 routing replay in the RL loop: a tiny Qwen3-MoE actor at trainer EP2 (each rank its own rows) and a vLLM engine
at TP2 with EP2 that returns the experts it routed every token to (megarl.rollout.vllm.routes.RouteRecorder).

The model's router rows are made nearly equal (every expert's gate row is one row plus noise of a few float32 ulps),
so the top-2 of a token is decided by differences as small as the rounding that separates vLLM's kernels from
Megatron's: engine and trainer route a good share of (token, layer) pairs differently, as large MoE models do at
their near ties. Without replay (rollout.return_routed_experts=true, mode none) the old-logprob pass measures that
share and the logprob gap it causes; with R3 the trainer's forwards use the engine's experts for every recorded pair
and the old-logprob vs rollout-logprob gap is the dense-model level (float32).
"""
import json

import pytest
import torch

from megarl.launch_local import run_ranks
from megarl.validate import load_config
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE, SMALL

SPEC = {"architecture": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "tie_word_embeddings": False}
GATE_NOISE = 1e-8  # gate rows differ by this (absolute; entries ~0.02): ties at float32 rounding level


def near_tie_moe(path) -> str:
    """A tiny Qwen3-MoE with the arithmetic tokenizer whose experts' gate rows are nearly equal (see above)."""
    from transformers import AutoModelForCausalLM

    from megarl.config.schema import TinyModelSpec
    from megarl.prepare import create_tiny_model

    create_tiny_model(TinyModelSpec(**SPEC), path, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight  # [experts, hidden]
            w.copy_(w[:1].expand_as(w) + GATE_NOISE * torch.randn(w.shape, generator=g))
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def run_step(tmp_path, name: str, model: str, extra: list) -> dict:
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    run_dir = tmp_path / name
    # two mini-batches: the old-logprob pass runs (one mini-batch would take the old logprobs from the update);
    # fixed micro-batches: token-budget ones are cut to each rank's longest row, and the EP ranks' MoE layers must
    # exchange equal token counts
    cfg = load_config(RECIPE, SMALL + [
        f"trainer.run_dir={run_dir}", f"model.path={model}", f"data.synthetic.output_dir={tmp_path / 'd'}",
        f"reward.reward_fn={reward}", "trainer.total_steps=1", "actor.ppo_mini_batch_size=4",
        "actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=4",
        "parallelism.expert_model_parallel_size=2", "trainer.n_gpus_per_node=2",
        "rollout.tensor_model_parallel_size=2", "rollout.expert_model_parallel_size=2", *extra])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=900)
    (m,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(name, {k: round(v, 8) for k, v in m.items() if k.startswith("router_replay/") or k in (
        "rollout/routed_experts_coverage", "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max")})
    return m


@pytest.mark.slow  # two one-step runs of a 2-rank MoE actor with a TP2 vLLM engine: 13-15 min on 2 very busy cores
def test_r3_replays_the_engine_routing_at_trainer_ep2_engine_tp2_ep2(tmp_path):
    model = near_tie_moe(tmp_path / "model")
    plain = run_step(tmp_path, "measured", model, ["rollout.return_routed_experts=true"])
    r3 = run_step(tmp_path, "r3", model, ["actor.router_replay.mode=R3"])

    for m in (plain, r3):  # the engine recorded a route for every forwarded token of every sample
        assert m["rollout/routed_experts_coverage"] == 1.0
    # without replay: the trainer's routers disagree with the engine's on a share of the pairs, and the logprobs
    # drift far past float32 noise
    differ = 1 - plain["router_replay/old_log_prob_agreement"]
    print(f"without replay: {differ:.2%} of (token, MoE layer) routings differ between engine and trainer; "
          f"old vs rollout logprob gap mean {plain['rollout/logprob_abs_diff_mean']:.2e} max "
          f"{plain['rollout/logprob_abs_diff_max']:.2e}")
    assert plain["router_replay/old_log_prob_replayed_share"] == 0.0  # measured only
    assert differ > 0.01, plain
    assert plain["rollout/logprob_abs_diff_max"] > 1e-3, plain
    # R3: the trainer's own routers would still differ (at these ties even the engine's choices vary between runs);
    # every recorded pair is replayed in every pass
    assert r3["router_replay/old_log_prob_agreement"] < 0.99, r3
    for p in ("old_log_prob", "update"):
        assert r3[f"router_replay/{p}_replayed_share"] == 1.0 and r3[f"router_replay/{p}_fallback_share"] == 0.0, r3
    print(f"R3: 100% of recorded pairs replayed; gap mean {r3['rollout/logprob_abs_diff_mean']:.2e} max "
          f"{r3['rollout/logprob_abs_diff_max']:.2e}")
    assert r3["rollout/logprob_abs_diff_max"] < 1e-4, r3
