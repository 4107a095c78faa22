"""`megarl plan` against hand calculations written here from first principles (not calls into megarl.plan), for a
Llama-3-70B-class dense layout and a Qwen3-235B-A22B-class MoE layout, and its refusal of a layout that cannot fit."""
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.plan import plan_recipe
from megarl.sync.plan import build_plan
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3


def _plan(recipe: str, nodes: int, gpn: int, mem: float, extra=()):
    return _plan_once(recipe, nodes, gpn, mem, tuple(extra))


@functools.lru_cache(maxsize=None)  # several tests read the same plan (a 235B MoE plan takes seconds)
def _plan_once(recipe: str, nodes: int, gpn: int, mem: float, extra: tuple):
    cfg = load_config(ROOT / "recipes" / recipe, [f"model.config_path={_config(recipe)}", *extra])
    if cfg.rollout.mode != "ray":
        cfg = load_config(ROOT / "recipes" / recipe, [f"model.config_path={_config(recipe)}", f"trainer.nnodes={nodes}",
                                                      f"trainer.n_gpus_per_node={gpn}", *extra])
    return cfg, plan_recipe(cfg, nodes, gpn, mem)


def _config(recipe: str) -> Path:
    name = {"ppo_llama3_70b.yaml": "llama3_70b", "grpo_qwen3_235b_a22b.yaml": "qwen3_235b_a22b"}[recipe]
    return ROOT / "recipes" / "models" / name / "config.json"


def test_llama3_70b_ppo_on_16_nodes_matches_hand_calculation():
    _, report = _plan("ppo_llama3_70b.yaml", 16, 8, 80)
    # Llama-3-70B: h 8192, 80 layers, 64 heads / 8 KV heads of 128, FFN 28672, vocab 128256, untied.
    h, layers, q, kv, f, vocab = 8192, 80, 64 * 128, 8 * 128, 28672, 128256
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * f  # q, k, v, o + gate, up, down (norms are negligible)
    tp, pp, dp = 8, 4, 128 // (8 * 4)
    # the busiest GPU is a stage-0 GPU: 20 layers and the embedding, 1/TP of each; it also hosts the engine
    params = (layers // pp * per_layer + vocab * h) / tp
    state = params * 2 + params * 4 + params * 12 / dp  # bf16 weights, fp32 grads, Adam (fp32 master, m, v) / DP
    actor = critic = state  # the critic differs only by its head, which is on the last stage
    ref = params * 2
    engine = 0.4 * 80 * GIB  # gpu_memory_utilization share of the GPU while it generates
    trainer = actor + critic + ref
    hand = trainer + engine + 1 * GIB + 0.05 * trainer  # CUDA context, allocator reserve over the trainer's bytes
    assert report.fits, report.text
    assert abs(report.per_gpu_bytes - hand) / hand < 0.10, (report.per_gpu_bytes / GIB, hand / GIB)
    # weight sync: every GPU hosts an engine worker (16 replicas x TP8) that loads 1/8 of the model. Its replica is
    # its own TP group, so it holds its stage's 20 layers already and receives the other 60 layers' 1/8; a middle
    # stage's GPU (the busiest receiver) also receives 1/8 of both vocabulary matrices; bound at 50 GB/s
    total = layers * per_layer + 2 * vocab * h
    assert abs(report.sync_bytes_per_engine_rank - total * 2 / 8) / (total * 2 / 8) < 0.01
    received = (60 * per_layer + 2 * vocab * h) * 2 / 8
    assert abs(report.sync_seconds_lower_bound - received / 50e9) / (received / 50e9) < 0.01


def test_qwen3_235b_moe_on_ray_engines_matches_hand_calculation():
    _, report = _plan("grpo_qwen3_235b_a22b.yaml", 12, 8, 141)
    # Qwen3-235B-A22B: h 4096, 94 layers, 64 heads / 4 KV heads of 128, 128 experts of FFN 1536, top-8, vocab 151936
    h, layers, q, kv, experts, fe, vocab = 4096, 94, 64 * 128, 4 * 128, 128, 1536, 151936
    tp, pp, ep, world = 4, 2, 8, 64  # 8 trainer nodes; 4 more nodes hold the engines
    dp, edp = world // (tp * pp), world // (tp * ep * pp)
    attn = h * q + 2 * h * kv + q * h
    expert_layer = experts * 3 * h * fe
    # the busiest GPU is on the last stage: 47 layers' attention / TP and experts / (EP * TP), plus the LM head / TP
    dense = (layers // pp * attn + vocab * h) / tp
    expert = layers // pp * expert_layer / (ep * tp)
    params = dense + expert
    state = params * 2 + params * 4 + dense * 12 / dp + expert * 12 / edp
    # training activations with full recompute, one 10240-token micro-batch in flight on the last stage: each layer's
    # input (2h bytes per token, split over TP by sequence parallelism), plus fp32 logits and their gradient
    tokens = 10240
    # the update's logits: bf16 logits, the fp32 softmax kept for the backward, the entropy metric's fp32 copy,
    # shifted logits, exponentials and product
    activations = tokens * 2 * h / tp * (layers // pp) + tokens * vocab / tp * (2 + 4 + 4 + 4 + 4 + 4)
    hand = (state + activations) * 1.05 + 1 * GIB  # allocator reserve over the trainer's bytes, CUDA context
    assert report.fits, report.text
    assert abs(report.per_gpu_bytes - hand) / hand < 0.10, (report.per_gpu_bytes / GIB, hand / GIB)
    # engine TP8 with EP8: each engine rank receives 1/8 of the experts and 1/8 of the dense tensors
    total = layers * (attn + expert_layer) + 2 * vocab * h
    assert abs(report.sync_bytes_per_engine_rank - total * 2 / 8) / (total * 2 / 8) < 0.01


def test_planner_uses_the_sync_plan():
    cfg, report = _plan("grpo_qwen3_235b_a22b.yaml", 12, 8, 141)
    hf = json.loads(_config("grpo_qwen3_235b_a22b.yaml").read_text())
    plan = build_plan(hf, 4, 2, 8, world=cfg.world_size, engine_tp=8, engine_ep=8, replicas=4, separate=True)
    sent, received, loaded = plan.traffic()
    assert report.sync_bytes_per_engine_rank == max(loaded.values())
    # Ray engines are placed separately: an engine GPU receives its whole shard from the trainer GPUs
    assert received == loaded and min(received) == cfg.world_size
    assert abs(report.sync_seconds_lower_bound - max(received.values()) / 50e9) < 1e-9


def test_a_layout_that_cannot_fit_is_refused_with_the_reason():
    _, report = _plan("ppo_llama3_70b.yaml", 8, 8, 80, ["parallelism.use_distributed_optimizer=false"])
    assert not report.fits
    reason = report.reasons[0]
    assert reason.startswith("memory:") and "over by" in reason and "optimizer" in reason, reason
    assert "use_distributed_optimizer=true saves" in reason
    # the same verdict from the command line, with exit code 1
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "plan", "recipes/ppo_llama3_70b.yaml", "--nodes", "8",
                        "--gpus-per-node", "8", "parallelism.use_distributed_optimizer=false"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verdict: DOES NOT FIT" in r.stdout and "over by" in r.stdout


def test_too_few_gpus_for_trainer_and_ray_engines_is_refused():
    _, report = _plan("grpo_qwen3_235b_a22b.yaml", 8, 8, 141)
    assert not report.fits
    assert any(x.startswith("GPUs:") and "96" in x for x in report.reasons), report.reasons


@pytest.mark.parametrize("recipe,nodes,mem", [("ppo_llama3_70b.yaml", 16, 80), ("grpo_qwen3_235b_a22b.yaml", 12, 141)])
def test_large_recipes_fit_where_they_are_planned(recipe, nodes, mem):
    _, report = _plan(recipe, nodes, 8, mem)
    assert report.fits, report.text


def test_offload_around_rollout_is_counted_and_grows_the_kv_cache():
    _, base = _plan("ppo_llama3_70b.yaml", 16, 8, 80)
    _, off = _plan("ppo_llama3_70b.yaml", 16, 8, 80, ("actor.offload=true", "critic.offload=true", "ref.offload=true"))
    # hand calculation as above: stage 0, 1/TP of 20 layers and the embedding
    h, layers, q, kv, f, vocab = 8192, 80, 64 * 128, 8 * 128, 28672, 128256
    params = (layers // 4 * (h * q + 2 * h * kv + q * h + 3 * h * f) + vocab * h) / 8
    state = params * 2 + params * 4 + params * 12 / 4
    hand = 2 * state + params * 2  # actor and critic states, the reference's parameters
    assert abs(off.offloaded_bytes - hand) / hand < 0.10, (off.offloaded_bytes / GIB, hand / GIB)
    assert base.offloaded_bytes == 0
    rollout = {r.text.split("phases: ")[1].split(" GiB")[0]: r for r in (base, off)}
    before, after = (float(t.split("generate ")[1].split(",")[0]) for t in rollout)
    # what leaves the GPU, less the allocator's reserve over it
    assert abs((before - after) - off.offloaded_bytes * 1.05 / GIB) < 0.15, (before, after)
    assert "the engine's KV cache can grow by" in off.text and "rollout.gpu_memory_utilization up to" in off.text


def test_offload_takes_verl_style_booleans_per_state():
    from megarl.validate import load_config

    cfg = load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", ["actor.offload.optimizer=true", "ref.offload=true"])
    assert (cfg.actor.offload.params, cfg.actor.offload.grads, cfg.actor.offload.optimizer) == (False, False, True)
    cfg = load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", ["actor.offload=true"])
    assert cfg.actor.offload.params and cfg.actor.offload.grads and cfg.actor.offload.optimizer


def test_reward_model_parameters_are_counted():
    # a reward model of the policy's shape at the trainer's layout: its stage-0 shard, bf16, frozen (no grads/optim)
    _, base = _plan("ppo_llama3_70b.yaml", 16, 8, 80)
    _, with_rm = _plan("ppo_llama3_70b.yaml", 16, 8, 80, ("reward.reward_model.enable=true",
                                                           "reward.reward_model.path=not/written/yet"))
    h, layers, q, kv, f, vocab = 8192, 80, 64 * 128, 8 * 128, 28672, 128256
    rm_stage0 = (layers // 4 * (h * q + 2 * h * kv + q * h + 3 * h * f) + vocab * h) / 8 * 2
    assert "reward model parameters" in with_rm.text
    added = with_rm.per_gpu_bytes - base.per_gpu_bytes
    assert abs(added - rm_stage0 * 1.05) / rm_stage0 < 0.01, (added / GIB, rm_stage0 / GIB)  # + allocator reserve


@pytest.mark.parametrize("pp,vpp", [(2, 1), (2, 2), (4, 2), (4, 3)])
def test_in_flight_activations_follow_megatrons_schedule(pp, vpp):
    """The planner's peak layer activations per stage against megatron-core's own warm-up counts
    (get_pp_rank_microbatches): warm-up forwards plus the first steady-state one, each through one chunk of
    layers / (PP * VPP) layers, or every forward when all are warm-up."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from megarl.plan import in_flight_layers

    layers_per_stage = 24 // pp
    for m in (pp, 2 * pp, 8 * pp):
        for stage in range(pp):
            group = SimpleNamespace(size=lambda: pp, rank=lambda s=stage: s)
            comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
            total, all_warm, warm, _ = get_pp_rank_microbatches(m, vpp, pp, p2p_communicator=comm)
            chunks = total if all_warm else warm + 1
            assert in_flight_layers(pp, vpp, stage, m, layers_per_stage) == chunks * layers_per_stage / vpp


def test_virtual_pipeline_stages_cost_activation_memory_in_the_plan():
    _, base = _plan("ppo_llama3_70b.yaml", 16, 8, 80, ["model.recompute=none"])
    _, vpp = _plan("ppo_llama3_70b.yaml", 16, 8, 80, ["model.recompute=none",
                                                       "parallelism.virtual_pipeline_model_parallel_size=2"])
    assert "PP4 x VPP2 (interleaved 1F1B)" in vpp.text
    train = [float(t.split("update ")[1].split(",")[0]) for t in (base.text, vpp.text)]
    # stage 0 at PP4: 1F1B holds 4 micro-batches through 20 layers (80), interleaved 11 chunks of 10 layers (110)
    assert train[1] > train[0], train


def test_a_reward_model_is_counted_from_its_own_config(tmp_path):
    # a reward model smaller than the policy: Llama of hidden 4096, 40 layers, 32 heads / 8 KV heads of 128, FFN 14336
    from safetensors.numpy import save_file

    import numpy as np

    h, layers, q, kv, f, vocab = 4096, 40, 32 * 128, 8 * 128, 14336, 128256
    hf = json.loads(_config("ppo_llama3_70b.yaml").read_text())
    hf.update(architectures=["LlamaForSequenceClassification"], num_labels=1, hidden_size=h, num_hidden_layers=layers,
              num_attention_heads=32, num_key_value_heads=8, intermediate_size=f)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file({"score.weight": np.zeros((1, h), np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text("{}")  # validate refuses a reward model without its tokenizer files
    _, base = _plan("ppo_llama3_70b.yaml", 16, 8, 80)
    _, with_rm = _plan("ppo_llama3_70b.yaml", 16, 8, 80, ("reward.reward_model.enable=true",
                                                           f"reward.reward_model.path={tmp_path}"))
    # its stage-0 shard at the trainer's TP8 x PP4, bf16: 10 layers and the embedding, 1/8 of each (norms negligible)
    rm_stage0 = (layers // 4 * (h * q + 2 * h * kv + q * h + 3 * h * f) + vocab * h) / 8 * 2
    added = with_rm.per_gpu_bytes - base.per_gpu_bytes
    assert abs(added - rm_stage0 * 1.05) / rm_stage0 < 0.01, (added / GIB, rm_stage0 / GIB)  # + allocator reserve


def test_a_config_json_that_does_not_parse_is_named_with_its_key(tmp_path):
    from types import SimpleNamespace

    from megarl.plan import PlanError
    from megarl.plan.model import read_model_config

    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 8,')
    with pytest.raises(PlanError) as err:
        read_model_config(SimpleNamespace(model=SimpleNamespace(config_path=str(bad), path=None)))
    message = str(err.value)
    assert message.startswith("model.config_path: ") and str(bad) in message and "not valid JSON" in message
    assert "\n" not in message
