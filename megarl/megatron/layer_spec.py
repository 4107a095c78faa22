"""megarl's layer-spec submodules for the path without Transformer Engine (megatron's "local" spec).

megatron-core's local spec was written as a fallback, and two of its parts cost a GPU run most of its time:
- `DotProductAttention` materialises the [b * heads, s, s] score matrix (baddbmm, masked_fill, softmax in float32,
  bmm) and repeats K/V per query head for GQA; its forward and backward were about a quarter of a 1.1B step's GPU
  time. `SDPAttention` is the same core attention through torch's `scaled_dot_product_attention`, which picks a
  flash / memory-efficient kernel on CUDA (GQA without copying K/V, causal without a mask tensor).
- `WrappedTorchNorm` builds `torch.nn.RMSNorm(hidden)` without `params_dtype`, so in a bf16 build every norm weight
  stays float32 and each norm casts activations up and back (about a fifth of the step in dtype copies). `RMSNorm`
  here is torch's RMSNorm (a fused kernel on CUDA in recent torch) created in the config's `params_dtype`.

`local_block_spec(config)` is megatron's own decoder block spec with those two classes put in place of megatron's;
every other module (linear layers, MLP, MoE, rope) is megatron's, so parameter names and the bridge do not change.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

# Marks the causal mask megarl's forward builds (megarl.megatron.forward.causal_inputs): attention may then use the
# kernels' own causal masking instead of reading an [s, s] mask tensor.
CAUSAL_MASK_ATTR = "megarl_causal"


# Activation recomputation hands attention a detached copy of the mask (same memory, no attribute): marked masks are
# also known by (address, shape) while they live. Bounded: only the most recent masks are remembered.
_CAUSAL_MASKS: "dict[tuple, object]" = {}
_REMEMBERED = 64


def mark_causal(mask: torch.Tensor) -> torch.Tensor:
    import weakref

    setattr(mask, CAUSAL_MASK_ATTR, True)
    key = (mask.data_ptr(), tuple(mask.shape), mask.device)
    _CAUSAL_MASKS[key] = weakref.ref(mask)
    while len(_CAUSAL_MASKS) > _REMEMBERED:
        _CAUSAL_MASKS.pop(next(iter(_CAUSAL_MASKS)))
    return mask


def is_marked_causal(mask: torch.Tensor) -> bool:
    """True for a mask made by mark_causal, or a view/detached copy of one that is still alive (same memory)."""
    if getattr(mask, CAUSAL_MASK_ATTR, False):
        return True
    ref = _CAUSAL_MASKS.get((mask.data_ptr(), tuple(mask.shape), mask.device))
    return ref is not None and ref() is not None and mask.dtype == torch.bool


def _module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SDPAttention(_module_base()):
    """megatron's core attention contract through torch.nn.functional.scaled_dot_product_attention.

    forward(query [sq, b, np, hn], key/value [sk, b, ng, hn], attention_mask) -> context [sq, b, np * hn], where np
    and ng are this TP rank's query heads and KV groups (GQA: np a multiple of ng; K/V are never repeated).
    attention_mask: None or megarl's causal mask (causal by the kernel), or a boolean mask broadcastable to
    [b, np, sq, sk] with True = masked (padding masks included); a masked position gets the most negative finite
    score, as megatron's own masking does, so a fully masked row yields a uniform average instead of NaN.
    Packed sequences (packed_seq_params, THD: query [t, np, hn], key/value [t, ng, hn] -> [t, np * hn]) attend
    within each segment, cost sum of squared segment lengths (megarl.megatron.packing.by_segment), the pack's end
    padding left out (its outputs 0: megarl.megatron.packing.attended); a row continuing a
    shared prefix attends to it as well (megarl.megatron.shared_prefix). Under context
    parallelism t is this rank's share of the pack and keys and values are gathered over the CP group
    (megarl.megatron.context_parallel.attend), exact."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        self.cp = config.context_parallel_size
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError(f"megarl's SDPA core attention supports vanilla full attention only (softmax_type="
                             f"{config.softmax_type!r}, window_size={config.window_size})")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.causal = attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= self.layer_number
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("megarl's SDPA core attention takes no attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.cp > 1:
            raise ValueError("megarl's SDPA core attention takes context-parallel input packed only (megarl's forward "
                             "always packs: megarl.megatron.packing)")
        sq, b, nq, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn], hn stays contiguous
        causal = self.causal if attn_mask_type is None else attn_mask_type.name in ("causal", "padding_causal")
        mask = None
        if attention_mask is not None and not (causal and is_marked_causal(attention_mask)):
            mask = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(attention_mask.to(torch.bool), torch.finfo(q.dtype).min)
            if causal:  # an explicit mask replaces the kernel's causal masking: add the causal part to it
                sk = k.shape[2]
                upper = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
                mask = mask.masked_fill(upper, torch.finfo(q.dtype).min)
            causal = False
        dropout = self.dropout if self.training else 0.0
        if dropout:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, mask, causal, dropout)
        else:
            out = self._sdpa(q, k, v, mask, causal, 0.0)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * hn)  # [sq, b, np * hn]

    def _packed(self, query, key, value, packed_seq_params):
        """THD: query [t, np, hn], key/value [t, ng, hn] hold the pack's segments end to end (megarl.megatron.packing);
        each segment attends causally to itself only, segments of one length in one SDPA call. -> [t, np * hn]."""
        from megarl.megatron.packing import LINKS_ATTR, attended, by_segment, with_padding

        dropout = self.dropout if self.training else 0.0

        def attend(q, k, v):
            """q [g, L, np, hn], k/v [g, L, ng, hn] -> [g, L, np, hn], causal by the kernel."""
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            return self._sdpa(q, k, v, None, self.causal, dropout).transpose(1, 2)

        # the pack's end padding is left out: its outputs are 0 (megarl.megatron.packing.attended)
        segments, pad = attended(packed_seq_params)
        links = getattr(packed_seq_params, LINKS_ATTR, ())
        real = query.shape[0] - pad // self.cp
        with contextlib.ExitStack() as stack:
            if dropout:
                from megatron.core import tensor_parallel

                stack.enter_context(tensor_parallel.get_cuda_rng_tracker().fork())
            if self.cp > 1:
                from megarl.megatron import context_parallel

                def block(q, k, v, causal):
                    return context_parallel.block_attention(q, k, v, causal, self.softmax_scale, dropout)

                out = context_parallel.attend(query, key, value, segments, block, pad)
            elif links:
                from megarl.megatron import shared_prefix

                def masked(q, k, v, allowed):
                    """q [g, L, np, hn], k/v [g, a + L, ng, hn], allowed [L, a + L] -> [g, L, np, hn]."""
                    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
                    return self._sdpa(q, k, v, allowed, False, dropout).transpose(1, 2)

                out = shared_prefix.attend(query[:real], key[:real], value[:real], segments,
                                           links[:len(segments)],
                                           lambda lengths, q, k, v: by_segment(lengths, attend, q, k, v), masked)
            else:
                out = by_segment(segments, attend, query[:real], key[:real], value[:real])
        out = with_padding(out, query.shape[0] - out.shape[0])
        return out.reshape(out.shape[0], -1)

    def _sdpa(self, q, k, v, mask, causal, dropout):
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                              scale=self.softmax_scale, enable_gqa=gqa)


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with its weight in the config's params_dtype (megatron's WrappedTorchNorm leaves it float32).

    Accepts megatron's norm constructor arguments; under sequence parallelism each rank normalises its own sequence
    chunk and the weight is tagged `sequence_parallel` so megatron all-reduces its gradient over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError(f"megarl's RMSNorm implements RMSNorm only (normalization={config.normalization!r}, "
                             f"zero_centered_gamma={zero_centered_gamma or config.layernorm_zero_centered_gamma})")
        device = None if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))


def _replace(obj, swaps: dict):
    """A copy of a (nested) megatron spec with every class in `swaps` replaced; other objects are kept."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, type) and obj in swaps:
        return swaps[obj]
    if isinstance(obj, ModuleSpec):
        return dataclasses.replace(obj, module=_replace(obj.module, swaps), submodules=_replace(obj.submodules, swaps))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(x, swaps) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _replace(getattr(obj, f.name), swaps)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def local_swaps(sdpa: bool = True) -> dict:
    """{megatron class: megarl class} applied to megatron's local spec."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    swaps = {WrappedTorchNorm: RMSNorm}
    try:  # with apex installed megatron's local spec uses apex's FusedRMSNorm-backed LayerNorm instead
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        swaps[FusedLayerNorm] = RMSNorm
    except ImportError:
        pass
    if sdpa:
        swaps[DotProductAttention] = SDPAttention
    return swaps


def local_block_spec(config, vp_stage: Optional[int] = None, sdpa: bool = True):
    """megatron's decoder block spec without Transformer Engine, with megarl's RMSNorm and (sdpa) SDPA attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                      vp_stage=vp_stage)
    return _replace(spec, local_swaps(sdpa))
