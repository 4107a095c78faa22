"""Fewer host synchronisations per training step.

A host synchronisation (`.item()`, `float(t)`, `.tolist()`, `.cpu()`, `if t.any()` on a GPU tensor) stops the CPU
until the GPU has caught up, so the GPU idles while the CPU launches the next kernels. One step should need a handful
(the gradient norm, the overflow check of mixed precision, the step's metrics), not one per parameter.

Without Transformer Engine and apex, megatron-core's fallback for its fused L2 norm (`local_multi_tensor_l2_norm`,
used for the gradient norm every step) builds `torch.tensor([norm of each tensor])` from 0-dim device tensors: one
synchronisation per parameter tensor (hundreds per step on a 1B model). `install()` replaces that fallback with the same
norm computed on the device (torch._foreach_norm, then the norm of the norms), which synchronises nowhere. With TE or
apex installed megatron uses their fused kernels and nothing is replaced.
"""
from __future__ import annotations

import torch


def device_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for amp_C.multi_tensor_l2norm / megatron's local fallback: (norm [1] float32, None), on the device."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    return torch.linalg.vector_norm(norms).reshape(1), None


def install() -> bool:
    """Replace megatron's synchronising local L2-norm fallback (only where it is the one in use). Returns whether it
    replaced it."""
    import megatron.core.optimizer.clip_grads as cg
    from megatron.core.utils import local_multi_tensor_l2_norm

    if getattr(cg, "l2_norm_impl", None) is local_multi_tensor_l2_norm:
        cg.l2_norm_impl = device_l2_norm
        return True
    return cg.l2_norm_impl is device_l2_norm
