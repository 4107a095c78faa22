"""Pure parts of the rollout engine: sampling/engine arguments from the config, prompt overflow, KV sizing,
RolloutBatch, bucketing and checksums. No vLLM import."""
import pytest
import torch

from megarl.config.schema import RolloutConfig, ValKwargs
from megarl.rollout.vllm.engine import PromptTooLongError, apply_prompt_overflow
from megarl.rollout.vllm.engine_args import (EngineStartError, ModelFacts, engine_kwargs, explain_start_failure,
                                             kv_cache_bytes_needed)
from megarl.rollout.sampling import sampling_kwargs
from megarl.sync.weights import (checksums_match, combine_rank_checksums, engine_name, fold_checksums, iter_buckets,
                                 tensor_checksum)
from megarl.types import RolloutBatch

LLAMA = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
         "head_dim": 32}


def test_sampling_kwargs_train_validation_and_greedy():
    cfg = RolloutConfig(temperature=0.7, top_k=20, top_p=0.9, n=4, repetition_penalty=1.1, response_length=64,
                        stop_token_ids=[7], ignore_eos=True, val_kwargs=ValKwargs(temperature=0.5, do_sample=True, n=2))
    kw = sampling_kwargs(cfg)
    assert (kw["n"], kw["temperature"], kw["top_k"], kw["top_p"]) == (4, 0.7, 20, 0.9)
    assert kw["max_tokens"] == 64 and kw["stop_token_ids"] == [7] and kw["ignore_eos"] and kw["logprobs"] == 0
    assert kw["repetition_penalty"] == 1.1 and kw["stop"] is None
    val = sampling_kwargs(cfg, validate=True)
    assert (val["n"], val["temperature"], val["top_k"]) == (2, 0.5, 0)
    greedy = sampling_kwargs(cfg.model_copy(update={"do_sample": False}), n=1)
    assert (greedy["n"], greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (1, 0.0, 1.0, 0)
    assert sampling_kwargs(cfg.model_copy(update={"calculate_log_probs": False}))["logprobs"] is None


def test_sampling_kwargs_greedy_baseline_overrides_sampling_and_n():
    """ReMax's baseline: one greedy response per prompt even when the rollout samples n=4 at temperature 0.7."""
    from vllm import SamplingParams

    cfg = RolloutConfig(temperature=0.7, top_k=20, top_p=0.9, n=4, response_length=16)
    kw = sampling_kwargs(cfg, greedy=True)
    assert (kw["n"], kw["temperature"], kw["top_p"], kw["top_k"]) == (1, 0.0, 1.0, 0)
    assert kw["max_tokens"] == 16 and kw["logprobs"] == 0  # the rest is the training rollout's
    assert sampling_kwargs(cfg, n=8, greedy=True)["n"] == 1
    SamplingParams(**kw)  # vLLM accepts it (greedy with n > 1 would raise)


def test_engine_kwargs_cpu_and_gpu():
    cfg = RolloutConfig(prompt_length=100, response_length=28, max_num_seqs=8)
    cpu = engine_kwargs(cfg, ModelFacts("/m"), seed=3, on_gpu=False, worker_extension="ext")
    assert cpu["dtype"] == "float32" and cpu["kv_cache_memory_bytes"] == 256 << 20 and cpu["max_model_len"] == 128
    assert "gpu_memory_utilization" not in cpu and cpu["seed"] == 3 and cpu["enforce_eager"]
    gpu = engine_kwargs(cfg, ModelFacts("/m"), seed=3, on_gpu=True, worker_extension="ext")
    assert gpu["dtype"] == "bfloat16" and gpu["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in gpu
    with pytest.raises(EngineStartError, match="kv_cache_memory_bytes"):
        engine_kwargs(cfg.model_copy(update={"kv_cache_memory_bytes": None}), ModelFacts("/m"), 0, on_gpu=False,
                      worker_extension="ext")


def test_kv_cache_sizing_and_message():
    # 2 layers * 2 kv heads * 32 * 2 (K, V) * 4 bytes = 1024 B/token; 300 tokens -> 3 blocks of 128
    assert kv_cache_bytes_needed(LLAMA, "float32", 300) == 384 * 1024
    cfg = RolloutConfig(prompt_length=250, response_length=50, kv_cache_memory_bytes=200 * 1024)
    msg = explain_start_failure(ValueError("To serve at least one request with the model's max seq len (300), "
                                           "(0.00 GiB KV cache is needed, which is larger than the available KV "
                                           "cache memory"), cfg, LLAMA, "float32", on_gpu=False, block_size=128)
    assert "at least 393216" in msg and "at most 128" in msg


def test_prompt_overflow():
    ps = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with pytest.raises(PromptTooLongError, match="prompt 1: 5 tokens"):
        apply_prompt_overflow(ps, 4, "error")
    assert apply_prompt_overflow(ps, 4, "left") == ([[1, 2, 3], [5, 6, 7, 8]], [0, 1], [False, True])
    assert apply_prompt_overflow(ps, 4, "right") == ([[1, 2, 3], [4, 5, 6, 7]], [0, 1], [False, True])
    assert apply_prompt_overflow(ps, 4, "filter") == ([[1, 2, 3]], [0], [False])
    with pytest.raises(ValueError, match="expected one of"):
        apply_prompt_overflow(ps, 4, "middle")


def _batch():
    return RolloutBatch(prompt_ids=[[1, 2], [1, 2], [3]], response_ids=torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 4]]),
                        response_lengths=torch.tensor([2, 1, 3]), rollout_logprobs=torch.zeros(3, 3),
                        finish_reasons=["stop", "stop", "length"], truncated=torch.tensor([False, False, True]),
                        prompt_index=torch.tensor([0, 0, 1]), prompt_truncated=torch.zeros(3, dtype=torch.bool),
                        weight_version=2)


def test_rollout_batch_select_and_checks():
    b = _batch()
    assert b.response_mask().tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert b.response(0) == [5, 6]
    s = b.select([2])
    assert s.prompt_ids == [[3]] and s.truncated.tolist() == [True]
    with pytest.raises(ValueError, match="finish_reasons"):
        RolloutBatch(**{**b.__dict__, "finish_reasons": ["stop", "eos", "stop"]})
    with pytest.raises(ValueError, match="response_lengths"):
        RolloutBatch(**{**b.__dict__, "response_lengths": torch.tensor([2, 1])})


def test_buckets_and_checksums():
    named = [(f"t{i}", torch.ones(256)) for i in range(5)]  # 1 KiB each
    buckets = list(iter_buckets(named, 2048))
    assert [len(b) for b in buckets] == [2, 2, 1]
    assert [len(b) for b in iter_buckets([("big", torch.ones(1024))] + named[:1], 2048)] == [1, 1]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert engine_name("model.layers.0.self_attn.k_proj.weight", packed) == "model.layers.0.self_attn.qkv_proj.weight"
    q, k = torch.randn(4, 3), torch.randn(2, 3)
    folded = fold_checksums({"a.q_proj.weight": tensor_checksum(q), "a.k_proj.weight": tensor_checksum(k)}, packed)
    fused = torch.cat([q, k, torch.zeros(2, 3)])  # zero padding does not change the checksum
    assert checksums_match(folded["a.qkv_proj.weight"], tensor_checksum(fused))
    assert not checksums_match(tensor_checksum(q), tensor_checksum(q * 1.001))
    w = torch.randn(4, 3)
    merged = combine_rank_checksums([{"w": tensor_checksum(w[:2]), "n": tensor_checksum(q)},
                                     {"w": tensor_checksum(w[2:]), "n": tensor_checksum(q)}])
    assert checksums_match(merged["w"], tensor_checksum(w)) and merged["n"] == tensor_checksum(q)
