"""Core attention for megatron-core's multi-latent attention without Transformer Engine (CPU, local spec).

megatron-core 0.16.1 builds MLA's core attention with `k_channels` / `v_channels` (keys are qk_nope + qk_rope wide,
values v_head_dim), which only TEDotProductAttention accepts; the local `DotProductAttention` also sizes its output
from `kv_channels`. Its math needs neither: scores and context are computed from the tensors' own sizes. This
subclass takes the two arguments and sizes the output [sq, b, heads_per_partition * v_channels]; everything else
(causal mask, fp32 softmax, the given softmax_scale with YaRN's mscale) is megatron's. Packed sequences (THD,
megarl.megatron.packing) run megatron's math per segment, segments of one length as one batch. Under context
parallelism each rank's queries attend to keys and values gathered over the CP group, block by block with the same
scale, float32 softmax and dropout (megarl.megatron.context_parallel.attend); megatron's local attention refuses CP
only because it gathers nothing itself, so it is built from a copy of the config that says CP 1.
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

        from megarl.megatron.packing import attended, by_segment, with_padding

        def attend(q, k, v):
            """q [g, L, np, hk], k/v [g, L, np, h] -> [g, L, np * hv], causal."""
            n = q.shape[1]
            masked = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1).view(1, 1, n, n)
            out = super(MLADotProductAttention, self).forward(
                *(x.transpose(0, 1).contiguous() for x in (q, k, v)), masked, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias)
            return out.transpose(0, 1)

        segments, pad = attended(packed_seq_params)  # the pack's end padding left out: its outputs are 0
        if self.cp > 1:
            return self._context_parallel(query, key, value, segments, pad)
        real = query.shape[0] - pad
        return with_padding(by_segment(segments, attend, query[:real], key[:real], value[:real]), pad)

    def _context_parallel(self, query, key, value, segments, pad: int = 0):
        """megatron's math (its scale, float32 softmax, attention dropout) block by block over the CP chunks
        (megarl.megatron.context_parallel.attend), which needs each block's log-sum-exp: [t, np * hv]."""
        import contextlib

        from megatron.core import tensor_parallel

        from megarl.megatron import context_parallel

        if self.softmax_offset is not None:
            raise ValueError(f"megarl's MLA core attention at context_parallel_size {self.cp} supports vanilla "
                             f"softmax only (softmax_type={self.config.softmax_type!r})")
        # megatron divides the scale by the layer number here and multiplies it back inside its softmax
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0

        def block(q, k, v, causal):
            return context_parallel.block_attention(q, k, v, causal, scale, dropout)

        # megatron draws attention dropout from the tracker's stream unless under sequence parallelism
        fork = dropout and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            out = context_parallel.attend(query, key, value, segments, block, pad)
        return out.reshape(out.shape[0], -1)

