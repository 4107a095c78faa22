"""LoRA targets (pure): HF/PEFT names resolved through the bridge mapping, refusals by name, and what `megarl plan`
and `megarl validate` say about a LoRA actor. Expected numbers are derived by hand from the model shapes."""
from pathlib import Path

import pytest

from megarl.bridge.hf_config import spec_from_dict
from megarl.bridge.mapping import Mapping
from megarl.lora.targets import LoraError, LoraSettings, adapter_numel, resolve_targets, stage_adapter_numel
from megarl.validate import load_config
from tests.helpers.tiny_models import tiny_config

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3


def _mapping(arch: str) -> Mapping:
    from tests.helpers.tiny_models import TINY_PRESETS

    return Mapping(spec_from_dict({**tiny_config(arch).to_dict(), "architectures": [TINY_PRESETS[arch][1]]}))


def test_fused_projections_become_peft_per_projection_adapters():
    # qwen2 tiny: hidden 128, 4 heads of 32, 2 KV heads, ffn 256, 4 layers
    targets = resolve_targets(_mapping("qwen2"), LoraSettings(rank=8, target_modules=("q_proj", "v_proj", "down_proj")))
    by = {t.hf_weight: t for t in targets.targets}
    assert len(targets.targets) == 3 * 4
    q, v = by["model.layers.0.self_attn.q_proj.weight"], by["model.layers.0.self_attn.v_proj.weight"]
    assert q.entry.megatron == v.entry.megatron == "decoder.layers.0.self_attention.linear_qkv.weight"
    assert (q.slot, v.slot) == (0, 2) and q.parallel == "column" and q.split() == ("B", 0)
    assert q.shapes(8) == {"A": (8, 128), "B": (128, 8)} and v.shapes(8) == {"A": (8, 128), "B": (64, 8)}
    down = by["model.layers.3.mlp.down_proj.weight"]
    assert down.parallel == "row" and down.split() == ("A", 1) and down.shapes(8) == {"A": (8, 256), "B": (128, 8)}
    assert q.peft_key("A") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    # per layer: q 8*(128+128) + v 8*(128+64) + down 8*(256+128)
    assert adapter_numel(targets, 8) == 4 * (2048 + 1536 + 3072)


def test_all_linear_and_experts_per_expert():
    targets = resolve_targets(_mapping("mixtral"), LoraSettings(rank=4, target_modules="all-linear"))
    projections = {t.projection for t in targets.targets}
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    experts = [t for t in targets.targets if t.expert]
    assert len(experts) == 4 * 4 * 3  # layers x experts x (w1, w3, w2)
    keys = {t.peft_key("B") for t in experts}
    assert "base_model.model.model.layers.0.block_sparse_moe.experts.3.w1.lora_B.weight" in keys
    # Mixtral's own names select the same adapters
    alias = resolve_targets(_mapping("mixtral"), LoraSettings(rank=4, target_modules=("w1", "w2", "w3")))
    assert {t.hf_weight for t in alias.targets} == {t.hf_weight for t in experts}
    # EP2 holds half the experts' adapters; TP2 halves each column B and row A
    full = stage_adapter_numel(alias, 4, 1, 1, 1)
    assert stage_adapter_numel(alias, 4, 1, 1, 2) == [full[0] // 2]
    assert stage_adapter_numel(alias, 4, 1, 2, 1) == [full[0] // 2, full[0] // 2]


def test_unknown_module_and_too_large_rank_are_refused_by_name():
    with pytest.raises(LoraError, match="'lm_head' is not a linear of Qwen2ForCausalLM"):
        resolve_targets(_mapping("qwen2"), LoraSettings(rank=8, target_modules=("q_proj", "lm_head")))
    with pytest.raises(LoraError, match=r"actor.lora.rank=65: larger than v_proj .* \(rank at most 64\)"):
        resolve_targets(_mapping("qwen2"), LoraSettings(rank=65, target_modules=("q_proj", "v_proj")))


def test_validate_refuses_lora_settings_by_key():
    config = ROOT / "recipes" / "models" / "llama3_70b" / "config.json"
    with pytest.raises(Exception) as err:
        load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml",
                    [f"model.config_path={config}", "actor.lora.rank=2048", "actor.lora.target_modules=all-linear"])
    assert "actor.lora.rank = 2048: larger than k_proj" in str(err.value)
    with pytest.raises(Exception) as err:
        load_config(ROOT / "recipes" / "grpo_lora_tiny_cpu.yaml", ["actor.lora.target_modules=[q_proj,qkv_proj]"])
    assert "['qkv_proj'] are not LoRA target modules" in str(err.value)


def test_plan_of_a_lora_70b_actor_has_no_base_gradients_or_optimizer():
    from megarl.plan import plan_recipe

    config = ROOT / "recipes" / "models" / "llama3_70b" / "config.json"
    extra = [f"model.config_path={config}", "trainer.nnodes=16", "trainer.n_gpus_per_node=8"]
    full = plan_recipe(load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml", extra), 16, 8)
    cfg = load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml",
                      extra + ["actor.lora.rank=64", "actor.lora.target_modules=all-linear"])
    lora = plan_recipe(cfg, 16, 8)
    # Llama-3-70B: hidden 8192, 64 heads x 128, 8 KV heads, ffn 28672, 80 layers; rank 64 on all 7 projections
    per_layer = 64 * ((8192 + 8192) * 2 + (8192 + 1024) * 2 + (8192 + 28672) * 3)
    assert f"{80 * per_layer / 1e6:.1f} M adapter parameters" in lora.text
    assert lora.terms["actor gradients (fp32)"] < 0.4 < full.terms["actor gradients (fp32)"]
    assert lora.terms["actor Adam moments (distributed)"] + lora.terms["actor fp32 master copy (distributed)"] < 0.3
    assert lora.sync_bytes_per_engine_rank == full.sync_bytes_per_engine_rank  # merged sync: the engine's shards
    assert "weight sync (bfloat16), per sync" in lora.text
