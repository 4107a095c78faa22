"""A bf16 build holds no float32 parameter (megatron's torch-norm fallback left every RMSNorm weight float32, so each
norm cast activations up and back), for dense and MoE models, the critic's value head included, and its core attention
is megarl's SDPA module. The Transformer Engine spec is checked on a GPU (`make test-gpu`)."""
import pytest

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import make_tiny_model


def build_rank(dirs, use_te):
    import torch

    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(), seed=0)
    out = {}
    for name, (d, critic) in dirs.items():
        model, _ = build_and_load(d, dtype=torch.bfloat16, value_head=critic, use_te=use_te)
        out[name] = {"not_bf16": [n for n, p in model.named_parameters() if p.dtype != torch.bfloat16],
                     "attention": {type(m).__name__ for n, m in model.named_modules() if n.endswith("core_attention")},
                     "params": sum(1 for _ in model.parameters())}
    return out


def _dirs(tmp_path):
    return {"qwen3 (qk norm)": (str(make_tiny_model("qwen3", tmp_path / "qwen3")), False),
            "qwen2_moe (router, shared expert gate)": (str(make_tiny_model("qwen2_moe", tmp_path / "qwen2_moe")), False),
            "llama critic": (str(make_tiny_model("llama", tmp_path / "llama")), True)}


def test_bf16_build_without_te_holds_no_float32_parameter(tmp_path):
    (r,) = run_ranks(f"{__name__}:build_rank", 1, {"dirs": _dirs(tmp_path), "use_te": False}, timeout=300)
    for name, got in r.items():
        assert got["params"] > 0 and got["not_bf16"] == [], (name, got)
        assert got["attention"] == {"SDPAttention"}, (name, got)


@pytest.mark.gpu
def test_bf16_build_with_te_holds_no_float32_parameter(tmp_path):
    from megarl.megatron.model import te_available

    if not te_available():  # the no-TE half of `make gpu-check` (MEGARL_USE_TE=0), or a machine without TE
        pytest.skip("Transformer Engine is not in use here (not importable, or MEGARL_USE_TE=0)")
    (r,) = run_ranks(f"{__name__}:build_rank", 1, {"dirs": _dirs(tmp_path), "use_te": True}, timeout=300)
    for name, got in r.items():
        assert got["params"] > 0 and got["not_bf16"] == [], (name, got)
        assert got["attention"] == {"TEDotProductAttention"}, (name, got)


def fused_swiglu_rank(hf_dir, tokens):
    import torch

    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load, fusion_settings
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(), seed=0)
    model, _ = build_and_load(hf_dir, dtype=torch.float32, bias_activation_fusion=True)
    return {"fused": model.config.bias_activation_fusion, "logprobs": token_logprobs(model, tokens, 2),
            "reasons": {k: v for k, v in fusion_settings(use_te=False).items()},
            "state": model.megarl_fusions}


@pytest.mark.parity
def test_fusions_are_off_with_their_reason_on_cpu_and_fused_swiglu_keeps_parity(tmp_path):
    """On CPU every fusion is off with its reason (no TE, no CUDA); megatron's fused SwiGLU (what model.fusions turns
    on with CUDA) gives HF's logprobs when forced on."""
    from tests.helpers.bounds import logprob_bound
    from tests.helpers.tiny_models import hf_logprobs, sample_tokens

    hf_dir = str(make_tiny_model("llama", tmp_path / "llama"))
    tokens, lengths = sample_tokens(2, 16, seed=1)
    (r,) = run_ranks(f"{__name__}:fused_swiglu_rank", 1, {"hf_dir": hf_dir, "tokens": tokens}, timeout=300)
    assert r["fused"]
    mask = tokens[:, 1:] != 0
    diff = (r["logprobs"] - hf_logprobs(hf_dir, tokens)).abs()[mask].max().item()
    tol = logprob_bound(hf_dir, tokens, mask)
    print(f"[measured] fused SwiGLU vs HF {diff:.2e} (bound {tol:.2e})")
    assert diff < tol, (diff, tol)
    assert all(not on and reason for on, reason in r["reasons"].values()), r["reasons"]
    assert "Transformer Engine" in r["reasons"]["apply_rope_fusion"][1]
