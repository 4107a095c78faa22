"""The bridge without megatron: config parsing, the mapping's layouts, and checkpoint errors that name the culprit."""
import json
import shutil

import pytest
import torch

from megarl.bridge import BridgeError, Mapping, SafetensorsCheckpoint, check_checkpoint, check_layout, load_spec
from megarl.bridge import padded_vocab_size, spec_from_dict
from megarl.bridge.mapping import canonical_name, globalize
from tests.helpers.tiny_models import ARCHS, make_tiny_model, read_checkpoint


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_unit")
    return {a: make_tiny_model(a, root / a, seed=i, tokenizer=False) for i, a in enumerate(ARCHS)}


def test_specs_of_every_architecture(tiny_dirs):
    s = {a: load_spec(d) for a, d in tiny_dirs.items()}
    assert s["llama"].rope.type == "llama3" and s["llama"].rope.original_max_position_embeddings == 64
    assert (s["llama"].num_key_value_heads, s["llama"].head_dim, s["llama"].tie_word_embeddings) == (2, 32, False)
    assert s["qwen2"].qkv_bias and s["qwen2"].tie_word_embeddings and not s["qwen2"].qk_layernorm
    assert s["qwen3"].qk_layernorm and s["qwen3"].head_dim == 32 and s["qwen3"].hidden_size == 64  # explicit head_dim
    assert s["mistral"].sliding_window == 4096
    assert (s["mixtral"].num_experts, s["mixtral"].moe_topk, s["mixtral"].moe_norm_topk_prob) == (4, 2, True)
    assert s["qwen3_moe"].moe_norm_topk_prob and s["qwen3_moe"].moe_ffn_hidden_size == 32
    q2 = s["qwen2_moe"]
    assert (q2.shared_expert_ffn_hidden_size, q2.shared_expert_gate, q2.moe_norm_topk_prob) == (48, True, False)
    assert q2.moe_layers == (True, False, True, True)  # mlp_only_layers=[1]
    assert all(spec.vocab_size == 301 for spec in s.values())


def test_both_config_dialects_give_the_same_rope():
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=128, vocab_size=100)
    scaling = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    v4 = spec_from_dict(dict(base, rope_theta=500000.0, rope_scaling=dict(scaling, rope_type="llama3")))
    v5 = spec_from_dict(dict(base, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=500000.0)))
    assert v4.rope == v5.rope and v4.rope.theta == 500000.0 and v4.rope.factor == 32.0


@pytest.mark.parametrize("change,needle", [
    (dict(architectures=["GPTNeoXForCausalLM"]), "architecture 'GPTNeoXForCausalLM' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(hidden_size=None), "'hidden_size' is missing"),
    (dict(num_hidden_layers="4"), "'num_hidden_layers'"),
])
def test_config_errors_name_the_field(change, needle):
    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=128, vocab_size=100)
    cfg.update(change)
    with pytest.raises(BridgeError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        spec_from_dict(cfg)


def test_layout_errors_name_the_field(tiny_dirs):
    spec = load_spec(tiny_dirs["llama"])  # 4 heads, 2 kv heads, 4 layers
    with pytest.raises(BridgeError, match="tensor_model_parallel_size=3 does not divide num_attention_heads=4"):
        check_layout(spec, tp=3)
    with pytest.raises(BridgeError, match="tensor_model_parallel_size=4 does not divide num_key_value_heads=2"):
        check_layout(spec, tp=4)
    with pytest.raises(BridgeError, match="pipeline_model_parallel_size=3 does not divide num_hidden_layers=4"):
        check_layout(spec, pp=3)
    with pytest.raises(BridgeError, match="expert_model_parallel_size=2 needs a MoE model"):
        check_layout(spec, ep=2)
    with pytest.raises(BridgeError, match="expert_model_parallel_size=3 does not divide num_experts=4"):
        check_layout(load_spec(tiny_dirs["mixtral"]), ep=3)
    check_layout(load_spec(tiny_dirs["qwen3_moe"]), tp=2, pp=2, ep=4)


def test_padded_vocab():
    assert padded_vocab_size(301, 1) == 384 and padded_vocab_size(301, 2) == 384
    assert padded_vocab_size(301, 3) == 384 and padded_vocab_size(256, 4) == 256 and padded_vocab_size(301, 2, 1) == 302


def test_qkv_interleave_is_megatron_per_group_layout():
    spec = spec_from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=8, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=2, intermediate_size=4,
                               vocab_size=10))
    m = Mapping(spec)
    entry = m.by_megatron["decoder.layers.0.self_attention.linear_qkv.weight"]
    # label every row: q head h -> 100 + h, k group g -> 200 + g, v group g -> 300 + g (head_dim 2 rows each)
    q = torch.tensor([100 + h for h in range(4) for _ in range(2)], dtype=torch.float32)[:, None].expand(8, 8)
    k = torch.tensor([200 + g for g in range(2) for _ in range(2)], dtype=torch.float32)[:, None].expand(4, 8)
    v = torch.tensor([300 + g for g in range(2) for _ in range(2)], dtype=torch.float32)[:, None].expand(4, 8)
    full = m.to_megatron(entry, [q, k, v], tp=1)
    assert full[::2, 0].tolist() == [100, 101, 200, 300, 102, 103, 201, 301]
    shards = [m.to_megatron(entry, [t[slice(*m.hf_chunk_range(entry, i, r, 2)[1:])] for i, t in enumerate((q, k, v))],
                            tp=2) for r in range(2)]
    assert torch.equal(torch.cat(shards), full)  # TP splits contiguously over query groups
    assert [torch.equal(a, b) for (_, a), b in zip(m.to_hf(entry, shards), (q, k, v))] == [True] * 3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2])
def test_shard_and_unshard_is_identity(tiny_dirs, arch, tp):
    """HF -> megatron TP shards (what import reads) -> HF (what export writes) is bitwise the checkpoint."""
    spec = load_spec(tiny_dirs[arch])
    m = Mapping(spec, padded_vocab=padded_vocab_size(spec.vocab_size, tp))
    ckpt = SafetensorsCheckpoint(tiny_dirs[arch])
    ref = read_checkpoint(str(tiny_dirs[arch]))
    out = {}
    for entry in m.entries:
        split = entry.tp_dim is not None
        shards = []
        for r in range(tp if split else 1):
            chunks = [ckpt.read(h, m.hf_chunk_range(entry, i, r, tp if split else 1)) for i, h in enumerate(entry.hf)]
            shard = m.to_megatron(entry, chunks, tp if split else 1)
            assert tuple(shard.shape) == m.megatron_shape(entry, tp if split else 1), entry.megatron
            shards.append(shard)
        out.update(m.to_hf(entry, shards))
    assert sorted(out) == sorted(ref) == sorted(m.hf_names())
    assert all(torch.equal(out[n], ref[n]) for n in ref)


@pytest.mark.parametrize("tp", [1, 2])
def test_to_hf_views_match_the_checkpoint_and_share_memory_where_they_can(tiny_dirs, tp):
    """views=True on shards gathered back to back into one buffer (as the exporter gathers, and a single shard as
    the merger reads): the same values as the checkpoint; dim-0 joins and single shards are views, not copies."""
    spec = load_spec(tiny_dirs["llama"])
    m = Mapping(spec, padded_vocab=padded_vocab_size(spec.vocab_size, tp))
    ckpt = SafetensorsCheckpoint(tiny_dirs["llama"])
    ref = read_checkpoint(str(tiny_dirs["llama"]))
    for entry in m.entries:
        n = tp if entry.tp_dim is not None else 1
        parts = [m.to_megatron(entry, [ckpt.read(h, m.hf_chunk_range(entry, i, r, n)) for i, h in enumerate(entry.hf)],
                               n) for r in range(n)]
        buffer = torch.stack(parts)  # shard r at buffer[r]: back to back
        for name, t in m.to_hf(entry, list(buffer.unbind(0)), views=True):
            assert torch.equal(t, ref[name]), name
            shares = t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            expect = entry.kind != "qkv" and (n == 1 or (entry.tp_dim == 0 and entry.kind != "gate_up"))
            assert shares == expect, (name, entry.kind, entry.tp_dim)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_cuts_of_a_shard_are_views_holding_the_checkpoint_rows(tiny_dirs, arch, tp):
    """The weight sync's compiled cuts (megarl.sync.copies, what every update copies): each HF tensor's chunk that a
    shard holds, cut as row blocks of strided views of the shard (no copy), is the checkpoint's part of it."""
    from megarl.sync.boxes import range_box
    from megarl.sync.copies import compile_cuts

    spec = load_spec(tiny_dirs[arch])
    m = Mapping(spec, padded_vocab=padded_vocab_size(spec.vocab_size, tp))
    ckpt = SafetensorsCheckpoint(tiny_dirs[arch])
    shapes = m.hf_shapes()
    for entry in m.entries:
        n = tp if entry.tp_dim is not None else 1
        for r in range(n):
            ranges = [m.hf_chunk_range(entry, i, r, n) for i in range(len(entry.hf))]
            # contiguous, as a parameter is
            shard = m.to_megatron(entry, [ckpt.read(h, rng) for h, rng in zip(entry.hf, ranges)], n).contiguous()
            boxes = [range_box(shapes[h], rng) for h, rng in zip(entry.hf, ranges)]
            pieces = [(h, box, box, entry, tuple(shard.shape), r, n) for h, box in zip(entry.hf, boxes)
                      if all(b > a for a, b in box)]
            cuts = compile_cuts(m, pieces)
            for name, box, *_ in pieces:
                want = ckpt.read(name, ranges[entry.hf.index(name)])
                cut = cuts[(name, box)]
                for _, _, view in cut.blocks:
                    assert view.of(shard).untyped_storage().data_ptr() == shard.untyped_storage().data_ptr(), name
                assert torch.equal(cut.piece(shard, out=torch.empty_like(want)), want), (name, r)


def _rewrite(src, dst, drop=(), reshape=None, add=None):
    """Copy an HF dir, rewriting its safetensors (keeping the index consistent)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = read_checkpoint(str(dst))
    for f in dst.glob("*.safetensors"):
        f.unlink()
    for name in drop:
        tensors.pop(name)
    if reshape:
        tensors[reshape[0]] = torch.zeros(reshape[1])
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}))
    return dst


def test_checkpoint_errors_name_the_tensor(tiny_dirs, tmp_path):
    src = tiny_dirs["llama"]
    spec = load_spec(src)
    missing = _rewrite(src, tmp_path / "missing", drop=["model.layers.3.mlp.down_proj.weight"])
    with pytest.raises(BridgeError, match=r"model.layers.3.mlp.down_proj.weight: missing from .*index lists 1 files"):
        check_checkpoint(Mapping(spec), SafetensorsCheckpoint(missing))
    shaped = _rewrite(src, tmp_path / "shape", reshape=("model.layers.0.self_attn.q_proj.weight", (64, 128)))
    with pytest.raises(BridgeError, match=r"model.layers.0.self_attn.q_proj.weight has shape \(64, 128\) in the "
                                          r"checkpoint but config.json implies \(128, 128\)"):
        check_checkpoint(Mapping(spec), SafetensorsCheckpoint(shaped))
    extra = _rewrite(src, tmp_path / "extra", add={"model.layers.0.mlp.bias": torch.zeros(3)})
    with pytest.raises(BridgeError, match=r"model.layers.0.mlp.bias"):
        check_checkpoint(Mapping(spec), SafetensorsCheckpoint(extra))
    check_checkpoint(Mapping(spec), SafetensorsCheckpoint(extra), strict=False)
    # a file named by the index that is not there
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    victim = sorted(broken.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(BridgeError, match=f"maps it .* to {victim.name}, which does not exist"):
        SafetensorsCheckpoint(broken)
    # unsupported architecture straight from a directory
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    other = tmp_path / "neox"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BridgeError, match="architecture 'GPTNeoXForCausalLM' is not supported; supported: "):
        load_spec(other)


def test_transformer_engine_names_map_to_the_same_rules():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_name("decoder.layers.1.mlp.experts.linear_fc2.weight7") == \
        "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"
    assert canonical_name("decoder.layers.1.self_attention.linear_qkv.weight") == \
        "decoder.layers.1.self_attention.linear_qkv.weight"
    # PP stage 1 of 2 (layers 2, 3) on EP rank 1 of 2 (experts 2, 3)
    assert globalize("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", lambda i: i + 2, 2) == \
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"


def test_num_parameters_counts_what_transformers_builds(tiny_dirs):
    """The mapping's HF shapes add up to the parameters transformers instantiates (tied embeddings once), for every
    architecture."""
    import transformers

    from megarl.bridge.mapping import num_parameters

    for arch, d in tiny_dirs.items():
        config = transformers.AutoConfig.from_pretrained(d)
        model = getattr(transformers, config.architectures[0])(config)
        assert num_parameters(load_spec(d)) == sum(p.numel() for p in model.parameters()), arch
