"""MoE layers that compute nothing for a pack's end padding (megarl.megatron.packing).

The end padding of a pack can be long: the expert-parallel ranks run every micro-batch at one agreed token count
(packing.agreed_sizes) and the interleaved pipeline schedule every pack of a call at one size. Its tokens pass through
the per-token layers (norms, projections, dense MLPs), but they must cost no expert compute: megarl gives the model
megatron's `padding_mask` ([1, t] bool, True = padding: GPTModel.forward scatters it under sequence parallelism and
hands it to every MoE layer's router), and every router of a megarl model (`install`) then routes a padding token
to no expert: its row of the routing map is all False and its probabilities 0. megatron's dispatchers (allgather and
alltoall) permute the routed tokens only, so the experts never see a padding token, and the combine scatters nothing
back to it: its MoE output is 0. megatron itself only leaves padding out of its auxiliary losses and expert-bias
counts; the routing of real tokens is unchanged (top-k per token), so every real token's output is the one the
unpadded pack computes.

megatron builds each MoELayer's TopKRouter itself (no spec slot), so `install` wraps the routers' `routing` method on
the built instances.
"""
from __future__ import annotations

from typing import Optional

import torch

ATTR = "megarl_skips_padding"


def install(chunks) -> int:
    """Give every MoE router of `chunks` (GPTModel chunks, wrapped or not) the padding skip. Returns how many."""
    from megatron.core.transformer.moe.router import TopKRouter

    n = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and not getattr(module, ATTR, False):
                module.routing = _skipping(module.routing)
                setattr(module, ATTR, True)
                n += 1
    return n


def _skipping(routing):
    def routing_without_padding(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """megatron's TopKRouter.routing(logits [s, b, E], padding_mask [s, b] True = padding) -> (probs [s*b, E],
        routing_map [s*b, E]) with the padding tokens' rows zeroed: routed to no expert."""
        probs, routing_map = routing(logits, padding_mask=padding_mask)
        if padding_mask is not None:
            keep = ~padding_mask.reshape(-1, 1).to(routing_map.device)
            routing_map = routing_map & keep
            probs = probs * keep.to(probs.dtype)
        return probs, routing_map

    return routing_without_padding


def model_mask(model, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The padding_mask to give a model chunk for a pack's mask [1, t] (packing.padding_mask): None for a model
    without experts (nothing reads it); on a pipeline stage after the first under sequence parallelism, this TP
    rank's contiguous part [1, t / TP] (GPTModel scatters it only where it embeds: the first stage)."""
    if mask is None:
        return None
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    config = inner.config
    if not getattr(config, "num_moe_experts", None):
        return None
    if getattr(config, "sequence_parallel", False) and not getattr(inner, "pre_process", True):
        from megatron.core import parallel_state as ps

        tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        part = mask.shape[1] // tp
        mask = mask[:, r * part:(r + 1) * part]
    return mask
