"""Rollout: the generation engines (vLLM) and the weight sync from the Megatron actor into them.

Where engines run (rollout.placement = "colocated", the default)
---------------------------------------------------------------------------------------------
* rollout.data_parallel_size engine replicas over the trainer's ranks (megarl.rollout.replicas): replica r spans
  rollout.tensor_model_parallel_size consecutive ranks and its first rank owns it, as a child process
  (megarl.rollout.process: vLLM's own process group must not mix with the trainer's); engine TP > 1 runs vLLM's
  multi-process executor, one worker per rank of the group.
* Prompts: each replica generates its contiguous share (seeds by global prompt index) and broadcasts it as tensors.
* Weights, after every update: per-rank delivery (megarl.rollout.delivery): every engine worker receives only its own
  shard of each tensor, from the trainer ranks that hold it (p2p), through a shared-memory bucket file that megarl's
  worker extension (megarl.rollout.worker_ext) loads with vLLM's own weight loaders. The plan (megarl.rollout.shards,
  megarl.rollout.plan) comes from the bridge mapping and the shards each live worker reports.

Placed separately (rollout.placement = "separate"; Ray actors always are): each replica runs in a host process of its
own (a Ray actor, megarl.rollout.ray_engine, or an engine process on cores of its own) and receives the same plan's
pieces from the trainer ranks over a transfer group of the trainer ranks and the hosts (megarl.rollout.remote: gloo
on CPU, NCCL on GPU), never through one rank or Ray's object store.
"""
from megarl.rollout.engine import (EngineStartError, PromptTooLongError, VLLMEngine, apply_prompt_overflow,
                                   engine_kwargs, kv_cache_bytes_needed, sampling_kwargs)
from megarl.rollout.weights import iter_buckets, tensor_checksum

__all__ = ["VLLMEngine", "EngineStartError", "PromptTooLongError", "apply_prompt_overflow", "engine_kwargs",
           "sampling_kwargs", "kv_cache_bytes_needed", "iter_buckets", "tensor_checksum"]
