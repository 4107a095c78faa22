"""Cross-field rules of a recipe. Each check returns Issues naming the keys it reads; none raises."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig

P = "parallelism."


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a model's config.json that the layout rules need."""

    source: str
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    num_experts: int
    max_position_embeddings: Optional[int]

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str) -> "ModelShape":
        heads = int(cfg.get("num_attention_heads", 0))
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
        return cls(source, heads, int(cfg.get("num_key_value_heads") or heads), int(cfg.get("num_hidden_layers", 0)),
                   int(experts), cfg.get("max_position_embeddings"))


def model_shape(cfg: MegarlConfig) -> Optional[ModelShape]:
    """The model's shape from model.config_path, model.path/config.json, or model.create_tiny; None if unknown."""
    for candidate in (cfg.model.config_path, cfg.model.path and str(Path(cfg.model.path) / "config.json")):
        if candidate and Path(candidate).is_file():
            return ModelShape.from_hf_dict(json.loads(Path(candidate).read_text()), candidate)
    tiny = cfg.model.create_tiny
    if tiny is not None:
        return ModelShape("model.create_tiny", tiny.num_attention_heads, tiny.num_key_value_heads,
                          tiny.num_hidden_layers, tiny.num_experts, None)
    return None


def check_model_source(cfg: MegarlConfig) -> list[Issue]:
    m = cfg.model
    if not m.path:
        return [Issue("model.path", m.path, "no model given", "set model.path to a Hugging Face model directory",
                      keys=("model.path",))]
    if Path(m.path).is_dir() or m.create_tiny is not None:
        return []
    return [Issue("model.path", m.path, "directory not found on this machine; structural checks use "
                  + (f"model.config_path" if m.config_path else "nothing (they are skipped)"),
                  "ignore this when validating for another cluster; otherwise fix the path", keys=("model.path",),
                  warning=True)]


def check_layout(cfg: MegarlConfig) -> list[Issue]:
    p, world = cfg.parallelism, cfg.world_size
    issues = []
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if world % mp:
        issues.append(Issue(
            "trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node,
            f"world size nnodes*n_gpus_per_node = {world} must be a multiple of TP*PP*CP = "
            f"{p.tensor_model_parallel_size}*{p.pipeline_model_parallel_size}*{p.context_parallel_size} = {mp} "
            "(DP = world / (TP*PP*CP))", f"use a multiple of {mp} ranks or shrink the layout",
            keys=("trainer.nnodes", "trainer.n_gpus_per_node", P + "tensor_model_parallel_size",
                  P + "pipeline_model_parallel_size", P + "context_parallel_size")))
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    emp = etp * p.expert_model_parallel_size * p.pipeline_model_parallel_size
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
    shape = model_shape(cfg)
    if shape is None:
        return []
    p, src = cfg.parallelism, f"({shape.source})"
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    issues = []
    if shape.num_attention_heads % tp:
        issues.append(Issue(P + "tensor_model_parallel_size", tp, f"must divide num_attention_heads = "
                            f"{shape.num_attention_heads} {src}", "pick a TP that divides the heads",
                            keys=(P + "tensor_model_parallel_size",)))
    if shape.num_key_value_heads % tp:
        issues.append(Issue(P + "tensor_model_parallel_size", tp, f"must divide num_key_value_heads = "
                            f"{shape.num_key_value_heads} {src} (Megatron splits KV groups over TP)",
                            "pick a TP that divides the KV heads", keys=(P + "tensor_model_parallel_size",)))
    stages = pp * (p.virtual_pipeline_model_parallel_size or 1)
    if shape.num_hidden_layers % stages:
        issues.append(Issue(P + "pipeline_model_parallel_size", pp, f"PP * virtual PP = {stages} must divide "
                            f"num_hidden_layers = {shape.num_hidden_layers} {src}", "pick a PP that divides the layers",
                            keys=(P + "pipeline_model_parallel_size", P + "virtual_pipeline_model_parallel_size")))
    if ep > 1 and shape.num_experts == 0:
        issues.append(Issue(P + "expert_model_parallel_size", ep, f"the model is dense {src}; expert parallelism "
                            "needs an MoE model", "set it to 1", keys=(P + "expert_model_parallel_size",)))
    elif shape.num_experts and shape.num_experts % ep:
        issues.append(Issue(P + "expert_model_parallel_size", ep, f"must divide the number of experts = "
                            f"{shape.num_experts} {src}", "pick an EP that divides the experts",
                            keys=(P + "expert_model_parallel_size",)))
    if shape.num_experts and tp > 1 and not p.sequence_parallel:
        issues.append(Issue(P + "sequence_parallel", False, "Megatron requires sequence parallelism for MoE models "
                            "with tensor_model_parallel_size > 1", "set parallelism.sequence_parallel=true",
                            keys=(P + "sequence_parallel",)))
    max_len = cfg.rollout.resolved_max_model_len
    if shape.max_position_embeddings and max_len > shape.max_position_embeddings:
        issues.append(Issue("rollout.max_model_len", max_len, f"exceeds the model's max_position_embeddings = "
                            f"{shape.max_position_embeddings} {src}", "shorten prompt_length/response_length",
                            keys=("rollout.max_model_len", "rollout.prompt_length", "rollout.response_length")))
    return issues


def _dp(cfg: MegarlConfig) -> Optional[int]:
    p = cfg.parallelism
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
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


def check_lengths(cfg: MegarlConfig) -> list[Issue]:
    r = cfg.rollout
    if r.max_model_len is not None and r.prompt_length + r.response_length > r.max_model_len:
        return [Issue("rollout.max_model_len", r.max_model_len, f"prompt_length + response_length = "
                      f"{r.prompt_length} + {r.response_length} = {r.prompt_length + r.response_length} exceeds it",
                      "raise max_model_len or shorten the lengths",
                      keys=("rollout.max_model_len", "rollout.prompt_length", "rollout.response_length"))]
    issues = []
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len >= r.response_length:
        issues.append(Issue("reward.overlong_buffer.len", ob.len, f"must be below rollout.response_length = "
                            f"{r.response_length}", "use a buffer shorter than the response length",
                            keys=("reward.overlong_buffer.len",)))
    return issues


def _name_issue(key: str, value: str, registry: dict, what: str) -> list[Issue]:
    from megarl.algo import lookup

    try:
        lookup(registry, value, what)
        return []
    except ValueError as exc:
        return [Issue(key, value, str(exc), keys=(key,))]


def check_algorithm_names(cfg: MegarlConfig) -> list[Issue]:
    from megarl.algo import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

    issues = _name_issue("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADV_ESTIMATORS, "adv_estimator")
    issues += _name_issue("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES, "policy_loss")
    issues += _name_issue("actor.loss_agg_mode", cfg.actor.loss_agg_mode, LOSS_AGG_MODES, "loss_agg_mode")
    issues += _name_issue("critic.loss_agg_mode", cfg.critic.loss_agg_mode, LOSS_AGG_MODES, "loss_agg_mode")
    issues += _name_issue("actor.kl_loss_type", cfg.actor.kl_loss_type, KL_ESTIMATORS, "kl_loss_type")
    issues += _name_issue("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_ESTIMATORS, "kl_penalty")
    group_based = {"grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"}
    if cfg.algorithm.adv_estimator in group_based and cfg.rollout.n < 2:
        issues.append(Issue("rollout.n", cfg.rollout.n, f"adv_estimator '{cfg.algorithm.adv_estimator}' compares "
                            "samples of the same prompt; with n=1 every advantage is 0",
                            "set rollout.n to 2 or more (e.g. 8)", keys=("rollout.n", "algorithm.adv_estimator")))
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is False:
        issues.append(Issue("critic.enable", False, "adv_estimator 'gae' needs a critic", "set critic.enable=true or "
                            "choose a critic-free estimator such as grpo", keys=("critic.enable",)))
    return issues


def check_data_files(cfg: MegarlConfig) -> list[Issue]:
    issues = []
    for section, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files),
                           ("sft.train_files", cfg.sft.train_files)):
        for i, f in enumerate(files):
            if not f.endswith((".parquet", ".jsonl", ".json")):
                issues.append(Issue(f"{section}[{i}]", f, "unsupported file type", "use .parquet or .jsonl",
                                    keys=(section,)))
    return issues


# Settings the schema knows (users bring them from verl recipes) but the trainer does not act on yet. They are refused
# rather than silently ignored: (key, the value that is accepted, what to do instead).
_NOT_YET = (
    ("rollout.multi_turn.enable", False, "multi-turn rollouts are not supported yet; set it to false"),
    ("rollout.log_prob_use_dynamic_bsz", False, "use rollout.log_prob_micro_batch_size_per_gpu"),
    ("reward.reward_model.enable", False, "learned reward models are not supported yet; use rule-based or "
     "custom reward functions"),
    ("parallelism.context_parallel_size", 1, "context parallelism is not supported yet; set it to 1"),
    ("parallelism.virtual_pipeline_model_parallel_size", None, "virtual pipeline stages are not supported yet; "
     "unset it"),
)


def check_not_yet_supported(cfg: MegarlConfig) -> list[Issue]:
    issues = []
    for key, accepted, fix in _NOT_YET:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value != accepted:
            issues.append(Issue(key, value, "not supported by this version of megarl", fix, keys=(key,)))
    return issues


def check_reward_fn(cfg: MegarlConfig) -> list[Issue]:
    """A named reward must exist and a file reward must import (caught here, before any process starts)."""
    spec = cfg.reward.reward_fn
    if spec is None:
        return []
    from megarl.reward.registry import RewardError, get_reward_fn

    try:
        get_reward_fn(spec)
    except RewardError as exc:
        return [Issue("reward.reward_fn", spec, str(exc), keys=("reward.reward_fn",))]
    return []


def check_wandb(cfg: MegarlConfig) -> list[Issue]:
    import importlib.util

    if cfg.logging.wandb.enable and importlib.util.find_spec("wandb") is None:
        return [Issue("logging.wandb.enable", True, "the wandb package is not installed",
                      "pip install 'megarl[wandb]', or set logging.wandb.enable=false", keys=("logging.wandb.enable",))]
    return []


CHECKS: tuple[Callable[[MegarlConfig], list[Issue]], ...] = (
    check_model_source, check_layout, check_model_layout, check_batches, check_lengths, check_algorithm_names,
    check_data_files, check_reward_fn, check_not_yet_supported, check_wandb)


def run_checks(cfg: MegarlConfig) -> list[Issue]:
    issues = []
    for check in CHECKS:
        issues += check(cfg)
    return issues
