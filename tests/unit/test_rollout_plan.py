"""ReshardPlan: hand-computed byte counts for a tiny config, MoE placement, the CLI."""
import json

import pytest

from megarl.rollout.plan import ModelShape, build_plan, main

# hidden 8, 2 heads x head_dim 4, 1 KV head, ffn 16, vocab 32, 2 layers, untied. Elements per layer:
# q 64 + k 32 + v 32 + o 64 + gate 128 + up 128 + down 128 = 576 split, 2 norms x 8 = 16 replicated.
# embed 256 + lm_head 256 (vocab split) + final norm 8. Total 2*592 + 520 = 1704 elements.
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32,
        "tie_word_embeddings": False}


def test_total_bytes_is_the_sum_of_parameter_sizes():
    plan = build_plan(ModelShape.from_hf_config(TINY), dtype="float32")
    assert plan.total_bytes == 1704 * 4
    assert sum(plan.bytes_sent().values()) == plan.total_bytes == plan.bytes_received()[0]


def test_tp2_pp2_to_engine_tp2_hand_counts():
    plan = build_plan(ModelShape.from_hf_config(TINY), tp=2, pp=2, engine_tp=2, dtype="float32")
    # rank = tp + 2 * pp. Stage 0: embed + layer 0; stage 1: layer 1 + final norm + lm_head.
    # rank 0: embed/2 128 + layer0 split/2 288 + layer0 norms 16 = 432; rank 1: 128 + 288 = 416
    # rank 2: layer1 288 + norms 16 + final norm 8 + lm_head/2 128 = 440; rank 3: 288 + 128 = 416
    assert plan.bytes_sent() == {0: 432 * 4, 1: 416 * 4, 2: 440 * 4, 3: 416 * 4}
    # each engine rank: half of every split tensor (2*576 + 512) / 2 = 832, plus all replicated 2*16 + 8 = 40
    assert plan.bytes_received() == {0: 872 * 4, 1: 872 * 4}
    q = next(m for m in plan.moves if m.name == "model.layers.1.self_attn.q_proj.weight")
    assert q.pp_stage == 1 and q.senders == {2: 128, 3: 128}
    assert q.receivers == {0: (0, 0, 4, 128), 1: (0, 4, 8, 128)}
    o = next(m for m in plan.moves if m.name == "model.layers.0.self_attn.o_proj.weight")
    assert o.receivers[1][:3] == (1, 4, 8)  # row-parallel: split on the input dim


def test_moe_ep2_places_experts_and_engine_ep():
    cfg = dict(TINY, architectures=["Qwen3MoeForCausalLM"], num_experts=4, moe_intermediate_size=8,
               num_experts_per_tok=2)
    plan = build_plan(ModelShape.from_hf_config(cfg), tp=1, pp=1, ep=2, engine_tp=2, engine_ep=2, dtype="float32")
    e3 = next(m for m in plan.moves if m.name == "model.layers.0.mlp.experts.3.up_proj.weight")
    assert e3.senders == {1: 64 * 4} and e3.receivers == {1: (None, 0, 0, 64 * 4)}
    assert sum(plan.bytes_sent().values()) == plan.total_bytes
    # experts are split evenly between the two EP ranks; dense tensors come from ep rank 0
    experts_bytes = 2 * 4 * 3 * 64 * 4
    assert plan.bytes_sent()[1] == experts_bytes // 2
    with pytest.raises(ValueError, match="engine_ep=2 must equal engine_tp=1"):
        build_plan(ModelShape.from_hf_config(cfg), ep=2, engine_ep=2)
    with pytest.raises(ValueError, match="needs a MoE model"):
        build_plan(ModelShape.from_hf_config(TINY), ep=2)


def test_cli_prints_plan(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert main(["--hf-config", str(path), "--tp", "2", "--pp", "2", "--engine-tp", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "Megatron TP2 PP2 EP1 -> engine TP2" in out and "1,728 B" in out and "3,488 B" in out
    assert main(["--hf-config", str(tmp_path / "missing.json")]) == 1
