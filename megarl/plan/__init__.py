"""`megarl plan`: will a recipe fit on a cluster? Per-GPU memory of every term, weight-sync bytes and time, a verdict.

Pure arithmetic on the recipe and the model's config.json (no GPU, no weights). The parameter bytes each Megatron rank
holds and the bytes each GPU sends, receives and loads into its engine worker per weight sync come from the sync
plan (megarl.sync.plan.build_plan, the plan the live sync runs), so the two never disagree about who holds what.

The memory model (bytes per GPU; P = parameters this rank holds, from the plan)
* Trainable model (actor; critic with a 1-wide value head instead of the LM head):
    parameters      P * 2 (bf16) or 4 (fp32)
    gradients       P * 4 (megarl reduces gradients in fp32: grad_reduce_in_fp32)
    optimizer       Adam: fp32 master copy + exp_avg + exp_avg_sq = 12 B/param in bf16 (8 in fp32, no master copy);
                    with the distributed optimizer divided by the data-parallel size (dense parameters) or the
                    expert-data-parallel size world / (expert TP * EP * PP) (expert parameters).
    activations     per token per layer, bf16, flash attention (no score matrix), SwiGLU, GQA, no dropout:
                    8h (norm inputs and residual stream, /TP with sequence parallel) + (4q + 4kv + 6f) / TP
                    with q = heads*head_dim, kv = kv_heads*head_dim, f = FFN size; MoE: f-term -> top_k * (2h + 6f_moe)
                    / expert TP. selective recompute drops the attention output (2q); full recompute keeps only each
                    layer's input (2h, /TP with SP) plus one layer's full activations being recomputed.
                    1F1B pipeline: stage s holds min(PP - s, micro-batches) micro-batches in flight; interleaved
                    1F1B (virtual pipeline stages) more, in chunks of layers/(PP*VPP) (see in_flight_layers). The
                    last stage adds the logits, tokens * vocab / TP * 8 B (fp32 logits and their gradient).
* Reference: parameters only, plus the logits of one forward micro-batch.
* Reward model (reward.reward_model.enable): parameters only (frozen, at the trainer's layout), counted from its
  config.json (the policy's shape when it does not exist yet): embedding on the first stage, layers split over PP,
  attention and MLP over TP, experts over EP, a 1-wide head.
* Engine (vLLM): it takes gpu_memory_utilization * GPU memory: its weight shard (from the plan), an activation
  estimate for max_num_batched_tokens, and the rest is the KV cache (it must hold at least one max_model_len sequence):
  per token 2 * layers * KV heads per rank * head_dim, or with MLA (DeepSeek-V3) layers * (kv_lora_rank +
  qk_rope_head_dim), the compressed latent, whole on every engine TP rank. Uneven pipeline stages
  (parallelism.num_layers_in_first/last_pipeline_stage) give each stage its own layer count.
  Colocated with enable_sleep_mode it releases everything while the trainer computes; without it, it keeps its share.
* Sync buffers: two buckets (rollout.update_weights_bucket_megabytes): the one being gathered and the one being loaded.
* Reserve: CUDA context, NCCL and allocator fragmentation, a fixed RESERVE_GIB.
* Offload (actor.offload, critic.offload, ref.offload): the selected states (parameters, gradients, optimizer) are in
  pinned host memory from the weight sync to the next forward, so the rollout phase holds only the rest, and a
  colocated engine's KV cache can grow by what was freed (the plan names the gpu_memory_utilization that takes it). Its
  cost is a round trip of those bytes over the host link, estimated at HOST_LINK_GBPS.
Phases (the peak is their maximum): rollout (states [- offloaded] + engine), logprob forwards (states + forward logits [+ engine
if it does not sleep]), training (states + activations [+ engine]), weight sync (states + engine weights + buffers).
"States" are the parameters, gradients and optimizer states of actor, critic and reference, always resident.

Weight sync: each engine worker loads its own shard; the GPU hosting it receives from other GPUs only the pieces
of that shard it does not hold itself. At a link bandwidth B the sync takes at least max(received) / B.
Engines (colocated): rollout.data_parallel_size replicas of engine TP GPUs each, by default every GPU; with
enable_sleep_mode and free_cache_engine they release their memory between a rollout and the next weight sync.
Engines placed separately (rollout.placement=separate, Ray mode): replicas x engine TP GPUs beyond the trainer's, each
holding gpu_memory_utilization of its GPU throughout (no sleep); every engine GPU receives its whole shard from the
trainer GPUs, and the trainer GPUs' phases have no engine term.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megarl.bridge.hf_config import CONFIG_FILE, ArchSpec, BridgeError, read_config_json, spec_from_dict
from megarl.layout import Layout
from megarl.sync.plan import DTYPE_BYTES, build_plan

GIB = 1024 ** 3
RESERVE_GIB = 2.0  # CUDA context, NCCL buffers, allocator fragmentation
DEFAULT_GPU_MEM_GIB = 80.0
DEFAULT_LINK_GBPS = 50.0  # GB/s: one 400 Gb/s NIC per GPU
HOST_LINK_GBPS = 25.0  # GB/s: pinned host <-> H100 copies over PCIe Gen5 x16, per direction, as measured in practice


class PlanError(ValueError):
    """The recipe or the cluster cannot be planned (a missing config.json, a layout the plan refuses)."""


@dataclass
class ModelMemory:
    """One trainable or frozen model's per-GPU bytes on the most loaded rank of each pipeline stage."""

    name: str
    params: list[int]  # per stage
    grads: list[int] = field(default_factory=list)
    optim: list[int] = field(default_factory=list)
    optim_distributed: list[int] = field(default_factory=list)
    optim_replicated: list[int] = field(default_factory=list)
    activations: list[int] = field(default_factory=list)

    def state(self, s: int) -> int:
        return self.params[s] + (self.grads[s] if self.grads else 0) + (self.optim[s] if self.optim else 0)


@dataclass
class PlanReport:
    text: str
    fits: bool
    peak_bytes: int
    per_gpu_bytes: int  # the peak over phases on the most loaded GPU
    reasons: list[str]
    terms: dict[str, float]  # GiB, the most loaded GPU's terms
    sync_bytes_per_engine_rank: int
    sync_seconds_lower_bound: float
    offloaded_bytes: int = 0  # trainer states in host memory during rollout on the most loaded GPU


def n_params_total(plan) -> int:
    return plan.total_bytes // plan.element_bytes


def _read_hf_config(cfg) -> dict:
    for candidate in (cfg.model.config_path, cfg.model.path and str(Path(cfg.model.path) / CONFIG_FILE)):
        if candidate and Path(candidate).is_file():
            data = _read_json(candidate, "model.config_path" if candidate == cfg.model.config_path else "model.path")
            return data.get("text_config", data)
    raise PlanError("the planner needs the model's config.json: set model.config_path (a config.json) or a model.path "
                    "that exists on this machine")


def _read_json(path, key: str) -> dict:
    try:
        return read_config_json(path)
    except BridgeError as exc:  # it names the file, what is wrong with it and the fix
        raise PlanError(f"{key}: {exc}") from None


def _per_stage_max(values: dict[int, int], world: int, pp: int) -> list[int]:
    """The most loaded rank of each pipeline stage (megatron-core order: stage = rank // (world / PP))."""
    per = world // pp
    return [max(values[r] for r in range(s * per, (s + 1) * per)) for s in range(pp)]


def reward_model_spec(cfg, policy: ArchSpec) -> ArchSpec:
    """reward.reward_model's architecture: its config.json, or the policy's when the run has not written it yet."""
    path = Path(cfg.reward.reward_model.path or "") / CONFIG_FILE
    if not (cfg.reward.reward_model.path and path.is_file()):
        return policy
    hf = _read_json(path, "reward.reward_model.path")
    try:
        return spec_from_dict(hf.get("text_config", hf), str(path))
    except BridgeError as exc:
        raise PlanError(f"reward.reward_model.path: {exc}") from None


def reward_model_stage_bytes(m: ArchSpec, tp: int, pp: int, ep: int, pbytes: int) -> list[int]:
    """Parameter bytes per pipeline stage of reward.reward_model on one GPU (see the module doc)."""
    h = m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    mlp = 3 * h * m.moe_ffn_hidden_size * m.num_experts // ep if m.is_moe else 3 * h * m.ffn_hidden_size
    layer = (h * (q + 2 * kv) + q * h + mlp) // tp + 2 * h
    per_stage = [layer * (m.num_layers // pp) for _ in range(pp)]
    per_stage[0] += m.vocab_size * h // tp
    per_stage[-1] += h * 2  # final norm and the score head
    return [n * pbytes for n in per_stage]


def activation_bytes_per_token_layer(spec: ArchSpec, tp: int, sp: bool, recompute: str) -> int:
    """Stored activation bytes of one token in one layer (bf16) under the recompute setting (see the module doc)."""
    h = spec.hidden_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    resid = 8 * h / (tp if sp else 1)
    attn = 4 * q + 4 * kv
    if spec.is_moe:
        mlp = spec.moe_topk * (2 * h + 6 * spec.moe_ffn_hidden_size)
    else:
        mlp = 6 * spec.ffn_hidden_size
    if recompute == "selective":
        attn -= 2 * q
    return int(resid + (attn + mlp) / tp)


def in_flight_layers(pp: int, vpp: int, stage: int, micro_batches: int, layers_per_stage: int) -> float:
    """Layer activations of one micro-batch that pipeline stage `stage` holds at its peak during a training step.

    1F1B (vpp 1): min(PP - stage, micro-batches) micro-batches through all its layers. Interleaved 1F1B (vpp > 1, the
    warm-up count of megatron's get_pp_rank_microbatches plus the one in its forward): (PP - stage - 1) * 2 +
    (VPP - 1) * PP + 1 chunk forwards, at most micro-batches * VPP, each through layers_per_stage / VPP layers. At
    PP2 x VPP2 stage 0 holds 5/4 of a micro-batch's layers where 1F1B holds 2/2: interleaving costs activation memory
    for its smaller bubble."""
    if vpp <= 1:
        return min(pp - stage, micro_batches) * layers_per_stage
    chunks = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, micro_batches * vpp)
    return chunks * layers_per_stage / vpp


def plan_recipe(cfg, nodes: int, gpus_per_node: int, gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB,
                link_gbps: float = DEFAULT_LINK_GBPS) -> PlanReport:
    """The memory/time plan of a validated MegarlConfig on nodes x gpus_per_node GPUs of gpu_mem_gib each."""
    hf = _read_hf_config(cfg)
    p, r = cfg.parallelism, cfg.rollout
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp_engine, eep_engine = r.tensor_model_parallel_size, r.expert_model_parallel_size
    dtype = "float32" if cfg.model.dtype == "float32" else "bfloat16" if cfg.model.dtype in ("auto", "bfloat16") \
        else "float16"
    pbytes = 2 if dtype != "float32" else 4
    engine_dtype = "float32" if r.dtype == "float32" else "bfloat16" if r.dtype in ("auto", "bfloat16") else "float16"
    total_gpus = nodes * gpus_per_node
    separate = cfg.engine_placement == "separate"
    replicas = cfg.engine_replicas
    engine_gpus = replicas * etp_engine if separate else 0
    world = cfg.world_size if separate else total_gpus
    reasons: list[str] = []
    if separate and world + engine_gpus > total_gpus:
        reasons.append(f"GPUs: the trainer's {world} ranks (trainer.nnodes * n_gpus_per_node) plus "
                       f"{replicas} engine replica(s) x engine TP {etp_engine} = {engine_gpus} need "
                       f"{world + engine_gpus} GPUs; the cluster has {total_gpus}")
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    layout = Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                    num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    if not layout.fits(world):
        raise PlanError(f"{world} trainer GPUs do not split into TP{tp} x PP{pp} with EP{ep} dividing the "
                        "data-parallel size; change the node count or the layout")
    dp, edp = layout.data_parallel_size(world), layout.expert_data_parallel_size(world)
    try:
        plan = build_plan(hf, tp, pp, ep, world, etp_engine, eep_engine, replicas, dtype, separate=separate,
                          first_stage=first, last_stage=last)
    except ValueError as exc:
        raise PlanError(f"the weight-sync plan refuses this layout: {exc}") from None
    spec = plan.mapping.spec
    dense, expert = plan.held_bytes()
    stage_dense = _per_stage_max(dense, world, pp)
    stage_expert = _per_stage_max(expert, world, pp)
    stage_all = _per_stage_max({k: dense[k] + expert[k] for k in dense}, world, pp)
    sent, received, loaded = plan.traffic()
    ebytes_ratio = DTYPE_BYTES[engine_dtype] / DTYPE_BYTES[dtype]

    # micro-batches and tokens
    seq_len = r.prompt_length + r.response_length
    mini_seqs = cfg.actor.ppo_mini_batch_size * r.n
    per_rank_seqs = max(1, mini_seqs // dp)

    def tokens_and_micro(micro: int, dynamic: bool, max_tokens: int) -> tuple[int, int]:
        if dynamic:
            tokens = max(max_tokens, seq_len)
            return tokens, max(1, math.ceil(per_rank_seqs * seq_len / tokens))
        return micro * seq_len, max(1, per_rank_seqs // micro)

    top_k = spec.moe_topk
    recompute = cfg.model.recompute
    act_tok_layer = activation_bytes_per_token_layer(spec, tp, p.sequence_parallel, recompute)
    full_layer = activation_bytes_per_token_layer(spec, tp, p.sequence_parallel, "none")
    stage_layers = layout.stage_layers(spec.num_layers)  # uneven stages: each stage's own layer count

    vpp = p.virtual_pipeline_model_parallel_size or 1

    def activations(tokens: int, micro_batches: int, logits: bool) -> list[int]:
        out = []
        for s in range(pp):
            layers_in_flight = in_flight_layers(pp, vpp, s, micro_batches, stage_layers[s])
            if recompute == "full":
                kept = 2 * spec.hidden_size // (tp if p.sequence_parallel else 1)
                per_layer = tokens * kept
                extra = tokens * full_layer
            else:
                per_layer = tokens * act_tok_layer
                extra = 0
            last = logits and s == pp - 1
            out.append(int(layers_in_flight * per_layer) + extra + (tokens * spec.vocab_size // tp * 8 if last else 0))
        return out

    opt_bpp = 12 if pbytes == 2 else 8

    def trainable(name: str, params_per_stage_dense: list[int], params_per_stage_expert: list[int], micro: int,
                  dynamic: bool, max_tokens: int, logits: bool) -> ModelMemory:
        n_dense = [b // pbytes for b in params_per_stage_dense]
        n_exp = [b // pbytes for b in params_per_stage_expert]
        opt_rep = [(a + b) * opt_bpp for a, b in zip(n_dense, n_exp)]
        opt_dist = [a * opt_bpp // dp + b * opt_bpp // edp for a, b in zip(n_dense, n_exp)]
        tokens, mbs = tokens_and_micro(micro, dynamic, max_tokens)
        return ModelMemory(name, [a + b for a, b in zip(params_per_stage_dense, params_per_stage_expert)],
                           grads=[(a + b) * 4 for a, b in zip(n_dense, n_exp)],
                           optim=opt_dist if p.use_distributed_optimizer else opt_rep,
                           optim_distributed=opt_dist, optim_replicated=opt_rep,
                           activations=activations(tokens, mbs, logits))

    a = cfg.actor
    actor = trainable("actor", stage_dense, stage_expert, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                      a.ppo_max_token_len_per_gpu, True)
    lora_line, adapter_sync_bytes = None, None
    if a.lora.enabled:  # frozen base (parameters only) + adapters with their gradients and optimizer states
        from megarl.lora.targets import LoraSettings, adapter_numel, resolve_targets, stage_adapter_numel

        tm = a.lora.target_modules
        targets = resolve_targets(plan.mapping, LoraSettings(rank=a.lora.rank, alpha=a.lora.alpha,
                                                             target_modules=tm if isinstance(tm, str) else tuple(tm)))
        n_lora = stage_adapter_numel(targets, a.lora.rank, tp, pp, ep, p.expert_tensor_parallel_size, spec.num_layers)
        actor = ModelMemory("actor", [b + n * pbytes for b, n in zip(stage_all, n_lora)],
                            grads=[n * 4 for n in n_lora],
                            optim=[n * opt_bpp // (dp if p.use_distributed_optimizer else 1) for n in n_lora],
                            optim_distributed=[n * opt_bpp // dp for n in n_lora],
                            optim_replicated=[n * opt_bpp for n in n_lora], activations=actor.activations)
        total = adapter_numel(targets, a.lora.rank)
        adapter_sync_bytes = total * DTYPE_BYTES[engine_dtype] if a.lora.sync == "adapter" else None
        synced = ("the engine receives merged weights, the shards below" if adapter_sync_bytes is None else
                  f"the engine keeps its base and each replica receives the whole adapters, "
                  f"{adapter_sync_bytes / 2**20:.2f} MiB in {engine_dtype} (vLLM slices them per worker)")
        lora_line = (f"LoRA rank {a.lora.rank} on {sorted({t.projection for t in targets.targets})}: "
                     f"{total / 1e6:.1f} M adapter parameters ({total * pbytes / GIB:.2f} GiB), at most "
                     f"{max(n_lora) / 1e6:.1f} M per GPU; the base ({n_params_total(plan) / 1e9:.2f} B) is frozen: "
                     "no gradients, no optimizer states; the reference policy is the actor with adapters disabled "
                     f"(no memory); sync {a.lora.sync}: {synced}")
    models = [actor]
    if cfg.critic_enabled:  # the LM head becomes a 1-wide value head on the last stage
        untied = "lm_head.weight" in plan.mapping.by_hf
        head = (spec.vocab_size * spec.hidden_size // tp * pbytes if untied else 0) - spec.hidden_size * pbytes
        critic_dense = [b - (head if s == pp - 1 else 0) for s, b in enumerate(stage_dense)]
        models.append(trainable("critic", critic_dense, stage_expert, cfg.critic.ppo_micro_batch_size_per_gpu,
                                a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, False))
    ref = ModelMemory("ref", list(stage_all)) if cfg.ref_enabled and not a.lora.enabled else None
    if ref is not None:
        models.append(ref)

    if cfg.reward.reward_model.enable:
        models.append(ModelMemory("reward model", reward_model_stage_bytes(reward_model_spec(cfg, spec), tp, pp, ep, pbytes)))

    # forward-only logits (old/ref logprobs) on the last stage
    fwd_micro = max(r.log_prob_micro_batch_size_per_gpu,
                    cfg.ref.log_prob_micro_batch_size_per_gpu if cfg.ref_enabled else 0)
    fwd_tokens = fwd_micro * seq_len
    if r.log_prob_use_dynamic_bsz:
        fwd_tokens = max(r.log_prob_max_token_len_per_gpu, seq_len)
    fwd_logits = fwd_tokens * spec.vocab_size // tp * 8

    # engine
    gpu_bytes = int(gpu_mem_gib * GIB)
    engine_reserve = int(r.gpu_memory_utilization * gpu_bytes)
    engine_weights = int(max(loaded.values()) * ebytes_ratio)  # the largest engine worker's shard
    ebytes = 2 if engine_dtype != "float32" else 4
    eng_ffn = (top_k * spec.moe_ffn_hidden_size) if spec.is_moe else spec.ffn_hidden_size
    engine_act = r.max_num_batched_tokens * ebytes * (4 * spec.hidden_size + 2 * eng_ffn // etp_engine) + \
        r.max_num_seqs * spec.vocab_size // etp_engine * 4
    kv_heads_per_rank = max(1, spec.num_key_value_heads // etp_engine)
    kv_per_token = 2 * spec.num_layers * kv_heads_per_rank * spec.head_dim * ebytes
    if spec.mla is not None:  # vLLM's MLA backends cache the compressed latent, whole on every TP rank (no K/V heads)
        kv_per_token = spec.num_layers * spec.mla.kv_cache_elements_per_token() * ebytes
    kv_budget = engine_reserve - engine_weights - engine_act
    kv_tokens = max(0, kv_budget) // kv_per_token
    max_len = r.resolved_max_model_len
    if kv_tokens < max_len:
        reasons.append(f"engine KV cache: gpu_memory_utilization {r.gpu_memory_utilization} x {gpu_mem_gib:g} GiB = "
                       f"{engine_reserve / GIB:.1f} GiB minus weights {engine_weights / GIB:.1f} GiB and activations "
                       f"{engine_act / GIB:.1f} GiB leaves {max(0, kv_budget) / GIB:.1f} GiB = {kv_tokens} tokens, "
                       f"less than one max_model_len={max_len} sequence; raise rollout.gpu_memory_utilization or "
                       "rollout.tensor_model_parallel_size")
    sync_buffers = 2 * (r.update_weights_bucket_megabytes << 20)
    if adapter_sync_bytes is not None and r.load_format != "dummy":
        sync_buffers = 0  # the adapters travel in a host shared-memory file; no bucket is ever filled on the GPU
    reserve = int(RESERVE_GIB * GIB)

    # offload around rollout: the selected states per stage
    def offloaded_bytes(s: int) -> int:
        total = 0
        for m in models:
            sel = {"actor": cfg.actor.offload, "critic": cfg.critic.offload}.get(m.name)
            if m.name == "ref":
                total += m.params[s] if cfg.ref.offload else 0
            elif sel is not None:
                total += ((m.params[s] if sel.params else 0) + (m.grads[s] if sel.grads else 0)
                          + (m.optim[s] if sel.optimizer else 0))
        return total

    # phases on the most loaded GPU of each stage, as the trainer runs them: rollout -> the engine sleeps (KV cache
    # and weights freed) -> logprob forwards -> training -> it wakes its weights -> sync -> it wakes its KV cache
    sleeps = r.enable_sleep_mode and r.free_cache_engine and not separate
    colocated = not separate
    generating = replicas * etp_engine if colocated else engine_gpus
    best = None
    for s in range(pp):
        states = sum(m.state(s) for m in models)
        train_act = max(m.activations[s] for m in models if m.activations)
        fwd = fwd_logits if s == pp - 1 else 0
        # colocated replicas cover the first replicas * engine TP ranks (by default all of them; stage 0 first)
        engine_here = colocated and (generating == world or s == 0)
        eng_busy = engine_reserve if engine_here else 0
        eng_idle = 0 if sleeps or not engine_here else engine_reserve
        phases = {
            "rollout": states - offloaded_bytes(s) + eng_busy + reserve,
            "logprob forward": states + fwd + eng_idle + reserve,
            "train": states + train_act + eng_idle + reserve,
            # a sleeping engine wakes its weights (not its KV cache) to receive the sync
            "weight sync": states + (eng_idle or (engine_weights if engine_here else 0)) + sync_buffers + reserve,
        }
        phase = max(phases, key=phases.get)
        if best is None or phases[phase] > best[2]:
            best = (s, phase, phases[phase], phases, train_act, fwd, engine_here)
    s, phase, peak, phases, train_act, fwd, engine_here = best

    terms: dict[str, float] = {}
    offloaded = offloaded_bytes(s)
    for m in models:
        terms[f"{m.name} parameters"] = m.params[s] / GIB
        if m.grads:
            terms[f"{m.name} gradients (fp32)"] = m.grads[s] / GIB
            terms[f"{m.name} optimizer" + (" (distributed)" if p.use_distributed_optimizer else "")] = m.optim[s] / GIB
    if phase == "train":
        terms["activations (train)"] = train_act / GIB
    if phase == "logprob forward":
        terms["logits (logprob forward)"] = fwd / GIB
    engine_in_phase = engine_here and (phase == "rollout" or not sleeps)
    if engine_in_phase:
        terms["engine (gpu_memory_utilization)"] = engine_reserve / GIB
    elif phase == "weight sync" and engine_here:
        terms["engine weights"] = engine_weights / GIB
    if phase == "weight sync":
        terms["sync buffers"] = sync_buffers / GIB
    if phase == "rollout" and offloaded:
        terms["offloaded to host (rollout)"] = -offloaded / GIB
    terms["reserve (CUDA context, NCCL, fragmentation)"] = reserve / GIB

    fits_mem = peak <= gpu_bytes
    if not fits_mem:
        top = sorted(((v, k) for k, v in terms.items()), reverse=True)[:3]
        hint = []
        if not p.use_distributed_optimizer and actor.optim_replicated[s] > actor.optim_distributed[s]:
            saved = sum(m.optim_replicated[s] - m.optim_distributed[s] for m in models if m.optim)
            hint.append(f"parallelism.use_distributed_optimizer=true saves {saved / GIB:.1f} GiB")
        if phase == "train" and recompute != "full":
            hint.append("model.recompute=full or a smaller micro-batch shrinks the activations")
        if engine_in_phase and not sleeps and colocated:
            hint.append("rollout.enable_sleep_mode=true frees the engine's share outside rollouts")
        hint.append("more nodes, or larger TP/PP/EP, shrink the per-GPU states")
        reasons.insert(0, f"memory: the {phase} phase needs {peak / GIB:.1f} GiB on a GPU of pipeline stage {s} "
                       f"but a GPU has {gpu_mem_gib:g} GiB (over by {(peak - gpu_bytes) / GIB:.1f} GiB); largest "
                       "terms: " + ", ".join(f"{k} {v:.1f} GiB" for v, k in top) + ". Fix: " + "; ".join(hint))
    if separate and engine_reserve + reserve > gpu_bytes:
        reasons.append(f"engine GPU: gpu_memory_utilization {r.gpu_memory_utilization} plus the reserve exceeds "
                       f"{gpu_mem_gib:g} GiB")

    recv = int(max(received.values(), default=0) * ebytes_ratio)  # from other ranks, per GPU and sync
    if adapter_sync_bytes is not None:  # adapter sync: each engine owner gathers the whole adapters, nothing else
        recv = adapter_sync_bytes
    bw = link_gbps * 1e9
    sync_lb = recv / bw
    n_params = plan.total_bytes // plan.element_bytes
    n_expert = sum(math.prod(shp) for h, shp in plan.mapping.hf_shapes().items() if ".experts." in h)
    actor_tokens, actor_mbs = tokens_and_micro(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                                               a.ppo_max_token_len_per_gpu)
    hosts = "Ray actors" if r.mode == "ray" else "engine processes"
    where = (f"separate ({hosts}), {replicas} replica(s) on {engine_gpus} GPUs of their own" if separate
             else f"colocated, {replicas} replica(s) x TP{etp_engine}: {generating} of {world} GPUs generate")
    lines = [
        f"megarl plan: {nodes} node(s) x {gpus_per_node} GPU(s) of {gpu_mem_gib:g} GiB = {total_gpus} GPUs",
        f"model: {spec.architecture}, {n_params / 1e9:.2f} B parameters"
        + (f" ({n_expert / 1e9:.2f} B in {spec.num_experts} experts, top-{top_k})" if spec.is_moe else " (dense)")
        + f", {spec.num_layers} layers, hidden {spec.hidden_size}; trainer dtype {dtype}, engine dtype {engine_dtype}",
        f"trainer: {world} GPUs, TP{tp} PP{pp}" + (f" x VPP{vpp} (interleaved 1F1B)" if vpp > 1 else "")
        + f" EP{ep} DP{dp}" + (f" (expert DP {edp})" if spec.is_moe else "")
        + f", sequence parallel {p.sequence_parallel}, recompute {recompute}, distributed optimizer "
        f"{p.use_distributed_optimizer}",
        f"  actor micro-batch: {actor_tokens} tokens, {actor_mbs} micro-batch(es) per mini-batch per rank; models: "
        + ", ".join(m.name for m in models),
        f"engine: {where}, TP{etp_engine} EP{eep_engine}, gpu_memory_utilization {r.gpu_memory_utilization}, "
        "sleeps between rollouts "
        f"{sleeps}",
        f"  weights {engine_weights / GIB:.2f} GiB/GPU, activations ~{engine_act / GIB:.2f} GiB, KV cache "
        f"{max(0, kv_budget) / GIB:.2f} GiB = {kv_tokens:,} tokens = {kv_tokens / max_len:.1f} sequences of "
        f"{max_len} (max_num_seqs {r.max_num_seqs})",
        "",
        "per-model states per GPU (GiB), by pipeline stage:",
    ]
    if lora_line:
        lines.insert(-2, lora_line)
    for m in models:
        row = [f"  {m.name:7s} params " + " ".join(f"{b / GIB:7.2f}" for b in m.params)]
        if m.grads:
            row.append(f"          grads  " + " ".join(f"{b / GIB:7.2f}" for b in m.grads))
            row.append(f"          optim  " + " ".join(f"{b / GIB:7.2f}" for b in m.optim_distributed)
                       + "  (distributed optimizer)")
            row.append(f"          optim  " + " ".join(f"{b / GIB:7.2f}" for b in m.optim_replicated)
                       + "  (without it)")
            row.append(f"          activ. " + " ".join(f"{b / GIB:7.2f}" for b in m.activations)
                       + f"  (recompute {recompute})")
        lines += row
    lines += ["", f"most loaded GPU: pipeline stage {s}" + (" (hosts the engine)" if engine_here else "")
              + f", peak in the {phase} phase:"]
    for k, v in terms.items():
        lines.append(f"  {k:46s} {v:8.2f} GiB")
    lines.append(f"  {'total':46s} {peak / GIB:8.2f} GiB of {gpu_mem_gib:g}")
    lines.append("  phases: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in phases.items()) + " GiB")
    if adapter_sync_bytes is None:
        lines += ["", f"weight sync ({engine_dtype}), per sync: each engine worker loads its shard, at most "
                  f"{engine_weights / GIB:.2f} GiB; a GPU receives at most {recv / GIB:.2f} GiB from other GPUs "
                  f"(>= {sync_lb:.2f} s at {link_gbps:g} GB/s) and sends at most "
                  f"{max(sent.values(), default=0) * ebytes_ratio / GIB:.2f} GiB; no GPU gathers the model",
                  f"sync buffers: 2 x {r.update_weights_bucket_megabytes} MiB buckets"]
    else:
        lines += ["", f"weight sync ({engine_dtype}), per sync (actor.lora.sync=adapter): {adapter_sync_bytes:,} "
                  f"bytes of adapters ({adapter_sync_bytes / 2**20:.2f} MiB) per engine replica, gathered on its "
                  f"owner GPU (>= {sync_lb * 1e3:.2f} ms at {link_gbps:g} GB/s) and loaded by every worker of it "
                  "through vLLM's LoRA support; no base weight moves",
                  "sync buffers: one shared-memory file of the adapters"]
    if separate:
        lines[-2] += (" (engines placed separately: each engine GPU receives its whole shard from the trainer GPUs "
                      "over the transfer group; the engines do not sleep, and the trainer GPUs hold no engine)")
    if any(offloaded_bytes(st) for st in range(pp)):
        least = min(offloaded_bytes(st) for st in range(pp))
        grown = min(0.95, r.gpu_memory_utilization + least / gpu_bytes)
        lines += ["", f"offload around rollout: {offloaded / GIB:.2f} GiB of trainer states per GPU (at least "
                  f"{least / GIB:.2f} on every stage) in pinned host memory while the engine generates; "
                  f"round trip >= {2 * offloaded / (HOST_LINK_GBPS * 1e9):.2f} s at {HOST_LINK_GBPS:g} GB/s",
                  f"  the engine's KV cache can grow by {least / GIB:.2f} GiB = {least // kv_per_token:,} tokens: "
                  f"rollout.gpu_memory_utilization up to {grown:.2f}" + ("" if colocated else
                                                                       " (engines placed separately: no gain)")]
    fits = not reasons
    verdict = "FITS" if fits else "DOES NOT FIT"
    lines += ["", f"verdict: {verdict} (peak {peak / GIB:.1f} of {gpu_mem_gib:g} GiB per GPU)"]
    lines += [f"  - {x}" for x in reasons]
    return PlanReport("\n".join(lines), fits, peak, peak, reasons, terms,
                      engine_weights if adapter_sync_bytes is None else adapter_sync_bytes, sync_lb, offloaded)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="megarl plan", description="Per-GPU memory, weight-sync bytes and time for a "
                                 "recipe on a cluster, and a verdict (exit 1 when it does not fit).")
    add_arguments(ap)
    return run(ap.parse_intermixed_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as parallelism.tensor_model_"
                    "parallel_size=8")
    ap.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    ap.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    ap.add_argument("--gpu-mem", type=float, default=DEFAULT_GPU_MEM_GIB, help="GiB per GPU (default 80)")
    ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS, help="link bandwidth for the weight-sync "
                    "bound, GB/s (default 50: one 400 Gb/s NIC)")


def run(args: argparse.Namespace) -> int:
    from megarl.config import ConfigError, load_config

    overrides = list(args.overrides)
    try:
        probe = load_config(args.recipe, overrides)
        if probe.engine_placement == "colocated":  # the trainer takes the whole cluster; else engines add GPUs
            overrides += [f"trainer.nnodes={args.nodes}", f"trainer.n_gpus_per_node={args.gpus_per_node}"]
        cfg = load_config(args.recipe, overrides)
        report = plan_recipe(cfg, args.nodes, args.gpus_per_node, args.gpu_mem, args.link_gbps)
    except (ConfigError, PlanError) as exc:
        print(f"megarl plan: {exc}", file=sys.stderr)
        return 1
    print(f"# {args.recipe}")
    print(report.text)
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
