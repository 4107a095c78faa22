"""The memory terms of `megarl plan` that are not a model's states: each a pure function of sizes, in bytes.

Logits of the log-prob / entropy passes (megarl.megatron.vocab_parallel, megarl.algo.entropy): the LM head writes
L = tokens * V_padded / TP logits per rank in the parameter dtype (p bytes); the maths runs in float32, on a copy
(c = 4 bytes) unless the logits are float32 already (c = 4 too: vocab_parallel_cross_entropy works in place, so the
log-prob takes a clone).
  forward only (old/ref log-probs):  L * (p + 4)
      the logits and the float32 tensor vocab_parallel_cross_entropy exponentiates in place.
  update (forward and backward):     L * (p + 4 + 12 + e) [+ L * 4 with actor.entropy_coeff != 0]
      the logits, the float32 softmax the cross-entropy saves for its backward, and the entropy metric's
      temporaries: its float32 copy (e = 4; e = 0 for float32 logits, used as they are), the shifted logits, their
      exponentials and the product summed (12); an entropy bonus keeps one more float32 tensor in its graph. The
      backward (the logits' float32 gradient and its cast) stays below this peak.
  Measured on CPU with megarl's own functions at 1024 tokens x vocab 151,936 (peak resident bytes above a baseline):
  bfloat16 6.09 / 21.98 / 25.98 bytes per logit (forward / update / with an entropy bonus), float32 8.10 / 19.86 /
  23.87; these formulas give 6 / 22 / 26 and 8 / 20 / 24 (tests/dist/test_plan_logits_memory.py holds them to 5%).
Routing replay (actor.router_replay.mode R2/R3, or rollout.return_routed_experts): routes [N, S, layers, top_k] int16
(N rows of the rollout batch, S = prompt + response tokens, every decoder layer).
  host, every trainer process:        N * S * layers * k * 2 (the batch's routes, from the old-logprob pass on)
  host, each replica's engine owner:  (N / replicas) * S * layers * k * 2 * 2 (megarl.rollout.vllm.routes
      .RouteRecorder grows each request's rows by doubling: up to twice the positions it holds)
  device, each engine worker:         max_num_batched_tokens * layers * k * 4 (vLLM's capture buffer, int32)
  device, R2 old-logprob pass:        N * S * layers * k * 4 (megarl.megatron.router_replay.gather_recorded's int32
      all-reduce copy of the recorded routes)
Weight-sync buckets (rollout.update_weights_bucket_megabytes = B): a sending GPU fills one bucket of the pieces it
sends, min(B, bytes it sends); a GPU hosting an engine worker receives into two alternating slots, 2 * min(B, its
worker's shard). On the host, each receiving rank keeps its two shared-memory slot files mapped for the whole run:
2 * min(B, shard) per engine worker on the node.
Merged LoRA sync (actor.lora.sync=merged): the engine receives base + scaling * B A, made per weight as the delivery
cuts its pieces (megarl.bridge.sharding.merged_value: the product B A, scaled and added to in place, one new tensor
of the base weight's local size; a fused weight, QKV or the gated fc1, merged whole once per bucket it has pieces in).
The merged weights of a bucket stay alive until the bucket is delivered: on CPU the rank writes them into the engine's
parameters and drops them with the bucket (1 bucket kept); on GPU the engine worker pulls from them while the rank
fills the next bucket (megarl.sync.pull: 2 buckets kept). A bucket of B loaded bytes holds pieces of 1 / spread of
their merged weights when the engine's TP is spread = engine TP / TP times the trainer's (each worker loads its
shard of a weight the rank holds whole), and the tensor being merged when the bucket closes may reach past it:
  min(M, kept x spread x B + largest)
M: the stage's merged weights (every adapted megatron weight on the rank, its TP share, its EP share of the experts),
largest: the largest of them. At most the whole of M: no weight is merged twice in a bucket.
Context parallelism (parallelism.context_parallel_size = CP > 1): megatron splits each packed row into 2 * CP chunks and
CP rank r holds chunks r and 2 * CP - 1 - r (the load-balanced order for causal attention), each row padded to a
multiple of 2 * CP tokens. A micro-batch of T tokens in R rows is thus at most T + R * (2 * CP - 1) tokens, and each
CP rank computes 1/CP of them: its activations, its logits and every per-token tensor are of t = that / CP tokens.
Attention needs every chunk's keys and values; with k = this rank's K and V of its t tokens in one layer
(t x 2 x KV heads / TP x head dim x p; MLA: t x heads / TP x (q head dim + v head dim) x p, K and V per head) and
o = its attention output (t x heads / TP x v head dim x p), one layer at a time holds
  Transformer Engine (p2p ring, AttnFuncWithCPAndKVP2P)
      forward:  CP x (k + o): every ring step's received K/V stays in its p2p buffer until the attention returns,
                and every step's partial output until they are merged (the last CP rank's steps all see its whole
                queries); the per-step softmax statistics (fp32, 2/head dim of o) are left out
      backward: 4 k: two ring buffers, each of K/V and their gradients dK/dV
  without TE (megarl all-gathers K and V over the CP group)
      forward:  CP x k: the whole row's K and V of this rank's heads
      backward: 2 x CP x k: them again and their gradient, before the gradient's reduce-scatter
the update holds the larger of its forward's and its backward's, the forward-only passes their forward's, on top of
the stored activations. Weights, gradients and optimizer states are replicated over CP as over DP: the distributed
optimizer shards dense states over the DP x CP group (megarl.plan.memory).
GPU overhead: the CUDA context, cuBLAS workspaces and NCCL communicators of each trainer process, CUDA_CONTEXT_GIB;
and the caching allocator's reserved-but-unallocated memory, ALLOCATOR_SHARE of what the trainer allocates in the
phase (a colocated engine's share is counted by gpu_memory_utilization, which holds its own context).
Checkpoint save on a CPU trainer: megatron's file writer (dist_checkpointing's filesystem_async, _clone_if_needed)
clones each saved CPU tensor that is a view of a larger storage before it writes it; on GPU the same staging is the
device-to-host copy, counted on the host below. The views are the gate and up halves of every gated MLP's fc1
(megatron saves its [2f, h] weight as two tensors), of the dense layers and of each local expert, and the same halves
of their optimizer states; models are saved one after the other, so the peak is the largest model's:
  fc1 elements on the stage x (parameter bytes [+ 4 fp32 master in 16-bit + 8 Adam moments, where they train])
Optimizer step on a CPU trainer: megatron falls back to torch.optim.Adam(W), whose single-tensor step computes
  denom = (exp_avg_sq.sqrt() / c).add_(eps), two float32 temporaries of the parameter's size alive at once, one
  parameter at a time; the update's activations are freed by then, so the phase holds
  states + max(activations, 2 * 4 * the largest trained parameter's elements)
(on GPU megatron's fused Adam updates in place).
Forward working set on a CPU trainer (old/ref log-probs, critic values: no gradient, nothing stored): one layer's
  transients at its MLP, tokens x p x (5f / TP + 4h): megatron's unfused gated unit keeps fc1's output (2f), the
  activation of its gate half (f), the linear half plus its offset (f) and their product (f); beside them the
  embedding output, the normed input and the two residual sums (4h). MoE layers take f = top_k x f_moe (each token
  through top_k experts; not yet measured).
Stored activations on a CPU trainer: the activation formula (megarl.plan.memory) counts a gated MLP's fc1 output and
  the gated unit's output, 3f elements per token and layer, as a fused kernel keeps them. Megatron's unfused gated unit
  (CPU; no Transformer Engine) also keeps for the backward the linear half plus its offset and the activation of the
  gate half, each saved by their product: 2f elements more per token and layer in flight (f = top_k x f_moe in MoE
  layers), in the parameter dtype.
Host: HOST_PROCESS_GIB per process (Python, torch, megatron-core, CUDA's host side); pinned offload buffers (the
offloaded states; megarl.megatron.offload keeps the buffer once allocated); checkpoint save:
torch.distributed.checkpoint stages each rank's saved shard (parameters, fp32 master copy, Adam moments of actor and
critic) in host memory before it writes it.
"""
from __future__ import annotations

from megarl.plan.model import GIB

CUDA_CONTEXT_GIB = 1.0  # per trainer process: CUDA context ~0.5 GiB, cuBLAS workspaces and NCCL buffers the rest
ALLOCATOR_SHARE = 0.05  # torch's caching allocator: reserved minus allocated at the peak, as a share of allocated
HOST_PROCESS_GIB = 3.0  # per process: Python, torch, megatron-core or vLLM, CUDA's host-side state
ROUTE_BYTES = 2  # int16 expert ids


def logits_elements(tokens: int, padded_vocab: int, tp: int) -> int:
    """L: one rank's logits of a micro-batch of `tokens` tokens, its vocab shard V_padded / TP."""
    return tokens * (padded_vocab // tp)


def forward_logits_bytes(tokens: int, padded_vocab: int, tp: int, pbytes: int) -> int:
    """Old/ref log-prob pass (no gradient): L * (p + 4), see the module doc."""
    return logits_elements(tokens, padded_vocab, tp) * (pbytes + 4)


def update_logits_bytes(tokens: int, padded_vocab: int, tp: int, pbytes: int, entropy_bonus: bool) -> int:
    """Update pass (forward and backward): L * (p + 16 + e) [+ 4 L with an entropy bonus], e = 0 for float32
    logits else 4; see the module doc."""
    copy = 0 if pbytes == 4 else 4
    return logits_elements(tokens, padded_vocab, tp) * (pbytes + 16 + copy + (4 if entropy_bonus else 0))


def route_bytes(rows: int, seq_len: int, layers: int, topk: int, elem: int = ROUTE_BYTES) -> int:
    """routes [rows, seq_len, layers, topk] of `elem` bytes each."""
    return rows * seq_len * layers * topk * elem


def engine_route_recorder_bytes(rows: int, replicas: int, seq_len: int, layers: int, topk: int) -> int:
    """One replica's engine owner process: its share of the requests' routes, int16, doubled for growth."""
    return 2 * route_bytes(-(-rows // replicas), seq_len, layers, topk)


def engine_route_capture_bytes(max_num_batched_tokens: int, layers: int, topk: int) -> int:
    """vLLM's routed-experts capture buffer on each engine worker, int32."""
    return max_num_batched_tokens * layers * topk * 4


def send_bucket_bytes(bucket: int, sent: int) -> int:
    """The one bucket a sending GPU fills: it never exceeds what the GPU sends."""
    return min(bucket, sent)


def receive_bucket_bytes(bucket: int, shard: int) -> int:
    """The two alternating slots of a GPU hosting an engine worker (one filled while the other loads)."""
    return 2 * min(bucket, shard)


def lora_merged_sync_bytes(merged: int, largest: int, bucket: int, kept: int, spread: int = 1) -> int:
    """Merged LoRA sync: the merged weights (base + scaling * B A) alive on a rank while it delivers, of `merged`
    bytes on its stage, the largest `largest`; `kept` buckets of `bucket` loaded bytes (1 on CPU, 2 where the engine
    pulls), `spread` = engine TP / trainer TP (at least 1): min(merged, kept * spread * bucket + largest). See the
    module doc."""
    return min(merged, kept * max(1, spread) * bucket + largest)


def cuda_context_bytes() -> int:
    return int(CUDA_CONTEXT_GIB * GIB)


def allocator_reserve_bytes(allocated: int) -> int:
    """The caching allocator's slack over `allocated` bytes of live tensors."""
    return int(ALLOCATOR_SHARE * max(0, allocated))


def host_process_bytes(processes: int) -> int:
    return int(HOST_PROCESS_GIB * GIB) * processes


def delta_kept_where(r, pl, adapter_bytes) -> str:
    """Where a trainer GPU keeps what it last sent with delta updates: "host", "device" (rollout.delta_kept_on), or
    "" without delta updates (engines colocated, adapters only, or off; None resolves by the engine dtype on GPU).
    r: the recipe's rollout section; pl: megarl.plan.model.Placement."""
    if not pl.separate or adapter_bytes is not None or not r.resolved_delta_updates(on_gpu=True):
        return ""
    return r.delta_kept_on


def delta_kept_bytes(sent: int) -> int:
    """Delta updates (rollout.delta_updates, engines placed apart): what a trainer GPU's process keeps, what it last
    sent of each piece in the engine's dtype = the bytes it sends in a full update (one copy, brought up to date in
    place; host memory or the GPU's as rollout.delta_kept_on says)."""
    return int(sent)


def delta_update_bytes(full: int, element_bytes: int, changed_share: float) -> int:
    """Bytes of a delta update whose `full` bytes of elements of `element_bytes` each change by `changed_share`,
    scattered (no runs to gain from): per piece the fewest of indices and values (megarl.sync.delta: int32 indices
    for pieces under 2^31 elements), a bitmask and the values, or the piece whole."""
    from megarl.sync.delta import DENSE, INDICES, MASK, encoded_bytes

    n = full // element_bytes
    piece = min(n, 2 ** 30)  # the sync's pieces are single tensors' boxes: int32 indices, never one 2^31+ piece
    changed = int(piece * changed_share)
    return int(min(encoded_bytes(kind, piece, element_bytes, changed, changed) for kind in (DENSE, INDICES, MASK))
               * (n / piece)) if piece else 0


def fc1_elements(spec, stage_layers: list[int], stage: int, tp: int, ep: int, expert_tp: int) -> int:
    """Elements of the gated MLPs' fc1 weights ([2f, h] each) one rank of pipeline stage `stage` holds: dense layers
    2 * ffn * h / TP, MoE layers (spec.moe_layers) num_experts / EP local experts of 2 * ffn_moe * h / expert TP and a
    shared expert of 2 * ffn_shared * h / TP. spec: megarl.bridge.hf_config.ArchSpec."""
    first = sum(stage_layers[:stage])
    h, out = spec.hidden_size, 0
    for layer in range(first, first + stage_layers[stage]):
        moe = spec.is_moe and (not spec.moe_layers or spec.moe_layers[layer])
        if moe:
            out += spec.num_experts // ep * 2 * spec.moe_ffn_hidden_size * h // expert_tp
            out += 2 * spec.shared_expert_ffn_hidden_size * h // tp
        else:
            out += 2 * spec.ffn_hidden_size * h // tp
    return out


def cpu_checkpoint_clone_bytes(fc1: int, pbytes: int, trains: bool) -> int:
    """A CPU trainer's checkpoint save: the clones of one model's split fc1 views, fc1 elements x (pbytes [+ the
    optimizer's 4 master (16-bit parameters) + 8 Adam bytes where the model trains them]); see the module doc."""
    optim = ((4 if pbytes == 2 else 0) + 8) if trains else 0
    return fc1 * (pbytes + optim)


def largest_trained_elements(spec, stage: int, stages: int, tp: int, expert_tp: int, padded_vocab: int,
                             value_head: bool = False, lora_rank: int = 0) -> int:
    """Elements of the largest parameter tensor one rank of pipeline stage `stage` trains: the embedding
    [V_padded / TP, h] (first stage), the untied output layer (last stage; a critic's value head is [1, h]), and per
    layer the fused QKV [(q + 2kv) / TP, h], the attention output [h, q / TP], the dense fc1 [2f / TP, h] and fc2
    [h, f / TP], an expert's fc1 [2f_moe / expert TP, h]. With LoRA only the adapters train: rank x the widest
    adapted side (fc1's 2f / TP)."""
    h = spec.hidden_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    if lora_rank:
        return lora_rank * max(2 * spec.ffn_hidden_size // tp, (q + 2 * kv) // tp, h)
    sizes = [(q + 2 * kv) // tp * h, h * q // tp, 2 * spec.ffn_hidden_size // tp * h]
    if spec.is_moe:
        sizes.append(2 * spec.moe_ffn_hidden_size // expert_tp * h)
    if stage == 0:
        sizes.append(padded_vocab // tp * h)
    if stage == stages - 1 and not value_head and not spec.tie_word_embeddings:
        sizes.append(padded_vocab // tp * h)
    return max(sizes)


def cpu_adam_step_bytes(largest_elements: int) -> int:
    """torch Adam's step temporaries on a CPU trainer: 2 float32 tensors of the largest trained parameter."""
    return 2 * 4 * largest_elements


def cpu_forward_working_set_bytes(spec, tokens: int, tp: int, pbytes: int) -> int:
    """A no-gradient forward's one-layer transients, tokens x pbytes x (5f / TP + 4h); see the module doc."""
    dense = not spec.is_moe or (spec.moe_layers and not all(spec.moe_layers))
    f = spec.ffn_hidden_size if dense else spec.moe_topk * spec.moe_ffn_hidden_size
    return tokens * pbytes * (5 * f // tp + 4 * spec.hidden_size)


def cpu_unfused_glu_bytes(spec, tokens: int, layers_in_flight: float, tp: int, pbytes: int) -> int:
    """The unfused gated unit's extra stored activations: tokens x layers in flight x 2f / TP x pbytes (see the
    module doc)."""
    dense = not spec.is_moe or (spec.moe_layers and not all(spec.moe_layers))
    f = spec.ffn_hidden_size if dense else spec.moe_topk * spec.moe_ffn_hidden_size
    return int(tokens * layers_in_flight * 2 * f // tp * pbytes)


def cp_rank_tokens(tokens: int, rows: int, cp: int) -> int:
    """t: one CP rank's tokens of a micro-batch of `tokens` tokens in `rows` packed rows, each row padded to a multiple
    of 2 * CP (at most 2 * CP - 1 tokens more), the padded pack split over CP ranks; see the module doc."""
    if cp == 1:
        return tokens
    return -(-(tokens + rows * (2 * cp - 1)) // cp)


def attention_kv_bytes(spec, tokens: int, tp: int, pbytes: int) -> int:
    """k: K and V of `tokens` tokens in one layer for one TP rank's heads, [tokens, 2, KV heads / TP, head dim]; MLA
    [tokens, heads / TP, q head dim + v head dim] (K and V expanded per head). spec: an ArchSpec."""
    if spec.mla is not None:
        return tokens * (spec.num_attention_heads // tp) * (spec.mla.q_head_dim + spec.mla.v_head_dim) * pbytes
    return tokens * 2 * max(1, spec.num_key_value_heads // tp) * spec.head_dim * pbytes


def attention_out_bytes(spec, tokens: int, tp: int, pbytes: int) -> int:
    """o: the attention output of `tokens` tokens in one layer on one TP rank, [tokens, heads / TP, v head dim]."""
    v = spec.mla.v_head_dim if spec.mla is not None else spec.head_dim
    return tokens * (spec.num_attention_heads // tp) * v * pbytes


def cp_attention_bytes(kv: int, out: int, cp: int, te: bool, backward: bool) -> int:
    """The one-layer transient of context-parallel attention beyond the stored activations, from k = `kv` and o =
    `out` (this rank's own tokens): Transformer Engine's ring CP x (k + o) forward, 4 k backward; without TE the
    all-gathered CP x k forward, 2 x CP x k backward; `backward`: the larger of forward and backward (an update).
    0 at CP 1. See the module doc."""
    if cp == 1:
        return 0
    forward, back = (cp * (kv + out), 4 * kv) if te else (cp * kv, 2 * cp * kv)
    return max(forward, back) if backward else forward


# blockwise CP attention's largest core call, in score elements (megarl.megatron.context_parallel.CALL_SCORES, which a
# test keeps equal to this: the planner does not import the model code)
CP_CALL_SCORES = 1 << 24


def cp_block_scores_bytes(heads: int, row_len: int, rows_alike: int, cp: int, limit: int = CP_CALL_SCORES) -> int:
    """Blockwise context-parallel attention's one-call transient without Transformer Engine
    (megarl.megatron.context_parallel.blockwise): its largest call's scores held three times over in float32 (the
    scores, their difference to the peak and its exp; in backward the exp, its gradient and the scores' gradient).

    The largest blocks: a row of row_len tokens is cut into 2 CP chunks of c = ceil(row_len / 2 CP), and the last
    chunk's queries see the 2 CP - 1 chunks before it whole, c x (2 CP - 1) c scores per query head; blocks of one
    shape share a call, so `rows_alike` rows of that length make one call of rows_alike x heads x c x (2 CP - 1) c,
    cut at `limit` elements. heads: query heads on the rank (heads / TP). 0 at CP 1.
    cp_block_scores_bytes(14, 4016, 1, 2) == 3 x 4 x 2^24 (a call of 42,332,112 elements, cut)."""
    if cp == 1:
        return 0
    c = -(-row_len // (2 * cp))
    return 3 * 4 * min(rows_alike * heads * c * (2 * cp - 1) * c, limit)


# ---------------------------------------------------------------------------------------------------------------------
# MoE layers as megarl builds them (megarl.megatron.model.transformer_config: moe_token_dispatcher_type="allgather",
# sequence parallel over TP, experts split over expert TP X and EP ranks) and megatron-core 0.16's
# MoEAllGatherTokenDispatcher runs them. One rank of a micro-batch of t tokens (its CP share) holds t / TP of them at
# the layer's input (sequence parallel; t without TP); the dispatcher all-gathers them over the expert TP x EP group:
#   G = t / TP x X x EP tokens: hidden states [G, h], probs [G, E] (float32) and the routing map [G, E] (bool), one
#   layer at a time. The gathered hidden states land in megatron's global memory buffer, kept by the process from the
#   first forward on (a state line of its own, megarl.plan.memory.moe_gather_buffer), and the layer makes a [G, h]
#   anew in its combine (the unpermuted expert outputs before their reduce-scatter) and in its backward (the gradient
#   all-gathered), so one [G, h] is in the layer's own line as well;
# then keeps the copies routed to its E / EP local experts: G x top_k / EP on average, x the routing imbalance m (the
# busiest rank's tokens over the mean, parallelism.moe_routing_imbalance) on the busiest rank. Each copy stores its
# permuted input (h elements: expert TP splits the FFN, not the hidden size) and the expert's 6 f_moe / X (fc1 out,
# the gated unit's output, in the formula's 16-bit units as the dense MLP's 6f). Per token of t, in those units:
#   routed    (X / TP) x top_k x m x (2h + 6 f_moe / X)
#   shared    6 f_shared / TP (a dense gated MLP beside the routed experts, Qwen2-MoE / DeepSeek-V3 / GLM-4.5)
# At X = TP this is top_k x m x (2h x TP + 6 f_moe) / TP: the permuted inputs are whole hidden vectors on every
# expert-TP rank, not a 1/TP share.
MOE_DISPATCH_PROBS_BYTES = 4 + 1  # a float32 prob and a bool routing-map entry per gathered token and expert


def moe_gathered_tokens(tokens: int, tp: int, sp: bool, expert_tp: int, ep: int) -> int:
    """G: the tokens the allgather dispatcher holds in one MoE layer on one rank (see above): the rank's input tokens
    (tokens / TP with sequence parallel) x expert TP x EP."""
    local = -(-tokens // tp) if sp and tp > 1 else tokens
    return local * expert_tp * ep


def moe_dispatcher_bytes(gathered: int, hidden: int, experts: int, pbytes: int, group: int) -> int:
    """One layer's gathered buffers, G x (h x p + E x 5): the hidden states, the float32 probs and the bool routing
    map over the expert TP x EP `group`; 0 where the group is one rank (megatron gathers nothing)."""
    if group <= 1:
        return 0
    return gathered * (hidden * pbytes + experts * MOE_DISPATCH_PROBS_BYTES)


def moe_routed_units_per_token(spec, tp: int, sp: bool, expert_tp: int, imbalance: float) -> float:
    """The routed experts' stored activations per token of the micro-batch in one MoE layer, in the formula's 16-bit
    units: (X / TP_sp) x top_k x m x (2h + 6 f_moe / X), TP_sp = TP with sequence parallel, else 1."""
    share = expert_tp / (tp if sp and tp > 1 else 1)
    return share * spec.moe_topk * imbalance * (2 * spec.hidden_size + 6 * spec.moe_ffn_hidden_size / expert_tp)


def moe_shared_units_per_token(spec, tp: int) -> float:
    """The shared experts' stored activations per token in one MoE layer (16-bit units): 6 f_shared / TP."""
    return 6 * spec.shared_expert_ffn_hidden_size / tp


def is_moe_layer(spec, layer: int) -> bool:
    return spec.is_moe and (not spec.moe_layers or bool(spec.moe_layers[layer]))


# ---------------------------------------------------------------------------------------------------------------------
# The update's backward transient, beyond the stored activations: the gated MLP's backward of the first layer the
# backward reaches (every layer's activations are still stored then; the LM head's logits and their gradients are
# freed by then, so the line is what exceeds the logits' bytes). For an MLP of width f on one rank with its t tokens:
# fc2's backward makes grad(g) [t, f] and frees g; the gated unit's backward makes grad(gate) and grad(linear), [t, f]
# each, and concatenates them into grad(fc1 out) [t, 2f]: 2f elements per token over the stored ones at its peak
# (fused or not: the fused SwiGLU backward makes grad(fc1 out) [t, 2f] from grad(g) [t, f] alive beside it).
# Without gradient-accumulation fusion (no Transformer Engine layers: megatron's own linear computes each weight's
# gradient as a new tensor and adds it to the fp32 main_grad) also the largest weight gradient of the layer, in the
# parameter dtype. Per MLP kind, t x 2f / TP x p: dense f / TP over t tokens; the shared expert the same at
# f_shared; routed experts, one expert at a time on CPU (megatron's SequentialMLP without grouped GEMM: G x top_k x m
# / E copies), all local ones at once with Transformer Engine's grouped GEMM (G x top_k x m / EP), at f_moe / X.


def backward_mlp_transient_bytes(spec, tokens: int, tp: int, sp: bool, expert_tp: int, ep: int, imbalance: float,
                                 pbytes: int, grouped: bool, weight_grad_fused: bool, stage_layers: range) -> int:
    """The update backward's transient of one MLP on one rank (see above): the largest over the stage's layer kinds of
    copies x 2 x width x p, plus (without gradient-accumulation fusion) the largest weight gradient, [2 width, h]."""
    h = spec.hidden_size
    kinds = []  # (token copies, width on this rank)
    moe = [is_moe_layer(spec, i) for i in stage_layers]
    if not all(moe):
        kinds.append((tokens, spec.ffn_hidden_size / tp))
    if any(moe):
        g = moe_gathered_tokens(tokens, tp, sp, expert_tp, ep)
        per = spec.moe_topk * imbalance * g / (ep if grouped else spec.num_experts)
        kinds.append((per, spec.moe_ffn_hidden_size / expert_tp))
        if spec.shared_expert_ffn_hidden_size:
            kinds.append((tokens, spec.shared_expert_ffn_hidden_size / tp))
    act = max(n * 2 * w for n, w in kinds) * pbytes
    weight = 0 if weight_grad_fused else max(2 * w * h for _, w in kinds) * pbytes
    return int(act + weight)


# ---------------------------------------------------------------------------------------------------------------------
# The optimizer step's temporaries, by the optimizer that runs. megatron-core (optimizer/__init__.py) takes Transformer
# Engine's FusedAdam, else apex's, else torch.optim.AdamW. The fused ones update in place (no temporaries). torch's
# AdamW on CUDA defaults to its foreach path (_multi_tensor_adam): per parameter group it decays the parameters in
# place, updates exp_avg/exp_avg_sq in place, then exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs): one float32
# tensor per main parameter of the group, all alive at once until the addcdiv. On CPU it takes the single-tensor path
# (_single_tensor_adam: two float32 temporaries of one parameter, cpu_adam_step_bytes). megatron groups the
# parameters by weight decay, learning-rate scale and expert or not: the largest group is (nearly) the rank's dense or
# its expert main parameters, each sharded by the distributed optimizer.
OPTIMIZER_FUSED = "fused Adam of Transformer Engine or apex: in place"
OPTIMIZER_FOREACH = "torch AdamW foreach: one fp32 temporary per parameter of a group"
OPTIMIZER_SINGLE = "torch AdamW single-tensor (CPU): two fp32 temporaries of the largest parameter"


def foreach_adam_step_bytes(group_elements: int) -> int:
    """torch AdamW foreach: exp_avg_sq_sqrt, 4 bytes per main parameter of the largest group."""
    return 4 * group_elements


def local_layers_extra_bytes(spec, tokens: int, layers_in_flight: float, tp: int, sp: bool, pbytes: int,
                             expert_tp: int, imbalance: float, first: bool, last: bool) -> int:
    """What megatron's local layers (no Transformer Engine; the CPU trainer's) store beyond the activation formula,
    in the parameter dtype, from the live tensors of a measured update at its peak (`megarl plan --measure`,
    Qwen3-MoE widths, 1,024-token rows): per token and layer
      2h / TP_sp   each of the two RMSNorms (torch's, unfused) keeps its normalised input x * rsqrt beside its output
      (q + kv) / TP  rotary embedding's rotated copies of q and k, while the fused QKV output they were cut from stays
                   alive through v (a view of it)
      (2q + kv) / TP with q/k layer norms (Qwen3): the copied query heads and both norms' normalised inputs
      f_moe / X per routed copy (MoE layers): the gated unit's output, kept by its product with the router's probs
    and once per token the embedding's output (first stage, h / TP_sp) and the final norm's input and normalised input
    (last stage, 2h / TP_sp)."""
    h = spec.hidden_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    tsp = tp if sp and tp > 1 else 1
    per_layer = 2 * h / tsp + (q + kv) / tp + ((2 * q + kv) / tp if spec.qk_layernorm else 0)
    if spec.is_moe:
        copies = expert_tp / tsp * spec.moe_topk * imbalance
        moe_share = (sum(1 for m in spec.moe_layers if m) / len(spec.moe_layers)) if spec.moe_layers else 1.0
        per_layer += moe_share * copies * spec.moe_ffn_hidden_size / expert_tp
    once = (h / tsp if first else 0) + (2 * h / tsp if last else 0)
    return int(tokens * (layers_in_flight * per_layer + once) * pbytes)
