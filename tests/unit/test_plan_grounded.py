"""`megarl plan` grounded in what megarl runs: MoE layers through megatron's allgather dispatcher (gathered buffers,
expert TP, shared experts, the routing imbalance), the update backward's MLP transient, the optimizer step's
temporaries by the optimizer that runs, the hf engine's batch-sized KV cache, and the time model's attention FLOPs,
dispatcher traffic and GPU table. Each against a hand calculation written here, not a call into the term's own code."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.bridge.hf_config import spec_from_dict
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]


def _spec(name: str):
    return spec_from_dict(json.loads((ROOT / "recipes" / "models" / name / "config.json").read_text()))


def test_allgather_dispatcher_buffers_against_hand_calculation():
    from megarl.plan.terms import moe_dispatcher_bytes, moe_gathered_tokens

    # Qwen3-30B-A3B (h 2048, 128 experts) at TP2 with sequence parallel, expert TP1, EP8, a 4,096-token micro-batch:
    # each rank holds 2,048 at the layer's input; megatron gathers over expert TP x EP = 8 ranks: 16,384 tokens
    assert moe_gathered_tokens(4096, 2, True, 1, 8) == 16384
    # hidden states 16,384 x 2,048 x 2 B, float32 probs and bool routing map 16,384 x 128 x (4 + 1)
    assert moe_dispatcher_bytes(16384, 2048, 128, 2, 8) == 16384 * 2048 * 2 + 16384 * 128 * 5 == 77_594_624
    # a one-rank group gathers nothing (megatron skips the collective at TP1 EP1)
    assert moe_dispatcher_bytes(moe_gathered_tokens(4096, 1, False, 1, 1), 2048, 128, 2, 1) == 0
    # expert TP2 at TP2 EP4: the same 8-rank group
    assert moe_gathered_tokens(4096, 2, True, 2, 4) == 16384


def test_routed_and_shared_expert_activations_against_hand_calculation():
    from megarl.plan.memory import activation_bytes_per_token_layer

    qwen = _spec("qwen3_30b_a3b")  # h 2048, 32 heads, 4 KV heads of 128, top-8 of 768-wide experts, no shared
    # TP2 SP, expert TP1, imbalance 1.25, bf16 (16-bit units are bytes): 8h/TP = 8,192; (4q + 4kv)/TP = 9,216;
    # routed: each rank gathers t/2 x 8 tokens and keeps 1/8 of their 8 copies x 1.25, i.e. t x 8 x 1.25 / 2 copies,
    # each with its whole hidden vector (2h) and 6 x 768 (expert TP1): 5 x (4,096 + 4,608) = 43,520 per token
    assert activation_bytes_per_token_layer(qwen, 2, True, "none", 2, 1, 1.25) == 8192 + 9216 + 43520
    # expert TP2: twice the copies per rank, half the expert width each: 10 x (4,096 + 2,304) = 64,000
    assert activation_bytes_per_token_layer(qwen, 2, True, "none", 2, 2, 1.25) == 8192 + 9216 + 64000
    # balanced routing at TP1: 8 x (4,096 + 4,608) = 69,632; float32 doubles it all
    assert activation_bytes_per_token_layer(qwen, 1, False, "none", 4, 1, 1.0) == 2 * (16384 + 18432 + 69632)
    glm = _spec("glm4_5_air")  # h 4096, 96 heads, 8 KV heads of 128; dense FFN 10,944; 1 shared expert of 1,408
    # its MoE layers at TP2 SP (expert TP = TP): 16,384 + (4 x 12,288 + 4 x 1,024) / 2 = 26,624
    # + routed 1 x 8 x 1.25 x (8,192 + 6 x 1,408 / 2) = 124,160 + shared 6 x 1,408 / 2 = 4,224
    assert activation_bytes_per_token_layer(glm, 2, True, "none", 2, None, 1.25, True) == \
        16384 + 26624 + 124160 + 4224
    # its first layer is dense: 16,384 + (49,152 + 4,096 + 6 x 10,944) / 2
    assert activation_bytes_per_token_layer(glm, 2, True, "none", 2, None, 1.25, False) == 16384 + 59456


def test_backward_mlp_transient_against_hand_calculation():
    from megarl.plan.terms import backward_mlp_transient_bytes

    dense = _spec("qwen2_5_7b_instruct")  # h 3584, FFN 18944
    # 1,024 tokens at TP2: grad(fc1 out) 1,024 x 2 x 9,472 x 2 B; without TE also fc1's weight gradient [2 x 9,472,
    # 3,584] in bf16 before it is added to main_grad
    act, weight = 1024 * 2 * 9472 * 2, 2 * 9472 * 3584 * 2
    layers = range(dense.num_layers)
    assert backward_mlp_transient_bytes(dense, 1024, 2, True, 2, 1, 1.25, 2, False, False, layers) == act + weight
    assert backward_mlp_transient_bytes(dense, 1024, 2, True, 2, 1, 1.25, 2, True, True, layers) == act
    moe = _spec("qwen3_30b_a3b")
    # 4,096 tokens, TP2 SP, expert TP1, EP8: G = 16,384; one expert at a time (CPU): 8 x 1.25 x 16,384 / 128 = 1,280
    # copies x 2 x 768; all local experts at once (grouped GEMM): / EP 8 -> 20,480 copies; weight grad [1,536, 2,048]
    seq = backward_mlp_transient_bytes(moe, 4096, 2, True, 1, 8, 1.25, 2, False, False, range(48))
    assert seq == 1280 * 2 * 768 * 2 + 2 * 768 * 2048 * 2
    assert backward_mlp_transient_bytes(moe, 4096, 2, True, 1, 8, 1.25, 2, True, True, range(48)) == \
        20480 * 2 * 768 * 2


def test_optimizer_step_temporaries_by_the_optimizer_that_runs():
    from megarl.plan.memory import ModelMemory, optimizer_step_bytes
    from megarl.plan.terms import OPTIMIZER_FOREACH, OPTIMIZER_FUSED

    # bf16: 12 B of optimizer states per main parameter (4 master + 8 Adam); a rank's 1,000 dense and 3,000 expert
    # main parameters: torch's foreach AdamW makes one fp32 sqrt(exp_avg_sq) per parameter of the larger group
    m = ModelMemory("actor", [0], optim=[48000], dense_optim=[12000], expert_optim=[36000], trains=True)
    pl = SimpleNamespace(pbytes=2)
    assert optimizer_step_bytes(None, None, pl, OPTIMIZER_FOREACH, m, 0) == 4 * 3000
    assert optimizer_step_bytes(None, None, pl, OPTIMIZER_FUSED, m, 0) == 0


@pytest.mark.parametrize("te,name", [("false", "torch AdamW foreach"), ("true", "fused Adam")])
def test_the_plan_names_the_optimizers_step_line(te, name):
    from megarl.plan.model import Cluster, read_model_config
    from megarl.plan.planner import plan_steps

    cfg = load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", [f"model.use_transformer_engine={te}",
                                                                "trainer.device=cuda"])
    upd = plan_steps(cfg, Cluster(1, 1, 80, 50), read_model_config(cfg)).peak.lines["update"]
    lines = [k for k in upd if k.startswith("optimizer step temporaries")]
    assert len(lines) == 1 and name in lines[0], list(upd)


def test_the_dispatcher_is_a_named_line_of_a_moe_plan():
    from megarl.plan import plan_recipe

    cfg = load_config(ROOT / "recipes" / "grpo_moe_r3_tiny_cpu.yaml", ["trainer.device=cuda"])
    rep = plan_recipe(cfg, 1, 2)
    assert rep.phases and "MoE allgather dispatcher: gathered tokens, probs, routing map (one layer)" in rep.text
    from megarl.plan.model import Cluster, read_model_config
    from megarl.plan.planner import plan_steps

    st = plan_steps(cfg, Cluster(1, 2, 80, 50), read_model_config(cfg))
    # megatron's global gather buffer is kept from the first forward: a line in every phase, h 128 x 2 B per token
    kept = [lines["MoE dispatcher's gather buffer (megatron's global buffer, kept)"] for lines in st.peak.lines.values()]
    assert len(set(kept)) == 1 and kept[0] > 0 and kept[0] % (128 * 2) == 0


def test_hf_engine_kv_cache_grows_with_batch_and_length():
    from megarl.plan.model import Cluster, read_model_config
    from megarl.plan.planner import plan_steps

    def engine(overrides):
        cfg = load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", ["rollout.name=hf", "trainer.device=cuda"]
                          + overrides)
        return plan_steps(cfg, Cluster(1, 1, 80, 50), read_model_config(cfg)).engine

    e = engine([])
    # 32 prompts x 8 = 256 rows, max_num_seqs 256: one batch of 256 rows of 16 + 8 tokens; K and V of 2 layers x
    # 2 KV heads x 32 in bf16 = 512 B per token; DynamicCache concatenates one layer's anew each step (+1/2)
    assert (e.batch, e.kv_per_token) == (256, 512)
    assert e.kv_bytes == 256 * 24 * 512 + 256 * 24 * 512 // 2 == 4_718_592
    longer = engine(["rollout.response_length=40"])
    assert longer.kv_bytes == 256 * 56 * 512 * 3 // 2  # grows with the length
    fewer = engine(["rollout.max_num_seqs=64"])
    assert fewer.kv_bytes == 64 * 24 * 512 * 3 // 2  # and with the batch it decodes together
    assert e.reserve == e.weights + e.kv_bytes + e.activations  # no gpu_memory_utilization


def test_attention_flops_and_dispatcher_seconds_against_hand_calculation():
    from megarl.plan.timing import GPUS, attention_flops, dispatcher_seconds

    qwen = _spec("qwen3_30b_a3b")
    # 2 rows of 1,024: per layer and row QK^T and PV, 2 x 1,024^2 x 32 x 128 FLOPs each, halved by the mask
    assert attention_flops(qwen, 2, 1024) == 2 * 48 * (2 * 2 * 1024 ** 2 * 32 * 128) / 2
    # 4,096 tokens on one DP rank at TP2 SP, expert TP1 x EP8 within a node: G = 16,384 tokens of 2,048 x 2 B,
    # 7/8 of them received per collective, 48 MoE layers, 4 collectives (forward and backward), at 0.7 x 450 GB/s
    moved = 16384 * 2048 * 2 * 7 / 8 * 48 * 4
    h100 = GPUS["H100"]
    got = dispatcher_seconds(qwen, 4096, 1, 1, 2, True, 1, 8, 1, 4, 2, False, 50.0, h100)
    assert got == pytest.approx(moved / (450e9 * 0.7))
    # across nodes the link's 50 GB/s instead
    assert dispatcher_seconds(qwen, 4096, 1, 1, 2, True, 1, 8, 1, 4, 2, True, 50.0, h100) == \
        pytest.approx(moved / (50e9 * 0.7))
    assert dispatcher_seconds(qwen, 4096, 1, 1, 1, False, 1, 1, 1, 4, 2, False, 50.0, h100) == 0


def test_gpu_sets_memory_and_gpu_mem_overrides(capsys):
    from megarl.plan import main

    main(["recipes/grpo_tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "1", "--gpu", "H200"])
    assert "1 GPU(s) of 140 GiB" in capsys.readouterr().out
    main(["recipes/grpo_tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "1", "--gpu", "B200", "--gpu-mem", "100"])
    assert "1 GPU(s) of 100 GiB" in capsys.readouterr().out
    main(["recipes/grpo_tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "1"])
    assert "1 GPU(s) of 80 GiB" in capsys.readouterr().out


def test_search_ranks_by_time_and_prints_margins_and_headroom():
    import argparse

    from megarl.plan import add_arguments
    from megarl.plan.search import render, search

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["r.yaml", "--search"])
    assert (args.top, args.margin) == (5, 0.10)
    cfg = load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", ["trainer.device=cuda"])
    res = search(cfg, 1, 2, 80.0, 50.0, 2048.0)
    times = [c.time.total for c in res.best]
    assert 2 <= len(times) <= 5 and times == sorted(times)
    text = render(res, "cluster", 80 * 1024 ** 3)
    assert "headroom" in text and "over #1" in text and "margin" in text
