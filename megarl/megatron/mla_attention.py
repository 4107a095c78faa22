"""Core attention for megatron-core's multi-latent attention without Transformer Engine (CPU, local spec).

megatron-core 0.16.1 builds MLA's core attention with `k_channels` / `v_channels` (keys are qk_nope + qk_rope wide,
values v_head_dim), which only TEDotProductAttention accepts; the local `DotProductAttention` also sizes its output
from `kv_channels`. Its math needs neither: scores and context are computed from the tensors' own sizes. This
subclass takes the two arguments and sizes the output [sq, b, heads_per_partition * v_channels]; everything else
(causal mask, fp32 softmax, the given softmax_scale with YaRN's mscale) is megatron's. Packed sequences (THD,
megarl.megatron.packing) run megatron's math per segment, segments of one length as one batch. Under context
parallelism each rank's queries attend to keys and values gathered over the CP group
(megarl.megatron.context_parallel.attend); megatron's local attention refuses CP only because it gathers nothing
itself, so it is built from a copy of the config that says CP 1.
"""
from __future__ import annotations

import copy
from typing import Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None, cp_comm_type=None,
                 pg_collection=None):
        self_config = config
        if config.context_parallel_size > 1:
            self_config = copy.copy(config)
            self_config.context_parallel_size = 1
        super().__init__(config=self_config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
        self.cp = config.context_parallel_size

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query/key [sq, b, np, hk], value [sq, b, np, hv] -> [sq, b, np * hv]; packed (THD): query/key [t, np, hk],
        value [t, np, hv] -> [t, np * hv], each segment causal within itself."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        import torch

        from megarl.megatron.packing import by_segment, segment_lengths

        def attend(q, k, v, allowed=None):
            """q [g, m, np, hk], k/v [g, L, np, h] -> [g, m, np * hv]; allowed [m, L] (True = may attend) under CP,
            else m = L and causal."""
            if allowed is None:
                n = q.shape[1]
                allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            masked = (~allowed).view(1, 1, *allowed.shape)
            out = super(MLADotProductAttention, self).forward(
                *(x.transpose(0, 1).contiguous() for x in (q, k, v)), masked, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias)
            return out.transpose(0, 1)

        if self.cp > 1:
            from megarl.megatron.context_parallel import attend as cp_attend

            return cp_attend(query, key, value, segment_lengths(packed_seq_params), attend)
        return by_segment(segment_lengths(packed_seq_params), attend, query, key, value)

