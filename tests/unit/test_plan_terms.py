"""`megarl plan`'s memory terms, each against a hand calculation written here from its formula (not calls into the
term's own code), and the one KV-bytes formula the planner and the engine's start check share."""
import json
from pathlib import Path

from megarl.bridge.hf_config import spec_from_dict, spec_kv_cache_bytes_per_token
from megarl.rollout.engine_args import kv_bytes_per_token

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
