"""Which megatron tensors this rank holds: global canonical names plus the TP group each one is split over."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megarl.bridge.mapping import canonical_name, globalize


@dataclass
class LocalParam:
    name: str  # global canonical megatron name (PP layer offset and EP expert offset applied)
    local_name: str  # the name in this rank's module
    param: torch.nn.Parameter
    expert: bool  # routed expert weight: split over the expert-TP group, sharded over EP
    tp_rank: int
    tp_size: int
    tp_group: Optional[Any]

    def value(self) -> torch.Tensor:
        """The tensor as the model computes with it: with enabled LoRA adapters on this weight, base + scaling * B A
        (a new tensor); otherwise the parameter (detached)."""
        return merged_value(self.param)


def merged_value(param: torch.Tensor) -> torch.Tensor:
    """A base weight as the adapted model uses it: base + its delta when a delta is attached and enabled (a new tensor),
    the parameter itself otherwise. megarl.lora attaches `megarl_lora_delta` (the bound method giving scaling * B A, of
    an adapter module with an `enabled` flag); the bridge reads weights through this protocol without importing LoRA."""
    delta = getattr(param, "megarl_lora_delta", None)
    if delta is None or not delta.__self__.enabled:
        return param.detach()
    # the base added into the fresh delta (addition commutes bitwise): one new tensor of the weight's size, not two
    return delta().to(param.dtype).add_(param.detach())


def unwrap(model) -> list:
    """The GPTModel chunks behind DDP / Float16Module wrappers (a list: one per virtual pipeline stage)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for m in chunks:
        while hasattr(m, "module") and not hasattr(m, "decoder"):
            m = m.module
        out.append(m)
    return out


def local_params(model) -> list:
    """Every parameter of this rank's model chunk(s) with its global name and TP placement (LoRA adapters excluded)."""
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
          ps.get_tensor_model_parallel_group())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
           ps.get_expert_tensor_parallel_group(check_initialized=False))
    out = []
    for chunk in unwrap(model):
        layers = list(chunk.decoder.layers) if getattr(chunk, "decoder", None) is not None else []
        expert_offset = 0
        for layer in layers:
            indices = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
            if indices:
                expert_offset = int(indices[0])
                break
        # the router's expert bias (DeepSeek-V3 / GLM-4.5 e_score_correction_bias) is a persistent buffer, not a
        # parameter: the bridge moves it like one (import, export, sync, merge)
        tensors = list(chunk.named_parameters()) + [(n, b) for n, b in chunk.named_buffers()
                                                     if n.endswith(".router.expert_bias")]
        for name, param in tensors:
            if getattr(param, "megarl_lora", False):  # LoRA adapters are no HF weights (megarl.lora moves them)
                continue
            canonical = canonical_name(name)
            gname = globalize(canonical, lambda i: layers[i].layer_number - 1, expert_offset)
            expert = ".local_experts." in canonical
            rank, size, group = etp if expert else tp
            out.append(LocalParam(gname, name, param, expert, rank, size, group))
    return out
