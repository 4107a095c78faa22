"""`megarl plan --measure`'s parts without launching ranks: the live-tensor counter against a known allocation pattern,
the plan's terms the measurements corrected (micro-batch tokens, the old/ref logits) against hand calculations, and
the calibration the time model reads."""
import json

import pytest
import torch

from megarl.plan.memory import micro_tokens
from megarl.plan.measure import NOT_TRAINER, compare, cut_layers, trainer_bytes
from megarl.plan.tracker import LiveTensorBytes
from megarl.plan.timing import GPU_TFLOPS, MFU, assumptions, effective_mfu, read_calibration


def test_live_tensor_bytes_counts_a_known_allocation_pattern_exactly():
    outside = torch.zeros(1000)  # made before the mode: not counted unless tracked
    with LiveTensorBytes() as live:
        a = torch.zeros(1000)  # 4,000 B
        view = a.view(10, 100)  # a view shares a's storage: nothing new
        assert (live.current, live.peak) == (4000, 4000)
        b = torch.ones(500, dtype=torch.float64)  # 4,000 B
        assert live.current == 8000
        del b  # freed: current falls, the peak stays
        assert (live.current, live.peak) == (4000, 8000)
        assert live.reset_peak() == 4000 and live.peak == 4000
        c = torch.empty(256, dtype=torch.bfloat16)  # 512 B
        c.add_(1)  # in place: no new storage
        c.untyped_storage().resize_(1024)  # grown in place, which no dispatch mode sees
        assert live.current == 4000 + 1024
        live.track(outside)
        assert live.current == 4000 + 1024 + 4000
        d = a * 2  # a temporary of 4,000 B, then gone
        del d
        assert live.peak == 4000 + 1024 + 4000 + 4000
        del a, view, c
        assert live.current == 4000  # only `outside` is left
    assert outside.sum() == 0


def test_live_tensor_bytes_follows_autograd():
    with LiveTensorBytes() as live:
        w = torch.randn(100, 100, requires_grad=True)  # 40,000 B
        live.reset_peak()
        (w * 3).sum().backward()
        # w's gradient (40,000) stays; w * 3 (40,000) and the loss lived until the backward freed them
        assert live.current == 40000 + 40000
        # the peak: w and w * 3 with the loss (4 B) and its gradient seed (4 B), before w * 3 is freed
        assert live.peak == 40000 + 40000 + 4 + 4


def test_micro_batch_tokens_never_exceed_the_ranks_mini_batch():
    # 8 sequences of 24 tokens on a rank (192 tokens): a 16,384-token budget packs them into one micro-batch of 192
    assert micro_tokens(8, 24, 32, True, 16384) == (192, 1)
    # a budget below the mini-batch: 100 tokens (rounded to at least one sequence) -> ceil(192 / 100) = 2
    assert micro_tokens(8, 24, 32, True, 100) == (100, 2)
    assert micro_tokens(8, 24, 32, True, 10) == (24, 8)  # one sequence at least
    # fixed micro-batches of 32 sequences where the rank has 8: one micro-batch of 8 x 24
    assert micro_tokens(8, 24, 32, False, 0) == (192, 1)
    assert micro_tokens(64, 24, 16, False, 0) == (16 * 24, 4)


def test_old_ref_logits_are_planned_only_where_a_policy_forward_runs():
    from megarl.validate import load_config
    from megarl.plan.memory import forward_logits
    from megarl.plan.model import read_model_config
    from megarl.bridge.hf_config import spec_from_dict

    on_policy = load_config("recipes/grpo_tiny_cpu.yaml", ["data.train_batch_size=4", "rollout.n=2",
                                                           "actor.ppo_mini_batch_size=4"])
    spec = spec_from_dict(read_model_config(on_policy))
    # GRPO, one mini-batch, no KL: the update takes the old log-probs from its own forward; no reference
    assert forward_logits(on_policy, spec, 1, 24, 4) == 0
    with_ref = load_config("recipes/grpo_tiny_cpu.yaml", ["data.train_batch_size=4", "rollout.n=2",
                                                          "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=true"])
    # the reference's forward alone: its own micro-batch, ref.log_prob_micro_batch_size_per_gpu = 4 rows x 24 tokens
    # (not rollout.log_prob_micro_batch_size_per_gpu = 256, the old-logprob pass's, which does not run), vocab padded
    # to 128, float32: L * 8
    from megarl.bridge.mapping import padded_vocab_size

    vocab = padded_vocab_size(spec.vocab_size, 1)
    assert forward_logits(with_ref, spec, 1, 24, 4) == 4 * 24 * vocab * (4 + 4)
    # with the old-logprob pass too (two mini-batches: off-policy), the larger: 8 rows (micro-batch 256 > 8 rows)
    off_policy = load_config("recipes/grpo_tiny_cpu.yaml", ["data.train_batch_size=4", "rollout.n=2",
                                                            "actor.ppo_mini_batch_size=2", "actor.use_kl_loss=true"])
    assert forward_logits(off_policy, spec, 1, 24, 4) == 8 * 24 * vocab * (4 + 4)


def test_planned_trainer_bytes_leave_out_what_is_not_a_trainer_tensor():
    lines = {"actor parameters": 100, "actor gradients (fp32)": 200, "engine (gpu_memory_utilization)": 10_000,
             "CUDA context, cuBLAS, NCCL": 1000, "allocator reserve (fragmentation)": 15, "sync send bucket": 7,
             "sync receive slots (2 buckets)": 14, "engine weights (woken for the sync)": 500,
             "offloaded to host (generate)": -50, "engine (hf: weights, KV cache of its batch, prefill)": 3000}
    assert trainer_bytes(lines) == 100 + 200 + 7 - 50
    assert set(NOT_TRAINER) <= set(lines)
    planned = {0: {p: {"actor parameters": 100} for p in ("generate", "update")}}
    ranks = [{"stage": 0, "peaks": {"generate": 90, "update": 130}, "seconds": {"update": 1.5}},
             {"stage": 0, "peaks": {"generate": 110, "update": 120}, "seconds": {"update": 2.0}}]
    rows = compare(planned, ranks)  # the busiest rank of the stage
    assert [(r["phase"], r["measured"], r["ratio"], r["seconds"]) for r in rows] == [
        ("generate", 110, 1.1, 0.0), ("update", 130, 1.3, 2.0)]


def test_cut_layers_keeps_every_pipeline_stage_busy():
    assert cut_layers(28, 2, 1) == 2
    assert cut_layers(28, 2, 4) == 4
    assert cut_layers(28, 5, 2) == 4
    assert cut_layers(2, 8, 1) == 2


def test_a_calibration_replaces_the_assumed_mfu_of_the_trainer_phases(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"device": "cuda:0", "achieved_tflops_per_device": {"forward": 445.05,
                                                                                    "update": 197.8}}))
    cal = read_calibration(str(path))
    assert effective_mfu("update", cal) == pytest.approx(197.8 / GPU_TFLOPS)
    assert effective_mfu("forward", cal) == pytest.approx(0.45)
    assert effective_mfu("prefill", cal) == MFU["prefill"]  # never measured: assumed
    assert effective_mfu("update") == MFU["update"]
    text = assumptions(cal)
    assert "measured" in text and "update 198" in text and "assumed otherwise" in text
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="--calibration .*bad.json: not a calibration file"):
        read_calibration(str(bad))


def test_activations_are_planned_in_the_parameter_dtype():
    from megarl.bridge.hf_config import spec_from_dict
    from megarl.bridge.tiny import tiny_hf_config
    from megarl.config.schema import TinyModelSpec
    from megarl.plan.memory import activation_bytes_per_token_layer

    spec = spec_from_dict(tiny_hf_config(TinyModelSpec(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                                       intermediate_size=4864), 64).to_dict())
    h, q, kv, f = 896, 14 * 64, 2 * 64, 4864
    bf16 = 8 * h + 4 * q + 4 * kv + 6 * f  # 16-bit elements: 40,448 B per token and layer
    assert activation_bytes_per_token_layer(spec, 1, False, "none") == bf16 == 40448
    assert activation_bytes_per_token_layer(spec, 1, False, "none", 4) == 2 * bf16


def test_cpu_checkpoint_clones_of_split_fc1_views_against_a_hand_calculation():
    from megarl.bridge.hf_config import spec_from_dict
    from megarl.bridge.tiny import tiny_hf_config
    from megarl.config.schema import TinyModelSpec
    from megarl.plan.terms import cpu_checkpoint_clone_bytes, fc1_elements

    dense = spec_from_dict(tiny_hf_config(TinyModelSpec(hidden_size=896, num_attention_heads=14,
                                                        num_key_value_heads=2, intermediate_size=4864), 64).to_dict())
    fc1 = 2 * 2 * 4864 * 896  # 2 layers of a [2 x 4864, 896] fc1: 17,432,576 elements
    assert fc1_elements(dense, [2], 0, 1, 1, 1) == fc1
    assert fc1_elements(dense, [1, 1], 1, 2, 1, 2) == fc1 // 4  # one layer on stage 1, split over TP 2
    # float32 actor: the parameter halves and both Adam moments' halves cloned, 12 B per element = 199.5 MiB (the
    # measured run's checkpoint phase rose by 200.0 MiB over its states)
    assert cpu_checkpoint_clone_bytes(fc1, 4, True) == fc1 * 12 == 209_190_912
    assert cpu_checkpoint_clone_bytes(fc1, 4, False) == fc1 * 4  # a frozen LoRA base: its parameters only
    assert cpu_checkpoint_clone_bytes(fc1, 2, True) == fc1 * (2 + 4 + 8)  # bf16: + the fp32 master copy
    moe = spec_from_dict(tiny_hf_config(TinyModelSpec(architecture="qwen3_moe", hidden_size=2048,
                                                      num_attention_heads=32, num_key_value_heads=4,
                                                      intermediate_size=768, num_experts=8, num_experts_per_tok=8,
                                                      tie_word_embeddings=False), 64).to_dict())
    # EP 2: 4 local experts per layer, 2 layers, fc1 [2 x 768, 2048] each
    assert fc1_elements(moe, [2], 0, 1, 2, 1) == 2 * 4 * 2 * 768 * 2048


def test_cpu_adam_step_temporaries_against_a_hand_calculation():
    from megarl.bridge.hf_config import spec_from_dict
    from megarl.bridge.tiny import tiny_hf_config
    from megarl.config.schema import TinyModelSpec
    from megarl.plan.terms import cpu_adam_step_bytes, largest_trained_elements

    spec = spec_from_dict(tiny_hf_config(TinyModelSpec(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                                       intermediate_size=4864), 64).to_dict())
    fc1 = 2 * 4864 * 896  # the largest: fc1 [9728, 896], above the embedding [128, 896] and QKV [1152, 896]
    assert largest_trained_elements(spec, 0, 1, 1, 1, 128) == fc1
    assert largest_trained_elements(spec, 0, 1, 2, 2, 128) == fc1 // 2
    # a real vocabulary's embedding is larger: [151,936, 896]
    assert largest_trained_elements(spec, 0, 1, 1, 1, 151936) == 151936 * 896
    assert largest_trained_elements(spec, 0, 1, 1, 1, 128, lora_rank=16) == 16 * 9728  # LoRA: fc1's adapter B
    # sqrt(exp_avg_sq) and its quotient by the bias correction, float32, of fc1: 66.5 MiB
    assert cpu_adam_step_bytes(fc1) == 8 * fc1 == 69_730_304


def test_cpu_forward_working_set_against_a_hand_calculation():
    from megarl.bridge.hf_config import spec_from_dict
    from megarl.bridge.tiny import tiny_hf_config
    from megarl.config.schema import TinyModelSpec
    from megarl.plan.terms import cpu_forward_working_set_bytes

    spec = spec_from_dict(tiny_hf_config(TinyModelSpec(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                                       intermediate_size=4864), 64).to_dict())
    # 192 tokens, float32: fc1's output 2f, the gate's activation f, the linear half + offset f, the product f, and
    # 4 hidden-sized tensors: 192 x 4 x (5 x 4864 + 4 x 896) = 21,430,272 B (20.4 MiB)
    assert cpu_forward_working_set_bytes(spec, 192, 1, 4) == 192 * 4 * (5 * 4864 + 4 * 896) == 21_430_272
    assert cpu_forward_working_set_bytes(spec, 192, 2, 4) == 192 * 4 * (5 * 4864 // 2 + 4 * 896)


def test_a_recipes_config_json_model_is_cut_to_its_layers_at_its_widths(tmp_path):
    from megarl.plan.measure import make_cut_model
    from megarl.validate import load_config
    from tests.helpers.tiny_models import make_tiny_model

    src = make_tiny_model("qwen2", tmp_path / "src")  # 4 layers, tied embeddings, QKV bias
    cfg = load_config("recipes/grpo_tiny_cpu.yaml", [f"model.path={src}", "model.create_tiny=null",
                                                     "sft.enable=false"])
    out, keep, total = make_cut_model(cfg, 2, tmp_path / "cut")
    assert (keep, total) == (2, 4)
    made = json.loads((out / "config.json").read_text())
    given = json.loads((src / "config.json").read_text())
    assert made["num_hidden_layers"] == 2
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "tie_word_embeddings"):
        assert made[key] == given[key], key
    assert list(out.glob("*.safetensors"))


def test_cpu_unfused_gated_unit_against_a_hand_calculation():
    from megarl.bridge.hf_config import spec_from_dict
    from megarl.bridge.tiny import tiny_hf_config
    from megarl.config.schema import TinyModelSpec
    from megarl.plan.terms import cpu_unfused_glu_bytes

    spec = spec_from_dict(tiny_hf_config(TinyModelSpec(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                                       intermediate_size=4864), 64).to_dict())
    # 192 tokens through 2 layers, float32: the linear half + offset and the gate's activation, 2 x 4864 each token
    assert cpu_unfused_glu_bytes(spec, 192, 2, 1, 4) == 192 * 2 * 2 * 4864 * 4 == 14_942_208
    moe = spec_from_dict(tiny_hf_config(TinyModelSpec(architecture="qwen3_moe", hidden_size=2048,
                                                      num_attention_heads=32, num_key_value_heads=4,
                                                      intermediate_size=768, num_experts=8, num_experts_per_tok=8,
                                                      tie_word_embeddings=False), 64).to_dict())
    assert cpu_unfused_glu_bytes(moe, 192, 2, 1, 4) == 192 * 2 * 2 * 8 * 768 * 4  # top-8 experts per token


def test_paused_tracking_never_counts_what_was_made_while_paused():
    with LiveTensorBytes() as live:
        with live.paused():
            engine = torch.zeros(1000)  # another process's memory mapped here, in the measured run: not the trainer's
        assert live.current == 0
        view = engine[:500].view(torch.int32)  # a view made while counting: still not counted
        view.fill_(1)
        own = engine * 2  # a new storage: counted
        assert (live.current, live.peak) == (4000, 4000)
        del own, view
    assert engine.sum() != 0


def test_merging_a_lora_delta_makes_one_tensor_of_the_weights_size():
    from megarl.bridge.sharding import merged_value

    w = torch.randn(64, 32)
    b, a, scaling = torch.randn(64, 4), torch.randn(4, 32), 2.0

    class Adapter:  # the protocol megarl.lora attaches: a bound method of a module with an `enabled` flag
        enabled = True

        def delta_weight(self):
            return (b @ a).mul_(scaling)

    w.megarl_lora_delta = Adapter().delta_weight
    with LiveTensorBytes() as live:
        live.track(w, b, a)
        before = live.reset_peak()
        merged = merged_value(w)
        # the product B A, scaled and added to in place: 64 x 32 x 4 B, no second tensor of that size
        assert live.peak - before == live.current - before == 64 * 32 * 4
    assert torch.equal(merged, w + (b @ a) * scaling)  # bitwise: the addition commutes


def test_merged_lora_sync_bytes_against_a_hand_calculation():
    from megarl.bridge.hf_config import spec_from_dict
    from megarl.bridge.mapping import Mapping
    from megarl.bridge.tiny import tiny_hf_config
    from megarl.config.schema import TinyModelSpec
    from megarl.lora.targets import LoraSettings, resolve_targets
    from megarl.plan.memory import merged_lora_elements
    from megarl.plan.terms import lora_merged_sync_bytes

    spec = spec_from_dict(tiny_hf_config(TinyModelSpec(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                                       intermediate_size=4864), 64).to_dict())
    mapping = Mapping(spec)
    every = resolve_targets(mapping, LoraSettings(rank=16, target_modules="all-linear"))
    # per layer: QKV [896 + 2 x 128, 896], the attention output [896, 896], fc1 [2 x 4864, 896], fc2 [896, 4864]
    qkv, proj, fc1, fc2 = 1152 * 896, 896 * 896, 9728 * 896, 896 * 4864
    layer = qkv + proj + fc1 + fc2  # 14,909,440 elements
    assert merged_lora_elements(every, mapping, 1, 1, 1, 1, 2) == ([2 * layer], [fc1])
    assert merged_lora_elements(every, mapping, 2, 2, 1, 2, 2) == ([layer // 2] * 2, [fc1 // 2] * 2)
    # q_proj alone: the fused QKV is merged whole
    q_only = resolve_targets(mapping, LoraSettings(rank=16, target_modules=("q_proj",)))
    assert merged_lora_elements(q_only, mapping, 1, 1, 1, 1, 2) == ([2 * qkv], [qkv])
    # the measured run (float32, 2 layers, 512 MiB buckets, CPU: 1 kept): all of them, 113.7 MiB; measured 113.8 MiB
    m, big = 2 * layer * 4, fc1 * 4
    assert lora_merged_sync_bytes(m, big, 512 << 20, 1) == m == 119_275_520
    # a bucket smaller than the stage's merged weights: the kept buckets and the tensor reaching past the last
    assert lora_merged_sync_bytes(m, big, 16 << 20, 1) == (16 << 20) + big
    assert lora_merged_sync_bytes(m, big, 16 << 20, 2) == (32 << 20) + big  # GPU: the engine pulls from the last
    assert lora_merged_sync_bytes(m, big, 16 << 20, 1, spread=2) == (32 << 20) + big  # engine TP 2 x the trainer's



def test_local_layers_extra_stored_bytes_against_a_hand_calculation():
    from pathlib import Path

    from megarl.bridge.hf_config import spec_from_dict
    from megarl.plan.terms import local_layers_extra_bytes

    root = Path(__file__).resolve().parents[2]

    qwen = spec_from_dict(json.loads((root / "recipes" / "models" / "qwen3_30b_a3b" / "config.json").read_text()))
    # h 2048, q 32 x 128 = 4096, kv 4 x 128 = 512, q/k norms, top-8 of 768-wide experts; 1,024 tokens, 2 layers in
    # flight, TP1, float32, expert TP1, imbalance 1.25, one stage (first and last). Per token and layer: the two norms'
    # normalised inputs 2 x 2048, rotary's q and k copies 4096 + 512, the q/k norms 2 x 4096 + 512, the experts'
    # probs product 8 x 1.25 x 768 -> 25,088; once: the embedding 2048 and the final norm 2 x 2048
    per_layer = 2 * 2048 + (4096 + 512) + (2 * 4096 + 512) + 8 * 1.25 * 768
    assert per_layer == 25088
    assert local_layers_extra_bytes(qwen, 1024, 2, 1, False, 4, 1, 1.25, True, True) == \
        1024 * (2 * 25088 + 3 * 2048) * 4 == 230_686_720
    dense = spec_from_dict(json.loads((root / "recipes" / "models" / "qwen2_5_7b_instruct" / "config.json")
                                      .read_text()))
    # h 3584, q 28 x 128, kv 4 x 128, no q/k norms; TP2 with sequence parallel, bf16, a middle stage, 3 layers in flight
    assert local_layers_extra_bytes(dense, 100, 3, 2, True, 2, 2, 1.0, False, False) == \
        100 * 3 * (2 * 3584 // 2 + (3584 + 512) // 2) * 2 == 3_379_200
