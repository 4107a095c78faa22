"""`megarl plan`'s memory terms, each against a hand calculation written here from its formula (not calls into the
term's own code), and the one KV-bytes formula the planner and the engine's start check share."""
import json
from pathlib import Path

from megarl.bridge.hf_config import spec_from_dict, spec_kv_cache_bytes_per_token
from megarl.rollout.vllm.engine_args import kv_bytes_per_token

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3


def _hf(name: str) -> dict:
    return json.loads((ROOT / "recipes" / "models" / name / "config.json").read_text())


def test_kv_bytes_per_token_is_one_formula_for_planner_and_engine():
    llama, dsv3 = _hf("llama3_70b"), _hf("deepseek_v3")
    # Llama-3-70B: K and V, 80 layers, 8 KV heads of 128, bf16; at engine TP8 one KV head per rank
    assert kv_bytes_per_token(llama, "bfloat16") == 2 * 80 * 8 * 128 * 2
    assert spec_kv_cache_bytes_per_token(spec_from_dict(llama), 2) == 2 * 80 * 8 * 128 * 2
    assert spec_kv_cache_bytes_per_token(spec_from_dict(llama), 2, engine_tp=8) == 2 * 80 * 1 * 128 * 2
    assert spec_kv_cache_bytes_per_token(spec_from_dict(llama), 2, engine_tp=16) == 2 * 80 * 1 * 128 * 2  # replicated
    # DeepSeek-V3 (MLA): 61 layers x (kv_lora_rank 512 + rope 64), whole on every TP rank
    assert kv_bytes_per_token(dsv3, "bfloat16") == 61 * 576 * 2
    assert spec_kv_cache_bytes_per_token(spec_from_dict(dsv3), 2, engine_tp=64) == 61 * 576 * 2


def test_log_prob_logits_forward_and_update_against_hand_calculation():
    from megarl.plan.terms import forward_logits_bytes, update_logits_bytes

    # Qwen2.5-3B-like: 4 x 4096 tokens, vocab 151936 (already a multiple of 128 x TP1), bf16
    tokens, vocab = 4 * 4096, 151936
    L = tokens * vocab
    assert forward_logits_bytes(tokens, vocab, 1, 2) == L * (2 + 4)  # bf16 logits, the fp32 tensor CE exponentiates
    # + the fp32 softmax CE saves, and the entropy metric's fp32 copy, shifted logits, exponentials and product
    assert update_logits_bytes(tokens, vocab, 1, 2, False) == L * (2 + 4 + 4 + 4 + 4 + 4)
    assert update_logits_bytes(tokens, vocab, 1, 2, True) == L * (2 + 4 + 4 + 4 + 4 + 4 + 4)  # bonus: one more
    assert update_logits_bytes(tokens, vocab, 1, 4, False) == L * (4 + 4 + 4 + 4 + 4)  # fp32: no copy to make
    assert forward_logits_bytes(tokens, vocab, 1, 4) == L * (4 + 4)  # fp32: CE works on a clone
    assert update_logits_bytes(tokens, vocab, 8, 2, False) == tokens * (vocab // 8) * 22  # the TP rank's shard
    assert round(update_logits_bytes(tokens, vocab, 1, 2, False) / GIB, 2) == 51.0


def test_routing_replay_buffers_against_hand_calculation():
    from megarl.plan.terms import engine_route_capture_bytes, engine_route_recorder_bytes, route_bytes

    # Qwen3-235B-A22B R3: 512 prompts x 16 samples, 2048 + 8192 tokens, 94 layers, top-8, int16
    rows, seq, layers, k = 512 * 16, 10240, 94, 8
    assert route_bytes(rows, seq, layers, k) == 8192 * 10240 * 94 * 8 * 2
    assert round(route_bytes(rows, seq, layers, k) / GIB, 1) == 117.5  # per trainer process: why R3 exhausts hosts
    assert engine_route_recorder_bytes(rows, 4, seq, layers, k) == 2 * 2048 * 10240 * 94 * 8 * 2
    assert engine_route_capture_bytes(16384, layers, k) == 16384 * 94 * 8 * 4


def test_sync_buckets_on_both_sides_against_hand_calculation():
    from megarl.plan.terms import receive_bucket_bytes, send_bucket_bytes

    mib = 1 << 20
    assert send_bucket_bytes(1024 * mib, 12 * GIB) == 1024 * mib
    assert send_bucket_bytes(1024 * mib, 100 * mib) == 100 * mib  # never more than what the GPU sends
    assert receive_bucket_bytes(512 * mib, 16 * GIB) == 1024 * mib  # two alternating slots
    assert receive_bucket_bytes(512 * mib, 300 * mib) == 600 * mib


def test_gpu_overhead_and_host_process_terms():
    from megarl.plan.terms import allocator_reserve_bytes, cuda_context_bytes, host_process_bytes

    assert cuda_context_bytes() == GIB
    assert allocator_reserve_bytes(40 * GIB) == 2 * GIB  # 5% of the trainer's allocated bytes
    assert host_process_bytes(16) == 48 * GIB


def test_70b_plan_lines_host_memory_and_master_copies_against_hand_calculation():
    from megarl.plan import plan_recipe
    from megarl.validate import load_config

    config = ROOT / "recipes" / "models" / "llama3_70b" / "config.json"
    cfg = load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml", [f"model.config_path={config}", "trainer.nnodes=16",
                                                                  "trainer.n_gpus_per_node=8", "actor.offload=true"])
    report = plan_recipe(cfg, 16, 8, 80)
    h, layers, q, kv, f, vocab = 8192, 80, 64 * 128, 8 * 128, 28672, 128256
    params = (layers // 4 * (h * q + 2 * h * kv + q * h + 3 * h * f) + vocab * h) / 8  # stage 0, 1/TP
    # the distributed optimizer over DP4: fp32 master copy 4 B/param, Adam moments 8 B/param
    assert abs(report.terms["actor fp32 master copy (distributed)"] * GIB - params * 4 / 4) / (params) < 0.01
    assert abs(report.terms["actor Adam moments (distributed)"] * GIB - params * 8 / 4) / (params) < 0.01
    host = report.host_phases
    # 8 trainer ranks and 8 engine workers per node at 3 GiB; actor.offload: its whole stage-0 state per GPU, pinned
    assert host["generate"]["processes (trainer ranks and engine workers)"] == 16 * 3 * GIB
    actor_state = params * (2 + 4 + 12 / 4)
    assert abs(host["generate"]["pinned offload buffers"] - 8 * actor_state) / (8 * actor_state) < 0.01
    # 1024 MiB buckets: two receive slots per engine worker, 8 workers per node
    assert host["weight sync"]["shared-memory sync slots"] == 8 * 2 * 1024 * 2 ** 20
    # checkpoint save stages actor and critic shards (parameters, master copy, moments) of the node's 8 GPUs
    staged = 2 * 8 * params * (2 + 12 / 4)
    assert abs(host["checkpoint save"]["checkpoint staging (saved shards)"] - staged) / staged < 0.01
    assert report.host_peak_bytes == max(sum(v.values()) for v in host.values())


def test_r3_routes_are_counted_on_host_and_device():
    from megarl.plan import plan_recipe
    from megarl.validate import load_config

    config = ROOT / "recipes" / "models" / "qwen3_30b_a3b" / "config.json"
    base = [f"model.config_path={config}", "trainer.nnodes=2", "trainer.n_gpus_per_node=8"]
    cfg = load_config(ROOT / "recipes" / "gspo_qwen3_30b_a3b.yaml", base + ["rollout.return_routed_experts=true"])
    report = plan_recipe(cfg, 2, 8, 80)
    hf = _hf("qwen3_30b_a3b")
    r = cfg.rollout
    rows, seq = cfg.data.train_batch_size * r.n, r.prompt_length + r.response_length
    routes = rows * seq * hf["num_hidden_layers"] * hf["num_experts_per_tok"] * 2
    host = report.host_phases
    assert host["update"]["rollout batch routes (int16)"] == 8 * routes  # every trainer process on the node
    replicas = cfg.engine_replicas
    owners = 8 // r.tensor_model_parallel_size
    assert host["generate"]["engine route recorders (int16)"] == owners * 2 * 2 * (
        -(-rows // replicas)) * seq * hf["num_hidden_layers"] * hf["num_experts_per_tok"]
    off = plan_recipe(load_config(ROOT / "recipes" / "gspo_qwen3_30b_a3b.yaml", base), 2, 8, 80)
    assert "rollout batch routes (int16)" not in off.host_phases["update"]


def test_delta_update_terms_by_hand():
    from megarl.plan.terms import delta_kept_bytes, delta_update_bytes

    # 1 GiB of bf16 pieces sent: kept once; 2% changed = 0.02 * 2^29 elements x (4-byte index + 2-byte value)
    assert delta_kept_bytes(2 ** 30) == 2 ** 30
    assert delta_update_bytes(2 ** 30, 2, 0.02) == int(0.02 * 2 ** 29) * 6
    # half changed: a bitmask (1 bit an element) and the values, 2^29 / 8 + 2^28 x 2 bytes
    assert delta_update_bytes(2 ** 30, 2, 0.5) == 2 ** 26 + 2 ** 29
    assert delta_update_bytes(2 ** 30, 2, 0.97) == 2 ** 30  # past 15/16 changed: whole pieces, never more
    # 16 GiB sent: still int32 indices (each piece is one tensor's box, under 2^31 elements), 8 pieces of 2^30
    assert delta_update_bytes(2 ** 34, 2, 0.01) == int(0.01 * 2 ** 30) * 6 * 8


def test_the_plan_counts_delta_updates_only_for_engines_placed_apart():
    from megarl.plan import plan_recipe
    from megarl.validate import load_config

    apart = plan_recipe(load_config("recipes/grpo_qwen3_235b_a22b.yaml"), 12, 8, 141)
    assert "delta updates (rollout.delta_updates" in apart.text
    node = apart.host_phases["update"]
    assert node["delta updates: last sent pieces"] > 0
    colocated = plan_recipe(load_config("recipes/grpo_tiny_cpu.yaml"), 1, 2, 80)
    assert "delta updates" not in colocated.text


def test_the_plan_keeps_the_last_sent_copy_where_rollout_delta_kept_on_says():
    """host: a line of the trainer node's host memory; device: a line of every GPU phase (allocated at the first sync
    and kept), the same bytes, and the text says which."""
    from megarl.plan import plan_recipe
    from megarl.plan.phases import DELTA_KEPT
    from megarl.validate import load_config

    on_host = plan_recipe(load_config("recipes/grpo_qwen3_235b_a22b.yaml"), 12, 8, 141)
    on_gpu = plan_recipe(load_config("recipes/grpo_qwen3_235b_a22b.yaml", ["rollout.delta_kept_on=device"]), 12, 8,
                         141)
    kept = on_host.host_phases["update"]["delta updates: last sent pieces"]  # every trainer GPU of the node's
    assert "delta updates: last sent pieces" not in on_gpu.host_phases["update"]
    assert DELTA_KEPT not in on_host.terms
    per_gpu = on_gpu.terms[DELTA_KEPT] * 2 ** 30
    assert kept % round(per_gpu) == 0 and kept // round(per_gpu) in (1, 2, 4, 8), (kept, per_gpu)
    for phase, nbytes in on_gpu.phases.items():  # allocated at the first sync and kept through every phase
        assert nbytes >= on_host.phases[phase] + per_gpu, phase
    assert "GiB of GPU memory" in on_gpu.text and "pinned host memory" in on_host.text
