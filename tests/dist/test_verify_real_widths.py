"""`megarl verify` in float32 at real models' widths: a right mapping passes its derived bound, a wrong one fails it.

Random models with the hidden size, head widths, MLP widths and vocabulary of released checkpoints, with the layers
cut to 2 and the experts to 8 (a 24 GiB machine), at TP2 (dense) or EP2 (MoE). The tolerance is the one `megarl
verify` derives from the model (megarl.numerics); a fixed 1e-5 failed four of these five on the CPU although the
mapping was right (accumulation order over a 2048-wide hidden state and a 152k vocabulary).
Weights are N(0, 0.02) (HF's initializer_range): the logits then have the RMS of a trained model's order (~1).
"""
import re

import pytest

from megarl.launch_local import run_ranks
from megarl.verify import main
from tests.helpers.tiny_models import make_tiny_model

# `parity` (the AVX2 tier) marks the tests whose bound depends on rounding;
# a wrong mapping misses by orders of magnitude on any kernels

# name -> (tiny preset, the released model's widths, layout flags)
REAL = {
    "Qwen2.5-0.5B": ("qwen2", dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True), ["--tp", "2"]),
    "Qwen3-0.6B": ("qwen3", dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True), ["--tp", "2"]),
    "Llama-3.2-1B": ("llama", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                                   intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                                   rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                     ["--tp", "2"]),
    "Qwen3-30B-A3B": ("qwen3_moe", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        intermediate_size=6144, moe_intermediate_size=768, num_experts=8,
                                        num_experts_per_tok=8, vocab_size=151936), ["--ep", "2"]),
    # DeepSeek-V3's architecture at Moonlight-16B-A3B's widths (no q LoRA, 64 experts top-6 cut to 8)
    "Moonlight-16B-A3B": ("deepseek_v3_noqlora", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=8,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.446,
        vocab_size=163840), ["--ep", "2"]),
}


def _make(name, root):
    arch, widths, _ = REAL[name]
    return str(make_tiny_model(arch, root / name, init_std=0.02, max_shard_size="2GB", tokenizer=False,
                               num_hidden_layers=2, max_position_embeddings=4096, **widths))


def _verdict(out: str) -> tuple:
    m = re.search(r"max abs logprob difference (\S+) \(megarl vs HF, tolerance (\S+), derived", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "Qwen2.5-0.5B"
                                               else pytest.mark.slow) for n in REAL])
@pytest.mark.parity
def test_float32_verify_passes_at_real_widths(name, tmp_path, capsys):
    hf_dir = _make(name, tmp_path)
    code = main(["--hf", hf_dir, *REAL[name][2], "--seq-len", "48", "--batch", "3"])
    out = capsys.readouterr().out
    diff, tol = _verdict(out)
    print(f"{name}: max diff {diff:.2e}, derived tolerance {tol:.2e}, margin {tol / diff:.1f}x")
    assert code == 0, out
    assert 1e-5 <= tol <= 1e-3  # the bound is neither vacuous nor below float32's reach at these widths


def _swap_gate_up(src: str) -> None:
    """Swap layer 0's gate and up projections in place: what a bridge that mixed up the fused fc1 halves would load."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    for f in Path(src).glob("*.safetensors"):
        sd = load_file(f)
        gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
        if gate in sd and up in sd:
            sd[gate], sd[up] = sd[up].clone(), sd[gate].clone()
            save_file(sd, f, metadata={"format": "pt"})
            return
    raise AssertionError("layer 0's gate/up projections not found")


def test_a_wrong_mapping_misses_the_derived_bound_by_orders_of_magnitude(tmp_path):
    from megarl import hf_reference, verify
    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_bound

    good = _make("Qwen2.5-0.5B", tmp_path / "good")
    bad = _make("Qwen2.5-0.5B", tmp_path / "bad")
    _swap_gate_up(bad)
    spec = load_spec(good)
    tokens, lengths, _ = verify.make_batch(good, spec.vocab_size, 3, 48)
    hf, stats = hf_reference.hf_logprobs(good, tokens, lengths)
    tol = fp32_bound(spec, tokens.shape[1], int(hf_reference.real_mask(lengths, hf.shape[1]).sum()), stats.rms)
    got = run_ranks("megarl.verify:_rank_body", 2, {"hf_dir": bad, "tokens": tokens, "tp": 2}, timeout=600)
    diff, _ = verify.compare(hf, next(r["megatron"] for r in got if r["megatron"] is not None), lengths)
    print(f"wrong mapping: max diff {diff:.2e}, derived tolerance {tol:.2e}, ratio {diff / tol:.0f}x")
    assert diff > 100 * tol, (diff, tol)
