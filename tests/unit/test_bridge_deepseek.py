"""DeepSeek-V3 / GLM-4.5 in the bridge without megatron: config parsing and refusals, the MLA mapping's names, shapes
and rope-row layout, uneven pipeline stages, validate's architecture check, MTP layers skipped on import."""
import json

import pytest
import torch

from megarl.bridge import BridgeError, Mapping, SafetensorsCheckpoint, check_checkpoint, check_layout, load_spec
from megarl.bridge import spec_from_dict
from megarl.bridge.mapping import ROPE
from megarl.layout import Layout, layer_stages, stage_layer_counts
from tests.helpers.tiny_models import SIGMOID_MOE_ARCHS, make_tiny_model, read_checkpoint

DSV3 = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, vocab_size=100, q_lora_rank=48,
            kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=1,
            rope_scaling={"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_dsv3")
    return {a: make_tiny_model(a, root / a, seed=i, tokenizer=False) for i, a in enumerate(SIGMOID_MOE_ARCHS)}


def test_specs(tiny_dirs):
    ds, noq, glm = (load_spec(tiny_dirs[a]) for a in SIGMOID_MOE_ARCHS)
    assert ds.mla.q_lora_rank == 48 and ds.mla.kv_cache_elements_per_token() == 576 and ds.head_dim == 96
    assert ds.rope.type == "yarn" and ds.rope.factor == 4.0 and ds.rope.mscale_all_dim == 1.0
    assert (ds.router.num_groups, ds.router.group_topk, ds.router.scaling_factor) == (4, 2, 2.5)
    assert ds.moe_layers == (False, True, True, True) and ds.shared_expert_ffn_hidden_size == 32
    assert noq.mla.q_lora_rank is None and noq.moe_layers == (False, False, True, True)
    assert noq.shared_expert_ffn_hidden_size == 64  # n_shared_experts=2 x moe_intermediate_size
    assert glm.mla is None and glm.rope.partial == 0.5 and glm.qkv_bias and glm.qk_layernorm
    assert glm.router.scaling_factor == 1.5 and glm.num_key_value_heads == 2


def test_mapping_names_match_the_checkpoints(tiny_dirs):
    for arch, d in tiny_dirs.items():
        spec = load_spec(d)
        mapping = Mapping(spec)
        on_disk = {k: tuple(v.shape) for k, v in read_checkpoint(d).items()}
        assert mapping.hf_shapes() == on_disk, arch
    names = {e.megatron for e in Mapping(load_spec(tiny_dirs["deepseek_v3"])).entries}
    assert {"decoder.layers.0.self_attention.linear_q_down_proj.weight",
            "decoder.layers.0.self_attention.q_layernorm.weight",
            "decoder.layers.0.self_attention.kv_layernorm.weight",
            "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"} <= names


def test_half_rotated_rope_rows_are_interleaved_for_megatron():
    """megatron-core's MLA reads the rope dims as interleaved pairs; a rope_interleave=false checkpoint's
    [a0..a3, b0..b3] rows must reach megatron as [a0, b0, a1, b1, ...], and back unchanged, at any TP."""
    spec = spec_from_dict(dict(DSV3, rope_interleave=False, kv_lora_rank=8, qk_rope_head_dim=8, q_lora_rank=None))
    mapping = Mapping(spec)
    entry = mapping.by_hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert entry.kind == ROPE
    hf = torch.arange(16.0)[:, None].repeat(1, 3)  # rows 0..7 latent, 8..15 rope = a0..a3 (8..11), b0..b3 (12..15)
    whole = mapping.to_megatron(entry, [hf], 1)
    assert whole[:, 0].tolist() == list(range(8)) + [8, 12, 9, 13, 10, 14, 11, 15]
    shards = [mapping.to_megatron(entry, [hf[r * 8:(r + 1) * 8]], 2, r) for r in range(2)]
    assert torch.equal(torch.cat(shards), whole)
    assert torch.equal(mapping.to_hf(entry, shards)[0][1], hf)
    assert torch.equal(mapping.shard_to_hf(entry, shards[1], 1, 2)[0][1], hf[8:])
    q = mapping.by_hf["model.layers.0.self_attn.q_proj.weight"]  # per head: 32 nope rows then 8 rope rows
    qh = torch.arange(4 * 40.0)[:, None]
    qm = mapping.to_megatron(q, [qh], 1)
    assert qm[40 + 32:80, 0].tolist() == [72, 76, 73, 77, 74, 78, 75, 79]
    with pytest.raises(BridgeError, match="rope rows"):
        check_layout(spec, tp=4)  # 16 rows over 4 ranks would split the 8 rope rows


def test_interleaved_checkpoints_map_plainly():
    spec = spec_from_dict(DSV3)
    assert all(e.kind != ROPE for e in Mapping(spec).entries)
    check_layout(spec, tp=4, pp=2, ep=8)  # the latents split over TP too (576 rows)


@pytest.mark.parametrize("change,needle", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(num_experts_per_tok=6), "num_experts_per_tok=6 // topk_group=2 must be 2"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_type='llama3'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                        "mscale_all_dim": 1.0}), "mscale_all_dim=1.0 without mscale"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim=63 must be even"),
])
def test_refusals_name_the_field(change, needle):
    with pytest.raises(BridgeError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        spec_from_dict(dict(DSV3, **change))


def test_glm_refuses_partial_rotary_elsewhere():
    with pytest.raises(BridgeError, match="partial_rotary_factor=0.5"):
        spec_from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=128, vocab_size=100, partial_rotary_factor=0.5))


def test_mtp_layers_are_skipped_on_import_and_said_so(tiny_dirs, tmp_path, caplog):
    """A DeepSeek-V3 checkpoint carries num_nextn_predict_layers MTP layers after the decoder (model.layers.N.*)."""
    import shutil

    from safetensors.torch import save_file

    d = tmp_path / "mtp"
    shutil.copytree(tiny_dirs["deepseek_v3"], d)
    save_file({"model.layers.4.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.4.self_attn.kv_b_proj.weight": torch.zeros(256, 512)}, str(d / "mtp.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({"model.layers.4.eh_proj.weight": "mtp.safetensors",
                                   "model.layers.4.self_attn.kv_b_proj.weight": "mtp.safetensors"})
        index.write_text(json.dumps(data))
    spec = load_spec(d)
    with caplog.at_level("WARNING"):
        check_checkpoint(Mapping(spec), SafetensorsCheckpoint(d))
    assert "2 multi-token-prediction tensors" in caplog.text and "skipped" in caplog.text
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0  # then they are unexpected tensors
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BridgeError, match="model.layers.4"):
        check_checkpoint(Mapping(load_spec(d)), SafetensorsCheckpoint(d))


def test_uneven_stages():
    assert stage_layer_counts(61, 16, 1, 4) == [1] + [4] * 14 + [4]
    assert stage_layer_counts(61, 16, None, 1) == [4] * 15 + [1]
    assert stage_layer_counts(4, 2, 1) == [1, 3]
    assert layer_stages([1, 3]) == [0, 1, 1, 1]
    assert Layout(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1).stage_layers(4) == [1, 3]
    with pytest.raises(ValueError, match="num_layers_in_first_pipeline_stage=2"):
        stage_layer_counts(61, 16, 2, 4)  # 55 over 14
    with pytest.raises(ValueError, match="pipeline_model_parallel_size > 1"):
        stage_layer_counts(4, 1, 2)
    spec = spec_from_dict(DSV3)
    with pytest.raises(BridgeError, match="pipeline_model_parallel_size=2"):
        check_layout(spec, pp=2, first_stage=4)
    check_layout(spec, pp=2, first_stage=1)
    with pytest.raises(BridgeError, match="pipeline_model_parallel_size=3 does not divide"):
        check_layout(spec, pp=3)


def test_sync_plan_follows_uneven_stages(tiny_dirs):
    from megarl.sync.shards import layout_owners

    mapping = Mapping(load_spec(tiny_dirs["glm4_moe"]))
    even = layout_owners(mapping, 1, 2, 1, 2)
    uneven = layout_owners(mapping, 1, 2, 1, 2, stage_layers=[1, 3])
    name = "decoder.layers.1.self_attention.linear_proj.weight"
    assert even[name] == [(0, 0, 1)] and uneven[name] == [(1, 0, 1)]  # layer 1 moves to the second stage
    assert uneven["decoder.layers.0.self_attention.linear_proj.weight"] == [(0, 0, 1)]


def test_validate_checks_the_architecture(tmp_path):
    """`megarl validate` reads config.json (model.config_path or model.path) and refuses what the bridge cannot map,
    naming the supported list; DeepSeek-V3 is accepted."""
    from pathlib import Path

    from megarl.config import ConfigError
    from megarl.validate import load_config

    root = Path(__file__).resolve().parents[2]
    recipe = root / "recipes" / "grpo_deepseek_v3_671b.yaml"
    load_config(recipe)  # valid, DeepSeek-V3's config.json included
    cfg = json.loads((root / "recipes" / "models" / "deepseek_v3" / "config.json").read_text())
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [f"model.config_path={tmp_path / 'config.json'}"])
    text = str(err.value)
    assert "model.config_path = 'Qwen3NextForCausalLM'" in text and "DeepseekV3ForCausalLM" in text
    cfg = json.loads((root / "recipes" / "models" / "deepseek_v3" / "config.json").read_text())
    cfg["kv_lora_rank"] = 510  # 510 + 64 latent rows do not split over TP4 (megatron column-splits them)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        load_config(recipe, [f"model.config_path={tmp_path / 'config.json'}", "parallelism.tensor_model_parallel_size=4"])
