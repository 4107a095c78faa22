"""LoRA for the megatron actor: targets (pure, from the bridge mapping), megatron adapter layers, PEFT I/O.

See megarl.lora.layers for how adapters sit on column/row-parallel linears at any TP/PP/EP layout."""
from megarl.lora.targets import (ALL_LINEAR, PROJECTIONS, LoraError, LoraSettings, adapter_numel, available_projections,
                                 resolve_targets)

__all__ = ["ALL_LINEAR", "PROJECTIONS", "LoraError", "LoraSettings", "adapter_numel", "available_projections",
           "resolve_targets"]
