"""The gradient of MLA's shared rope key under tensor parallelism, for megatron-core 0.16.1's column-split q/kv down
projections (the layout megarl uses with and without TE, megarl.megatron.model).

There, `get_query_key_value_tensors` all-gathers the kv down projection's output [.., (kv_lora_rank + rope) / TP] along
its last dimension and splits it into the latent and the rope key k_pos_emb. The latent then goes through TP-aware
layers whose backward sums over the TP ranks, but k_pos_emb, one key shared by all heads, is used as it is by this
rank's heads only: its gradient on each rank is that rank's heads' share. The all-gather's backward keeps each rank's
own columns of its own gradient, so the rope columns lose the other ranks' shares, and every weight upstream (the down
projection, the norms and projections of earlier layers, the embedding) gets a wrong gradient at TP > 1 while the
forward stays exact. (megatron's replicated-down-projection path gathers k_pos_emb over the sequence instead, whose
backward is a reduce-scatter: a sum.) Here the gather of that one tensor sums the rope columns' gradient over the TP
ranks before keeping this rank's columns; tests/dist/test_actor_step.py compares a TP2 update with plain torch's.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

_LATENT = "_megarl_mla_latent"  # set on the kv down projection's output: its latent width (the rope columns follow)


class _GatherLatentAndRope(torch.autograd.Function):
    """forward: all-gather [.., (latent + rope) / TP] -> [.., latent + rope]; backward: the rope columns' gradient
    summed over the TP ranks, then this rank's columns kept (the latent columns' gradient is already whole)."""

    @staticmethod
    def forward(ctx, x, group, latent: int):
        from megatron.core.tensor_parallel.mappings import _gather_along_last_dim

        ctx.group, ctx.latent = group, latent
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.tensor_parallel.mappings import _split_along_last_dim

        rope = grad[..., ctx.latent:].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        return _split_along_last_dim(torch.cat([grad[..., :ctx.latent], rope], dim=-1), ctx.group), None, None


def _install_gather() -> None:
    """Route the MLA module's last-dimension gather of a marked tensor through _GatherLatentAndRope (once)."""
    import megatron.core.transformer.multi_latent_attention as mla

    original = mla.gather_from_tensor_model_parallel_region
    if getattr(original, "_megarl_rope_grad", False):
        return

    def gather(input_, group=None):
        latent = getattr(input_, _LATENT, None)
        if latent is None:
            return original(input_, group)
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        return _GatherLatentAndRope.apply(input_, get_tensor_model_parallel_group_if_none(group), latent)

    gather._megarl_rope_grad = True
    mla.gather_from_tensor_model_parallel_region = gather


class MLASelfAttentionTP(MLASelfAttention):
    """megatron's MLASelfAttention whose column-split kv down projection marks its output, so the all-gather of it
    sums the shared rope key's gradient over the TP ranks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _install_gather()
        latent = self.config.kv_lora_rank

        def mark(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            setattr(out, _LATENT, latent)

        self.linear_kv_down_proj.register_forward_hook(mark)

