"""How far two correct float32 implementations of the same model may disagree: bounds derived from the computation.

Two implementations of one transformer (megatron at TP2 vs HF transformers, vLLM vs megatron, AVX2 vs AVX-512
kernels) sum the same products in different orders, so their results differ by rounding alone. The bound below is
what that rounding can explain, from the model's widths, depth, vocabulary and logit size; a wrong mapping (a swapped
projection, a mis-sliced shard) moves logprobs by O(logit scale), orders of magnitude above it.

Error model (probabilistic rounding-error analysis, Higham & Mary 2019): every rounding contributes an independent
error of at most u = 2**-24 relative to the value rounded. Summing K terms of random sign, the partial sums grow as
sqrt(k), so the sum's error relative to its result is about u * sqrt(K / 2) <= u * sqrt(K); blocked and SIMD
summation (every CPU and GPU kernel) only lowers it. Through the network:
- one layer chains GEMMs and reductions whose inner widths are the hidden size (norm, QKV / MLA down-projections,
  MLP up), the attention's head width (q.k), the sequence (softmax-weighted values), the attention output width and
  the MLP width; their relative errors add, <= sum_i sqrt(K_i) u; a few ulp of exp / rsqrt / sin per element are
  covered by the sqrt terms' slack;
- the residual stream carries independent per-layer errors: they grow as sqrt(layers);
- the LM head is one more GEMM over the hidden size; the logit error is that relative error times the logits' RMS;
- a logprob is z_t - logsumexp(z): its error is at most twice the largest logit error, plus the rounding of the
  vocabulary-wide sum of exponentials (positive terms: partial sums grow linearly, relative error u * sqrt(V / 3));
- two implementations each err this much: their difference has sqrt(2) times the spread;
- the largest of n such errors (n = positions x vocabulary) is at most sqrt(2 ln n) standard deviations.

bf16 builds (below): one rounding of at most 2**-8 per stored tensor dominates; bf16_logprob_spread.
"""
from __future__ import annotations

import math
from typing import Iterable

FP32_UNIT = 2.0 ** -24  # float32 unit roundoff


def tail_factor(n: int) -> float:
    """sqrt(2 ln n): the largest of n independent errors of unit spread stays below this many spreads (for n >= 2)."""
    return math.sqrt(2.0 * math.log(max(int(n), 2)))


def layer_error_factor(inner_widths: Iterable[int]) -> float:
    """sum_i sqrt(K_i): one layer's relative error in units of u, for the inner widths K_i of its chained sums."""
    return sum(math.sqrt(max(int(k), 1)) for k in inner_widths)


def fp32_logit_error_factor(hidden: int, layer_widths: Iterable[int], layers: int, input_error: float = 0.0) -> float:
    """Relative error of the logits in units of u: the LM head's GEMM over `hidden` plus the residual stream's error
    after `layers` layers, each of relative error layer_error_factor(layer_widths), plus the decoder input's own
    relative error `input_error` (units of u: image embeddings computed by a vision tower), which the residual stream
    carries to the logits like a layer's."""
    return (math.sqrt(max(int(hidden), 1)) + math.sqrt(max(int(layers), 1)) * layer_error_factor(layer_widths)
            + input_error)


def fp32_logprob_bound(hidden: int, layer_widths: Iterable[int], layers: int, vocab: int, logits_rms: float,
                       n_positions: int, input_error: float = 0.0) -> float:
    """Max abs logprob difference two correct float32 implementations can show over `n_positions` token positions.

    hidden: the model's hidden size; layer_widths: the inner widths of one layer's chained sums (see transformer_widths);
    layers: depth; vocab: vocabulary size; logits_rms: RMS of the logits over real positions and the vocabulary;
    input_error: the decoder input's relative error in units of u (vision_error_factor; 0 for token embeddings).
    """
    logit_err = fp32_logit_error_factor(hidden, layer_widths, layers, input_error) * FP32_UNIT * logits_rms
    sum_err = math.sqrt(vocab / 3.0) * FP32_UNIT
    spread = math.sqrt(2.0) * (2.0 * logit_err + sum_err)
    return tail_factor(n_positions * vocab) * spread


def fp32_relative_error(hidden: int, layer_widths: Iterable[int], layers: int, n_values: int) -> float:
    """The largest relative rounding error over n_values outputs of the model (and, transposed, of its gradients:
    backward runs the same sums), two implementations apart."""
    return 2.0 * fp32_logit_error_factor(hidden, layer_widths, layers) * FP32_UNIT * tail_factor(n_values)


def fp32_after_step_bound(forward_bound: float, relative_error: float, moved: float) -> float:
    """Max abs logprob difference of two correct implementations after one optimizer step whose update is at most
    1 x as sensitive to its gradient as the gradient is (Adam with lr / eps <= 1; plain SGD with lr <= 1): the forward
    bound plus the gradients' relative error times how far the step moved the logprobs (`moved`)."""
    return forward_bound + relative_error * moved


def fp32_output_bound(hidden: int, layer_widths: Iterable[int], layers: int, output_rms: float, n_values: int) -> float:
    """Max abs difference of a linear read-out of the last hidden state (a reward model's score, a critic's value) that
    two correct float32 implementations can show over `n_values` outputs of RMS `output_rms`."""
    err = fp32_logit_error_factor(hidden, layer_widths, layers) * FP32_UNIT * output_rms
    return tail_factor(n_values) * math.sqrt(2.0) * err


def transformer_widths(hidden: int, heads: int, head_dim: int, ffn: int, seq_len: int, qk_dim: int = 0,
                       latent: Iterable[int] = ()) -> list[int]:
    """One decoder layer's chained inner widths: norm and projections over `hidden`, q.k over `qk_dim` (head_dim when
    0), softmax-weighted values over `seq_len`, the output projection over heads * head_dim, the MLP's down projection
    over `ffn` (for MoE: the widest expert or dense MLP; the top-k sum adds a handful of terms), and for multi-latent
    attention the up-projections from each latent width."""
    return [hidden, hidden, qk_dim or head_dim, seq_len, heads * head_dim, hidden, ffn, *latent]


def layer_widths(spec, seq_len: int) -> list:
    """One layer's chained inner widths (transformer_widths) for an ArchSpec: the widest MLP (dense,
    expert or shared expert) and, for multi-latent attention, its latent ranks and q.k width."""
    ffn = max(spec.ffn_hidden_size, spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size)
    if spec.mla is None:
        return transformer_widths(spec.hidden_size, spec.num_attention_heads, spec.head_dim, ffn, seq_len)
    m = spec.mla
    latent = [m.kv_lora_rank] + ([m.q_lora_rank] if m.q_lora_rank else [])
    return transformer_widths(spec.hidden_size, spec.num_attention_heads, m.v_head_dim, ffn, seq_len,
                              qk_dim=m.q_head_dim, latent=latent)


def vision_error_factor(vision, longest_segment: int) -> float:
    """A vision tower's relative float32 rounding error in units of u (vision: megarl.bridge.hf_config.VisionSpec):
    the patch embedding's sum over a flattened patch, `depth` blocks whose chained sums run over the hidden size (norm,
    q/k/v), the head width (q.k), the longest attended segment in patches (softmax-weighted values), the hidden size
    (output projection, norm) and the MLP width, adding up in the residual stream as sqrt(depth), and the patch
    merger's norm and two sums over merge**2 * hidden."""
    block = layer_error_factor([vision.hidden_size, vision.hidden_size, vision.head_dim, longest_segment,
                                vision.hidden_size, vision.hidden_size, vision.intermediate_size])
    merged = vision.hidden_size * vision.merge_unit
    merger = layer_error_factor([vision.hidden_size, merged, merged])
    return math.sqrt(vision.patch_dim) + math.sqrt(max(int(vision.depth), 1)) * block + merger


def vision_input_error(vision, longest_segment: int) -> float:
    """The relative error (units of u) a vision tower brings into the language model's residual stream: its image
    embeddings' (vision_error_factor), and Qwen3-VL's DeepStack features (each from at most `depth` blocks and a
    merger of the same widths), entering after the first layers as further inputs of that error, independent of the
    image embeddings': sqrt(1 + DeepStack features) times it."""
    return vision_error_factor(vision, longest_segment) * math.sqrt(1 + len(vision.deepstack_visual_indexes))


def fp32_bound(spec, seq_len: int, n_positions: int, rms: float, score: bool = False,
               vision_segment: int = 0) -> float:
    """The float32 tolerance for this model: the max abs logprob (or score) difference rounding explains over
    `n_positions` real positions (sequences, for scores) with reference logits (scores) of RMS `rms`. vision_segment:
    with images (a vision-language spec), the longest run of patches the vision tower attends over (a frame)."""
    widths = layer_widths(spec, seq_len)
    if score:
        return fp32_output_bound(spec.hidden_size, widths, spec.num_layers, rms, n_positions)
    vision = getattr(spec, "vision", None)
    extra = vision_input_error(vision, vision_segment) if vision is not None and vision_segment else 0.0
    return fp32_logprob_bound(spec.hidden_size, widths, spec.num_layers, spec.vocab_size, rms, n_positions, extra)


# bfloat16 builds. A bf16 value keeps 8 significant bits (7 stored), so one rounding to nearest errs by at most
# u = 2**-8 relative. Matrix products and reductions accumulate in float32 (oneDNN on CPU, tensor cores on GPU), so
# their summation error is float32-sized; what a bf16 forward adds is the rounding of every tensor it stores in bf16.
# Counted along one value's path through a dense decoder layer (the weights once each: a bf16 build holds them rounded):
BF16_UNIT = 2.0 ** -8
BF16_LAYER_ROUNDINGS = ("input norm", "q/k/v weights", "q/k/v", "rotary q/k", "scores", "probabilities",
                        "attention values", "output projection weight", "attention output", "residual add",
                        "MLP norm", "gate/up weights", "gate/up", "SiLU", "SiLU * up", "down projection weight",
                        "MLP output", "residual add")
BF16_HEAD_ROUNDINGS = ("final norm", "LM head weight", "logits")


def bf16_logit_relative_error(layers: int) -> float:
    """Spread of a bf16 build's logits relative to their RMS, against exact arithmetic: the roundings of every layer
    and the head, independent and of random sign (each at most BF16_UNIT), add as the square root of their count."""
    count = len(BF16_LAYER_ROUNDINGS) * max(int(layers), 1) + len(BF16_HEAD_ROUNDINGS)
    return BF16_UNIT * math.sqrt(count)


def bf16_logprob_spread(layers: int, logits_rms: float) -> float:
    """Spread of the per-token logprob error of a bf16 build against float32 (whose own error is negligible beside
    it): z_t - logsumexp(z) errs by at most twice the logit error. Two bf16 implementations (the trainer and the
    engine) differ by sqrt(2) times this; the largest of n tokens' errors stays below tail_factor(n) times it."""
    return 2.0 * bf16_logit_relative_error(layers) * logits_rms
