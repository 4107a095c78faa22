"""`megarl validate` rules of the Megatron trainer: its layout over the ranks and the model, batches over data
parallelism, virtual pipeline stages, routing replay, the learning-rate warm-up and what the run's device allows."""
from __future__ import annotations

from typing import Optional

import torch

from megarl.bridge.checks import model_spec
from megarl.bridge.tiny import TINY_SOURCE
from megarl.config.issues import Issue
from megarl.config.resolve import resolved_device
from megarl.config.schema import MegarlConfig
from megarl.distributed import cpu_bf16
from megarl.layout import Layout

P = "parallelism."


def check_layout(cfg: MegarlConfig) -> list[Issue]:
    p, world = cfg.parallelism, cfg.world_size
    layout = Layout.of(p)
    issues = []
    mp = layout.model_parallel_size
    if world % mp:
        issues.append(Issue(
            "trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node,
            f"world size nnodes*n_gpus_per_node = {world} must be a multiple of TP*PP*CP = "
            f"{p.tensor_model_parallel_size}*{p.pipeline_model_parallel_size}*{p.context_parallel_size} = {mp} "
            "(DP = world / (TP*PP*CP))", f"use a multiple of {mp} ranks or shrink the layout",
            keys=("trainer.nnodes", "trainer.n_gpus_per_node", P + "tensor_model_parallel_size",
                  P + "pipeline_model_parallel_size", P + "context_parallel_size")))
    etp, emp = layout.expert_tensor, layout.expert_model_parallel_span
    if p.expert_model_parallel_size > 1 and world % emp:
        issues.append(Issue(
            P + "expert_model_parallel_size", p.expert_model_parallel_size,
            f"world size {world} must be a multiple of expert TP * EP * PP = {etp}*{p.expert_model_parallel_size}*"
            f"{p.pipeline_model_parallel_size} = {emp}", "change EP or the number of ranks",
            keys=(P + "expert_model_parallel_size", "trainer.n_gpus_per_node")))
    if p.virtual_pipeline_model_parallel_size and p.pipeline_model_parallel_size == 1:
        issues.append(Issue(P + "virtual_pipeline_model_parallel_size", p.virtual_pipeline_model_parallel_size,
                            "virtual pipeline stages need pipeline_model_parallel_size > 1",
                            "unset it or raise PP", keys=(P + "virtual_pipeline_model_parallel_size",)))
    return issues


def check_model_layout(cfg: MegarlConfig) -> list[Issue]:
    found = model_spec(cfg)
    if found is None:
        return []
    spec, source = found
    p, src = cfg.parallelism, f"({source})"
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    issues = []
    if spec.num_attention_heads % tp:
        issues.append(Issue(P + "tensor_model_parallel_size", tp, f"must divide num_attention_heads = "
                            f"{spec.num_attention_heads} {src}", "pick a TP that divides the heads",
                            keys=(P + "tensor_model_parallel_size",)))
    if spec.num_key_value_heads % tp:
        issues.append(Issue(P + "tensor_model_parallel_size", tp, f"must divide num_key_value_heads = "
                            f"{spec.num_key_value_heads} {src} (Megatron splits KV groups over TP)",
                            "pick a TP that divides the KV heads", keys=(P + "tensor_model_parallel_size",)))
    stages = pp * (p.virtual_pipeline_model_parallel_size or 1)
    uneven = p.num_layers_in_first_pipeline_stage is not None or p.num_layers_in_last_pipeline_stage is not None
    if uneven:
        try:
            Layout.of(p).stage_layers(spec.num_layers)
        except ValueError as exc:
            issues.append(Issue(P + "num_layers_in_first_pipeline_stage", p.num_layers_in_first_pipeline_stage,
                                f"{exc} {src}", "pick first/last stage sizes that leave an even split",
                                keys=(P + "num_layers_in_first_pipeline_stage", P + "num_layers_in_last_pipeline_stage",
                                      P + "pipeline_model_parallel_size")))
    elif spec.num_layers % stages:
        issues.append(Issue(P + "pipeline_model_parallel_size", pp, f"PP * virtual PP = {stages} must divide "
                            f"num_hidden_layers = {spec.num_layers} {src}", "pick a PP that divides the layers",
                            keys=(P + "pipeline_model_parallel_size", P + "virtual_pipeline_model_parallel_size")))
    if ep > 1 and spec.num_experts == 0:
        issues.append(Issue(P + "expert_model_parallel_size", ep, f"the model is dense {src}; expert parallelism "
                            "needs an MoE model", "set it to 1", keys=(P + "expert_model_parallel_size",)))
    elif spec.num_experts and spec.num_experts % ep:
        issues.append(Issue(P + "expert_model_parallel_size", ep, f"must divide the number of experts = "
                            f"{spec.num_experts} {src}", "pick an EP that divides the experts",
                            keys=(P + "expert_model_parallel_size",)))
    if spec.num_experts and tp > 1 and not p.sequence_parallel:
        issues.append(Issue(P + "sequence_parallel", False, "Megatron requires sequence parallelism for MoE models "
                            "with tensor_model_parallel_size > 1", "set parallelism.sequence_parallel=true",
                            keys=(P + "sequence_parallel",)))
    max_len = cfg.rollout.resolved_max_model_len
    # a tiny model not made yet: the lengths are held against its positions once prepare has written its config.json
    if source != TINY_SOURCE and max_len > spec.max_position_embeddings:
        issues.append(Issue("rollout.max_model_len", max_len, f"exceeds the model's max_position_embeddings = "
                            f"{spec.max_position_embeddings} {src}", "shorten prompt_length/response_length",
                            keys=("rollout.max_model_len", "rollout.prompt_length", "rollout.response_length")))
    return issues


def _dp(cfg: MegarlConfig) -> Optional[int]:
    mp = Layout.of(cfg.parallelism).model_parallel_size
    return cfg.world_size // mp if cfg.world_size % mp == 0 else None


def check_batches(cfg: MegarlConfig) -> list[Issue]:
    d, a, n = cfg.data, cfg.actor, cfg.rollout.n
    issues = []
    if d.train_batch_size % a.ppo_mini_batch_size:
        issues.append(Issue("actor.ppo_mini_batch_size", a.ppo_mini_batch_size, f"must divide data.train_batch_size "
                            f"= {d.train_batch_size} (prompts per step split into mini-batches)",
                            "make train_batch_size a multiple of it", keys=("actor.ppo_mini_batch_size",
                                                                           "data.train_batch_size")))
    dp = _dp(cfg)
    if dp is None:
        return issues
    mini_seqs = a.ppo_mini_batch_size * n
    if mini_seqs % dp:
        issues.append(Issue("actor.ppo_mini_batch_size", a.ppo_mini_batch_size, f"ppo_mini_batch_size * rollout.n = "
                            f"{mini_seqs} sequences must split evenly over data-parallel size {dp}",
                            f"use a mini-batch whose sequence count is a multiple of {dp}",
                            keys=("actor.ppo_mini_batch_size", "rollout.n", "trainer.n_gpus_per_node")))
    elif not a.use_dynamic_bsz and (mini_seqs // dp) % a.ppo_micro_batch_size_per_gpu:
        issues.append(Issue("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu,
                            f"must divide the per-rank mini-batch of {mini_seqs // dp} sequences "
                            f"(ppo_mini_batch_size {a.ppo_mini_batch_size} * n {n} / DP {dp})",
                            "pick a divisor, or set actor.use_dynamic_bsz=true",
                            keys=("actor.ppo_micro_batch_size_per_gpu", "actor.ppo_mini_batch_size", "rollout.n")))
    if cfg.critic_enabled and mini_seqs % dp == 0 and (mini_seqs // dp) % cfg.critic.ppo_micro_batch_size_per_gpu:
        issues.append(Issue("critic.ppo_micro_batch_size_per_gpu", cfg.critic.ppo_micro_batch_size_per_gpu,
                            f"must divide the per-rank mini-batch of {mini_seqs // dp} sequences", "pick a divisor",
                            keys=("critic.ppo_micro_batch_size_per_gpu",)))
    return issues


def check_warmup(cfg: MegarlConfig) -> list[Issue]:
    """Megatron's LR scheduler warms up inside the decay steps, so warm-up must end before the last optimizer step
    (checked where the step count is a setting; make_trainable says the same for the RL roles at start-up)."""
    issues = []
    for section, enabled in (("sft", cfg.sft.enable), ("rm", True)):  # rm: read by `megarl rm` alone
        sec = getattr(cfg, section)
        if enabled and sec.total_steps is not None and sec.optim.lr_warmup_steps >= sec.total_steps:
            issues.append(Issue(f"{section}.optim.lr_warmup_steps", sec.optim.lr_warmup_steps,
                                f"warm-up must end before the last of {section}.total_steps = {sec.total_steps} "
                                "optimizer steps", f"lower {section}.optim.lr_warmup_steps or raise "
                                f"{section}.total_steps", keys=(f"{section}.optim.lr_warmup_steps",
                                                                f"{section}.total_steps")))
    return issues


def check_device(cfg: MegarlConfig, cpu_flags=None) -> list[Issue]:
    """trainer.device=cuda where no CUDA is visible (a warning: validate may run on a laptop for a cluster), the
    settings that need CUDA when the run is on CPU, and the training dtype the CPU allows (cpu_dtype_issues; cpu_flags:
    another CPU's feature flags, None: this machine's)."""
    issues = []
    device = resolved_device(cfg.trainer.device)
    if device == "cuda" and not torch.cuda.is_available():
        issues.append(Issue("trainer.device", "cuda", "no CUDA device is visible on this machine; `megarl train` "
                            "stops here", "ignore this when validating for a GPU machine; otherwise use auto or cpu",
                            keys=("trainer.device",), warning=True))
    if device == "cpu" and cfg.model.use_transformer_engine is True:
        issues.append(Issue("model.use_transformer_engine", True, "Transformer Engine needs CUDA and the run is on "
                            "CPU", "use auto (TE when CUDA and transformer_engine are available) or false",
                            keys=("model.use_transformer_engine", "trainer.device")))
    if device == "cpu" and cfg.parallelism.use_distributed_optimizer:
        issues.append(Issue(P + "use_distributed_optimizer", True, "megatron's distributed optimizer needs CUDA and "
                            "the run is on CPU", "set it to false on CPU",
                            keys=(P + "use_distributed_optimizer", "trainer.device")))
    if device == "cpu":
        issues += cpu_dtype_issues(cfg, cpu_flags)
    return issues


# what bf16 does to the engine-trainer logprob gap, measured with bench/bench_cpu_bf16.py (docs/engines.md)
BF16_GAP = ("the engine's logprobs differ from the trainer's by about 0.05 nats per sampled token on average and up "
            "to about 0.2 (SmolLM2-135M in bf16 on both sides: mean 0.050, max 0.18 over 64 tokens; float32: 1e-5); "
            "the trainer's own old-logprob pass does not see it, rollout correction and use_rollout_log_probs do")


def cpu_dtype_issues(cfg: MegarlConfig, cpu_flags=None) -> list[Issue]:
    """model.dtype on CPU: float32 (auto) always; bfloat16 where the CPU computes bf16 natively (bf16 parameters, fp32
    main params in megatron's optimizer; a warning names the logprob gap to expect), refused where torch would emulate
    it; float16 never (no CPU kernels for it, and megatron's fp16 needs a loss scaler). cpu_flags: another CPU's
    feature flags (megarl.distributed.cpu_bf16); None: this machine's."""
    dtype, keys = cfg.model.dtype, ("model.dtype", "trainer.device")
    if dtype == "float16":
        return [Issue("model.dtype", dtype, "float16 training has no CPU path (CPUs have no float16 matrix kernels "
                      "worth the name, and megatron's fp16 needs a dynamic loss scaler)", "use auto (float32) on CPU, "
                      "or bfloat16 on a CPU with native bf16 (avx512_bf16 or amx_bf16)", keys=keys)]
    if dtype != "bfloat16":
        return []
    bf16 = cpu_bf16(cpu_flags)
    if not bf16.native:
        return [Issue("model.dtype", dtype, f"this CPU has {bf16.describe()}: torch emulates bf16 by converting to "
                      "float32 around every kernel, slower than float32 itself (on an AVX-512 CPU without "
                      "avx512_bf16: a 1024^3 matrix product 4x, a forward of SmolLM2-135M 3x slower)",
                      "use auto or float32 here; bfloat16 on a CPU with avx512_bf16 or amx_bf16 (Xeon Cooper Lake, "
                      "Sapphire Rapids and later; AMD Zen 4 and later) or aarch64's bf16 (Graviton3 and later)",
                      keys=keys)]
    return [Issue("model.dtype", dtype, f"bf16 on a CPU with {bf16.describe()}: parameters in bf16, fp32 main "
                  f"params in the optimizer; {BF16_GAP}", "use float32 where the engine's logprobs must equal the "
                  "trainer's (bench/bench_cpu_bf16.py measures the gap and the speed-up for a model)", keys=keys,
                  warning=True)]


def check_virtual_pipeline(cfg: MegarlConfig) -> list[Issue]:
    """Virtual pipeline stages: megatron's interleaved 1F1B schedule runs each step's micro-batches in groups of PP
    (config.microbatch_group_size_per_vp_stage, megatron's default) and refuses a micro-batch count that is not a
    multiple of PP. Forward-only passes pad their count themselves; the updates' counts come from the recipe."""
    p = cfg.parallelism
    vpp, pp = p.virtual_pipeline_model_parallel_size or 1, p.pipeline_model_parallel_size
    if vpp == 1 or pp == 1:
        return []
    key, dp, n = P + "virtual_pipeline_model_parallel_size", _dp(cfg), cfg.rollout.n
    rule = (f"the interleaved 1F1B schedule (virtual pipeline stages) runs micro-batches in groups of "
            f"pipeline_model_parallel_size = {pp} and megatron refuses a count per optimizer step that is not a "
            "multiple of it")
    issues = []
    if cfg.actor.use_dynamic_bsz:
        issues.append(Issue("actor.use_dynamic_bsz", True, rule + "; token-budget micro-batches give a count that "
                            "changes from step to step", "set actor.use_dynamic_bsz=false with a fixed "
                            "actor.ppo_micro_batch_size_per_gpu, or unset " + key,
                            keys=("actor.use_dynamic_bsz", key)))
    mini_seqs = cfg.actor.ppo_mini_batch_size * n
    if dp is not None and mini_seqs % dp == 0:
        per_rank = mini_seqs // dp
        models = [("actor", cfg.actor.ppo_micro_batch_size_per_gpu)] if not cfg.actor.use_dynamic_bsz else []
        if cfg.critic_enabled:
            models.append(("critic", cfg.critic.ppo_micro_batch_size_per_gpu))
        for model, micro in models:
            if per_rank % micro == 0 and (per_rank // micro) % pp:
                issues.append(Issue(
                    f"{model}.ppo_micro_batch_size_per_gpu", micro, f"{rule}: actor.ppo_mini_batch_size "
                    f"{cfg.actor.ppo_mini_batch_size} * rollout.n {n} / DP {dp} / {micro} = {per_rank // micro} "
                    "micro-batches per rank", f"make the per-rank micro-batch count a multiple of {pp} (e.g. a "
                    f"smaller {model}.ppo_micro_batch_size_per_gpu or a larger actor.ppo_mini_batch_size), or unset "
                    + key, keys=(f"{model}.ppo_micro_batch_size_per_gpu", "actor.ppo_mini_batch_size", "rollout.n",
                                 key)))
    sft = cfg.sft
    if (sft.enable or sft.train_files) and dp is not None and sft.batch_size % dp == 0:  # warm-start or `megarl sft`
        rows = sft.batch_size // dp
        micro = min(cfg.actor.ppo_micro_batch_size_per_gpu, rows)
        count = -(-rows // micro)
        if count % pp:
            issues.append(Issue("sft.batch_size", sft.batch_size, f"{rule}: the SFT warm-start runs sft.batch_size "
                                f"{sft.batch_size} / DP {dp} in micro-batches of actor.ppo_micro_batch_size_per_gpu "
                                f"{micro} = {count} per rank", f"make that count a multiple of {pp}, or unset " + key,
                                keys=("sft.batch_size", "actor.ppo_micro_batch_size_per_gpu", key)))
    if cfg.actor.router_replay.mode != "none":
        issues.append(Issue("actor.router_replay.mode", cfg.actor.router_replay.mode, "routing replay at virtual "
                            "pipeline stages is not supported by this version of megarl (the interleaved schedule runs "
                            "chunks of different micro-batches in turn; replay is not verified there)",
                            f"set it to none, or unset {key}", keys=("actor.router_replay.mode", key)))
    if cfg.reward.reward_model.enable:
        issues.append(Issue("reward.reward_model.enable", True, "a reward model at virtual pipeline stages is not "
                            "supported by this version of megarl (its scoring is not verified there)",
                            f"unset {key} or score with a rule function", keys=("reward.reward_model.enable", key)))
    if cfg.actor.lora.enabled:
        issues.append(Issue("actor.lora.rank", cfg.actor.lora.rank, "LoRA adapters at virtual pipeline stages are not "
                            "verified by this version of megarl (adapters per model chunk, their export and merge)",
                            f"unset {key}, or train without adapters", keys=("actor.lora.rank", key)))
    return issues


def check_parallel_options(cfg: MegarlConfig) -> list[Issue]:
    p = cfg.parallelism
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        return [Issue(P + "sequence_parallel", True, "sequence parallelism splits activations over the tensor-parallel "
                      "ranks and needs tensor_model_parallel_size > 1 (megatron refuses it otherwise)",
                      "set it to false, or raise tensor_model_parallel_size",
                      keys=(P + "sequence_parallel", P + "tensor_model_parallel_size"))]
    return []


def check_router_replay(cfg: MegarlConfig) -> list[Issue]:
    """actor.router_replay.mode and rollout.return_routed_experts: what routing replay and the engine's routes need
    (megarl.megatron.router_replay; megarl.rollout.vllm.routes.RouteRecorder)."""
    mode, key, rkey = cfg.actor.router_replay.mode, "actor.router_replay.mode", "rollout.return_routed_experts"
    issues = []
    spec, source = model_spec(cfg) or (None, None)
    if cfg.routes_from_engine:
        # who asks for the routes: R3 (implicitly) or the user
        who, keys = ((key, mode), (key, rkey)) if cfg.rollout.return_routed_experts is None else ((rkey, True), (rkey,))
        if spec is not None and spec.num_experts == 0:
            issues.append(Issue(*who, f"the engine's routed experts exist only for MoE models, and the model "
                                f"({source}) has no experts", f"set {who[0]} to " +
                                ("none" if who[0] == key else "false"), keys=keys))
        if cfg.rollout.multi_turn.enable:
            # each turn of a trajectory is a request of its own: the engine does not join their routes
            issues.append(Issue(*who, "the engine's routes are not assembled for multi-turn rollouts "
                                "(rollout.multi_turn.enable=true)", f"set {who[0]} to " +
                                ("R2 or none" if who[0] == key else "false") + ", or disable multi-turn",
                                keys=(*keys, "rollout.multi_turn.enable")))
        if cfg.async_training.partial_rollout == "abort_resume":
            issues.append(Issue(*who, "a resumed sample's routes would have to be joined with its partial's, which "
                                "this version does not do (async_training.partial_rollout=abort_resume)",
                                "set async_training.partial_rollout to finish, or " + (
                                    f"{key} to R2 or none" if who[0] == key else f"{rkey} to false"),
                                keys=(*keys, "async_training.partial_rollout")))
    if mode == "none":
        return issues
    if mode == "R3" and cfg.rollout.return_routed_experts is False:
        issues.append(Issue(key, mode, "R3 replays the engine's routed experts, and rollout.return_routed_experts="
                            "false turns them off", "unset rollout.return_routed_experts (R3 turns it on), or use R2",
                            keys=(key, rkey)))
    if spec is not None and spec.num_experts == 0 and not (mode == "R3" and cfg.routes_from_engine):
        issues.append(Issue(key, mode, f"routing replay acts on MoE routers and the model ({source}) has none",
                            "set it to none", keys=(key,)))
    if cfg.model.recompute != "none":
        issues.append(Issue(key, mode, f"a recomputed forward (model.recompute={cfg.model.recompute}) would replay the "
                            "routes of another micro-batch", "set model.recompute to none, or the mode to none",
                            keys=(key, "model.recompute")))
    return issues
