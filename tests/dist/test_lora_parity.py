"""LoRA parity: megarl's adapters on megatron's parallel linears give the logprobs of HF transformers + PEFT.

`megarl verify --hf BASE --lora ADAPTER` loads a PEFT-made adapter directory onto the base on both sides. The adapters
are random and non-zero (A and B), so every projection's adapter moves the logprobs; the llama adapter targets a subset
of the fused q/k/v and gate/up projections (zero blocks for the others), the MoE model runs at EP2.
"""
import pytest
import torch

from megarl import verify
from megarl.hf_reference import hf_logprobs
from tests.helpers.bounds import verify_bound
from tests.helpers.tiny_models import make_peft_adapter, make_tiny_model

pytestmark = pytest.mark.parity
CASES = {
    "qwen2": ("qwen2", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "llama": ("llama", ("q_proj", "v_proj", "up_proj", "down_proj")),
    # transformers keeps MoE experts as fused 3D tensors, which PEFT does not target by module name: attention here
    "moe": ("qwen3_moe", ("q_proj", "k_proj", "v_proj", "o_proj")),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for name, (arch, targets) in CASES.items():
        base = make_tiny_model(arch, root / name)
        out[name] = (str(base), str(make_peft_adapter(base, root / f"{name}-adapter", target_modules=targets)))
    return out


@pytest.mark.parametrize("case,layout", [
    pytest.param("qwen2", [], id="tp1", marks=pytest.mark.slow),
    pytest.param("llama", ["--tp", "2"], id="tp2"),
    pytest.param("llama", ["--pp", "2"], id="pp2", marks=pytest.mark.slow),
    pytest.param("moe", ["--ep", "2"], id="moe-ep2", marks=pytest.mark.parity_repeat),
    # LoRA at context parallelism: the adapters are per-token linears, each CP rank applies them to its own chunks
    pytest.param("qwen2", ["--cp", "2"], id="cp2", marks=pytest.mark.parity_repeat)])
def test_verify_lora_matches_peft(models, case, layout, capsys):
    base, adapter = models[case]
    code = verify.main(["--hf", base, "--lora", adapter, "--batch", "3", "--seq-len", "40"] + layout)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "HF+PEFT" in out
    diff = float(out.split("max abs logprob difference ")[1].split()[0])
    tol = verify_bound(base, 40, 3, lora=adapter)  # HF + PEFT's logits; the MoE case adapts attention only
    print(f"[measured] {case} {' '.join(layout)}: megarl vs HF+PEFT {diff:.2e} (bound {tol:.2e})")
    assert diff <= tol, out
    # the adapter matters: the adapted logprobs are far from the base's (the comparison above is not vacuous)
    tokens, lengths, _ = verify.make_batch(base, 301, 3, 40)
    moved = (hf_logprobs(base, tokens, lora=adapter) - hf_logprobs(base, tokens)).abs().max().item()
    assert moved > 1e-2, moved
