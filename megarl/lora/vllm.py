"""What vLLM's LoRA support accepts, and the settings an engine starts with for megarl's adapters (pure): the facts of
vLLM's LoRAConfig and module naming beside the LoRA they describe, read by validation and by the adapter sync alike.
"""
from __future__ import annotations

from typing import Optional, Sequence

from megarl.lora.targets import ALL_LINEAR, LoraSettings

# vLLM's LoRAConfig.max_lora_rank takes one of these (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> Optional[int]:
    """The smallest max_lora_rank vLLM accepts that holds `rank`; None above vLLM's largest (512)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def vllm_target_modules(projections: Sequence[str], packed: dict) -> list:
    """vLLM module names (suffixes) to wrap with LoRA layers: a packed module (qkv_proj, gate_up_proj) when any of its
    parts is adapted, the others under their own name. projections: HF short names; packed: the vLLM model class's
    packed_modules_mapping ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...})."""
    wanted = set(projections)
    out = set()
    for name, parts in packed.items():
        if wanted & set(parts):
            out.add(name)
            wanted -= set(parts)
    return sorted(out | wanted)


def lora_engine_settings(settings: LoraSettings, projections: Sequence[str]) -> dict:
    """What the engine needs to start with LoRA support and to build each adapter (picklable): rank, alpha, the
    adapted HF projections, and PEFT's adapter_config fields vLLM's PEFTHelper reads."""
    return {"rank": int(settings.rank), "alpha": float(settings.alpha), "projections": sorted(set(projections)),
            "max_lora_rank": vllm_max_lora_rank(settings.rank),
            "peft_config": {"r": int(settings.rank), "lora_alpha": float(settings.alpha),
                            "target_modules": (ALL_LINEAR if settings.target_modules == ALL_LINEAR
                                               else sorted(set(projections))),
                            "bias": "none", "use_rslora": False, "use_dora": False}}
