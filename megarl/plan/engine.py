"""The engine step: what a vLLM engine worker holds on its GPU.

It takes gpu_memory_utilization * GPU memory: its weight shard (from the sync plan), an activation estimate for
max_num_batched_tokens (with routed experts returned, vLLM's capture buffer, megarl.plan.terms), and the rest is
the KV cache (it must hold at least one max_model_len sequence): per token
2 * layers * KV heads per rank * head_dim, or with MLA (DeepSeek-V3) layers * (kv_lora_rank + qk_rope_head_dim), the
compressed latent, whole on every engine TP rank. Colocated with enable_sleep_mode and free_cache_engine it releases
everything between a rollout and the next weight sync; without it, it keeps its share. Engines placed separately hold
gpu_memory_utilization of their GPUs throughout (no sleep).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.bridge.hf_config import ArchSpec, spec_kv_cache_bytes_per_token
from megarl.plan.model import GIB, Cluster, Placement, Weights
from megarl.plan.terms import engine_route_capture_bytes


@dataclass(frozen=True)
class EngineMemory:
    """One engine GPU's share split into weights, activations and the KV cache."""

    reserve: int  # gpu_memory_utilization of the GPU
    weights: int  # the largest engine worker's shard
    activations: int
    kv_per_token: int
    kv_budget: int  # what is left for the KV cache; negative when nothing is
    max_len: int  # rollout.max_model_len, resolved
    sleeps: bool  # releases its memory while the trainer computes

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_budget) // self.kv_per_token


def kv_bytes_per_token(spec: ArchSpec, engine_tp: int, ebytes: int) -> int:
    """One engine TP rank's KV bytes per token: the bridge's one formula, shared with the engine's own check."""
    return spec_kv_cache_bytes_per_token(spec, ebytes, engine_tp)


def engine_memory(r, cluster: Cluster, pl: Placement, weights: Weights, routes: bool = False) -> EngineMemory:
    """r: the recipe's rollout section; routes: the engine returns routed experts (cfg.routes_from_engine)."""
    spec, etp, ebytes = weights.spec, pl.engine_tp, pl.ebytes
    reserve = int(r.gpu_memory_utilization * cluster.gpu_bytes)
    shard = int(max(weights.loaded.values()) * pl.engine_ratio)
    ffn = (spec.moe_topk * spec.moe_ffn_hidden_size) if spec.is_moe else spec.ffn_hidden_size
    act = r.max_num_batched_tokens * ebytes * (4 * spec.hidden_size + 2 * ffn // etp) + \
        r.max_num_seqs * spec.vocab_size // etp * 4
    if routes and spec.is_moe:  # vLLM's routed-experts capture buffer, allocated before the KV cache
        act += engine_route_capture_bytes(r.max_num_batched_tokens, spec.num_layers, spec.moe_topk)
    return EngineMemory(reserve, shard, act, kv_bytes_per_token(spec, etp, ebytes), reserve - shard - act,
                        r.resolved_max_model_len, r.enable_sleep_mode and r.free_cache_engine and not pl.separate)


def kv_cache_reason(e: EngineMemory, r, cluster: Cluster) -> Optional[str]:
    if e.kv_tokens >= e.max_len:
        return None
    return (f"engine KV cache: gpu_memory_utilization {r.gpu_memory_utilization} x {cluster.gpu_mem_gib:g} GiB = "
            f"{e.reserve / GIB:.1f} GiB minus weights {e.weights / GIB:.1f} GiB and activations "
            f"{e.activations / GIB:.1f} GiB leaves {max(0, e.kv_budget) / GIB:.1f} GiB = {e.kv_tokens} tokens, "
            f"less than one max_model_len={e.max_len} sequence; raise rollout.gpu_memory_utilization or "
            + ("rollout.tensor_model_parallel_size" if r.tensor_model_parallel_size < cluster.gpus_per_node else
               # a replica must fit in one node (megarl.rollout.checks.ONE_NODE_RULE): TP cannot grow past it
               "use GPUs with more memory (the engine TP already fills a node)"))
