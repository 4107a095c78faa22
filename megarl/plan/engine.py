"""The engine step: what a vLLM engine worker holds on its GPU.

It takes gpu_memory_utilization * GPU memory: its weight shard (from the sync plan), an activation estimate for
max_num_batched_tokens (with routed experts returned, vLLM's capture buffer, megarl.plan.terms), and the rest is
the KV cache (it must hold at least one max_model_len sequence): per token
2 * layers * KV heads per rank * head_dim, or with MLA (DeepSeek-V3) layers * (kv_lora_rank + qk_rope_head_dim), the
compressed latent, whole on every engine TP rank. Colocated with enable_sleep_mode and free_cache_engine it releases
everything between a rollout and the next weight sync; without it, it keeps its share. Engines placed separately hold
gpu_memory_utilization of their GPUs throughout (no sleep).

The transformers engine (rollout.name=hf, megarl.rollout.hf) has no gpu_memory_utilization: it holds its weights
(the whole model at TP1) and, inside a generate call, transformers' DynamicCache of the rows it decodes together,
b = min(max_num_seqs, the replica's rows) at full length S = prompt + response:
  KV cache     b x S x kv bytes per token (the formula above at TP1), plus one layer's share while DynamicCache
               concatenates the new token's K/V to a layer's (torch.cat: old and new alive at once)
  working set  the prefill of b prompts through one layer, b x prompt x p x (4h + 3f) (q/k/v and the MLP's
               gate, up and their product; f = top_k x f_moe in MoE layers), and the last position's float32
               logits b x V x 4 (logits_to_keep=1)
so its memory grows with the batch and the length, and the plan counts it as the engine's line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.bridge.hf_config import ArchSpec, spec_kv_cache_bytes_per_token
from megarl.plan.model import GIB, Cluster, Placement, Weights
from megarl.plan.terms import engine_route_capture_bytes

ENGINE_LINE = "engine (gpu_memory_utilization)"
HF_ENGINE_LINE = "engine (hf: weights, KV cache of its batch, prefill)"


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
    line: str = ENGINE_LINE  # the name of its line in the phases
    kv_bytes: int = 0  # the hf engine: its KV cache at the batch it decodes
    batch: int = 0  # the hf engine: rows decoded together

    @property
    def idle(self) -> int:
        """What it holds between rollouts when it does not sleep: its share (vLLM keeps its KV cache); the hf engine
        its weights (its cache lives only inside a generate call)."""
        return self.weights if self.line == HF_ENGINE_LINE else self.reserve

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_budget) // self.kv_per_token


def kv_bytes_per_token(spec: ArchSpec, engine_tp: int, ebytes: int) -> int:
    """One engine TP rank's KV bytes per token: the bridge's one formula, shared with the engine's own check."""
    return spec_kv_cache_bytes_per_token(spec, ebytes, engine_tp)


def engine_memory(r, cluster: Cluster, pl: Placement, weights: Weights, routes: bool = False,
                  rows: int = 0) -> EngineMemory:
    """r: the recipe's rollout section; routes: the engine returns routed experts (cfg.routes_from_engine)."""
    if r.name == "hf":
        return hf_engine_memory(r, pl, weights, rows)
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


def hf_engine_memory(r, pl: Placement, weights: Weights, rows: int) -> EngineMemory:
    """The transformers engine's memory (see the module doc) for a step of `rows` rows over the replicas."""
    spec, ebytes = weights.spec, pl.ebytes
    shard = int(max(weights.loaded.values()) * pl.engine_ratio)
    seq = r.prompt_length + r.response_length
    batch = max(1, min(r.max_num_seqs, -(-max(1, rows) // max(1, pl.replicas))))
    per_token = kv_bytes_per_token(spec, 1, ebytes)
    kv = hf_kv_cache_bytes(batch, seq, per_token, spec.num_layers)
    ffn = (spec.moe_topk * spec.moe_ffn_hidden_size) if spec.is_moe else spec.ffn_hidden_size
    act = batch * r.prompt_length * ebytes * (4 * spec.hidden_size + 3 * ffn) + batch * spec.vocab_size * 4
    total = shard + kv + act
    return EngineMemory(total, shard, act, per_token, kv, r.resolved_max_model_len,
                        r.enable_sleep_mode and r.free_cache_engine and not pl.separate, HF_ENGINE_LINE, kv, batch)


def hf_kv_cache_bytes(batch: int, seq: int, per_token: int, layers: int) -> int:
    """transformers' DynamicCache of `batch` rows of `seq` tokens at `per_token` bytes (all layers), plus one
    layer's share concatenated anew at each step."""
    whole = batch * seq * per_token
    return whole + whole // max(1, layers)


def kv_cache_reason(e: EngineMemory, r, cluster: Cluster) -> Optional[str]:
    if e.line == HF_ENGINE_LINE or e.kv_tokens >= e.max_len:  # the hf engine's cache is sized by its batch
        return None
    return (f"engine KV cache: gpu_memory_utilization {r.gpu_memory_utilization} x {cluster.gpu_mem_gib:g} GiB = "
            f"{e.reserve / GIB:.1f} GiB minus weights {e.weights / GIB:.1f} GiB and activations "
            f"{e.activations / GIB:.1f} GiB leaves {max(0, e.kv_budget) / GIB:.1f} GiB = {e.kv_tokens} tokens, "
            f"less than one max_model_len={e.max_len} sequence; raise rollout.gpu_memory_utilization or "
            + ("rollout.tensor_model_parallel_size" if r.tensor_model_parallel_size < cluster.gpus_per_node else
               # a replica must fit in one node (megarl.rollout.checks.ONE_NODE_RULE): TP cannot grow past it
               "use GPUs with more memory (the engine TP already fills a node)"))
