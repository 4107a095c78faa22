"""`megarl convert-verl`: a verl Hydra config (YAML) or verl command line -> a megarl recipe.

Every verl key is either mapped (printed as `verl key = value -> megarl key = value`), dropped because it asks for
nothing megarl would do differently (printed with the reason), or refused by name with what to do instead. verl
defaults that differ from megarl's (adv_estimator gae, batch sizes, 8 GPUs per node) are written out explicitly, so
the recipe trains what the verl command would have.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from megarl.config.loader import parse_value as override_value

DESCRIPTION = ("Turn a verl Hydra config (YAML) or a verl command line (key=value overrides, or a .sh script that "
               "runs verl.trainer.main_ppo) into a megarl recipe. Prints every key it mapped and refuses, by name, "
               "each it cannot; the recipe goes to stdout or --out.")

AR = "actor_rollout_ref."
_OPTIM = ("lr", "weight_decay", "betas", "clip_grad", "lr_warmup_steps", "min_lr")
_MICRO_GLOBAL = {  # verl's deprecated global micro-batch sizes -> the per-GPU megarl key (divided by the world size)
    AR + "actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size_per_gpu",
    AR + "rollout.log_prob_micro_batch_size": "rollout.log_prob_micro_batch_size_per_gpu",
    AR + "ref.log_prob_micro_batch_size": "ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
}
# verl defaults (ppo_trainer.yaml) that differ from megarl's; written out when the verl config leaves them unset.
VERL_DEFAULTS = {
    "algorithm.adv_estimator": "gae",
    "data.train_batch_size": 1024,
    "actor.ppo_mini_batch_size": 256,
    "trainer.n_gpus_per_node": 8,
}


@dataclass
class Conversion:
    recipe: dict = field(default_factory=dict)
    mapped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # megarl key -> the verl key that set it

    def set(self, verl_key: str, value: Any, key: str, new: Any = None) -> None:
        new = value if new is None else new
        if key in self.sources and _get(self.recipe, key) != new:
            self.refuse(verl_key, value, f"megarl has one {key} (already {_get(self.recipe, key)!r} from "
                                         f"{self.sources[key]}); set it once")
            return
        _put(self.recipe, key, new)
        self.sources.setdefault(key, verl_key)
        self.mapped.append(f"{verl_key} = {value!r} -> {key} = {new!r}")

    def drop(self, verl_key: str, value: Any, why: str) -> None:
        self.dropped.append(f"{verl_key} = {value!r}: {why}")

    def refuse(self, verl_key: str, value: Any, why: str) -> None:
        self.refused.append(f"{verl_key} = {value!r}: {why}")


def _put(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _get(tree: dict, key: str, default: Any = None) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


# ----------------------------------------------------------------------------------------------------------------------
# Reading verl's inputs


def parse_value(text: str) -> Any:
    """A Hydra override value: YAML (true, null, [a,b], 'quoted'), plus numbers YAML 1.1 leaves as text (1e-6)."""
    value = override_value(text)
    if isinstance(value, str):
        for cast in (int, float):
            try:
                return cast(value)
            except ValueError:
                pass
    return value


def script_overrides(text: str) -> list[str]:
    """The key=value arguments of a shell command line or script running verl (line continuations, `$@`, pipes,
    env assignments before the command and the command itself are skipped)."""
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    out = []
    for token in tokens:
        if token in ("|", "&&", ";") or token.startswith(("2>", ">")):
            break
        key, sep, _ = token.partition("=")
        if sep and "." in key and not token.startswith("-"):
            out.append(token)
    return out


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested verl config -> {dotted key: leaf value} (lists stay values)."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def read_inputs(items: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """verl settings from YAML files, .sh scripts and key=value overrides, later ones winning; and notes."""
    settings: dict[str, Any] = {}
    notes = []
    for item in items:
        path = Path(item)
        if "=" not in item and path.suffix in (".yaml", ".yml") and path.is_file():
            settings.update(flatten(yaml.safe_load(path.read_text()) or {}))
        elif "=" not in item and path.is_file():
            from_script, script_notes = read_inputs(script_overrides(path.read_text()))
            settings.update(from_script)
            notes += script_notes
        elif "=" in item:
            key, _, text = item.partition("=")
            if key.startswith("~"):
                notes.append(f"{item}: Hydra deletions have no meaning for a megarl recipe (skipped)")
                continue
            settings[key.lstrip("+")] = parse_value(text)
        else:
            raise ValueError(f"{item!r} is neither a key=value override nor a YAML or shell file")
    return settings, notes


# ----------------------------------------------------------------------------------------------------------------------
# Rules, one per verl key or key family


def _to(key: str, fn: Optional[Callable[[Any], Any]] = None):
    """A rule mapping the verl value to `key` (through fn)."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        c.set(verl_key, value, key, fn(value) if fn else None)
    return rule


def _files(value: Any) -> list:
    return [value] if isinstance(value, str) else list(value)


def _is(value: Any, choices: tuple) -> bool:
    """`value in choices` without Python's True == 1 (an offload=True must not pass for a size of 1)."""
    return any(value is c or (type(value) is type(c) and value == c) for c in choices)


def _no_effect(why: str):
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        c.drop(verl_key, value, why)
    return rule


def _accept(allowed: tuple, why: str, refused: str):
    """Keys whose allowed values ask for what megarl does anyway (dropped, with why); anything else is refused."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if _is(value, allowed):
            c.drop(verl_key, value, why)
        else:
            c.refuse(verl_key, value, refused)
    return rule


def _off_only(why_off: str, why_refused: str, off: tuple = (None, False, 0, "", [])):
    """Keys whose off value is what megarl does anyway."""
    return _accept(off, why_off, why_refused)


def _freq(key: str):
    """verl's -1 (never) is megarl's 0."""
    return _to(key, lambda v: 0 if v is not None and int(v) < 0 else v)


def _recompute(c: Conversion, verl_key: str, value: Any) -> None:
    c.set(verl_key, value, "model.recompute", "full" if value else "none")


def _truncation(c: Conversion, verl_key: str, value: Any) -> None:
    if value == "middle":
        c.refuse(verl_key, value, "megarl truncates prompts from the left or right only; use 'left' or 'right'")
    elif _get(c.recipe, "data.truncation") == "filter":  # filter_overlong_prompts came first and decides
        c.drop(verl_key, value, "data.filter_overlong_prompts=True already drops long prompts (data.truncation=filter)")
    else:
        c.set(verl_key, value, "data.truncation")


def _filter_overlong(c: Conversion, verl_key: str, value: Any) -> None:
    if value:
        c.set(verl_key, value, "data.truncation", "filter")
    else:
        c.drop(verl_key, value, "off: prompts over data.max_prompt_length follow data.truncation")


def _logger(c: Conversion, verl_key: str, value: Any) -> None:
    names = [value] if isinstance(value, str) else list(value or [])
    for name in names:
        if name == "wandb":
            c.set(verl_key, value, "logging.wandb.enable", True)
        elif name == "tensorboard":
            c.set(verl_key, value, "logging.tensorboard", True)
        elif name != "console":
            c.refuse(verl_key, name, "megarl logs to the console, metrics.jsonl, tensorboard and wandb only")
    if names == ["console"]:
        c.drop(verl_key, value, "megarl always prints a line per reported step")


def _rollout_name(c: Conversion, verl_key: str, value: Any) -> None:
    if value == "vllm":
        c.drop(verl_key, value, "vLLM is megarl's engine")
    else:
        c.refuse(verl_key, value, "megarl's rollout engine is vLLM; drop this key")


def _load_format(c: Conversion, verl_key: str, value: Any) -> None:
    fmt = "dummy" if str(value).startswith("dummy") else value
    if fmt in ("dummy", "auto", "safetensors"):
        c.set(verl_key, value, "rollout.load_format", fmt)
    else:
        c.refuse(verl_key, value, "megarl's engine loads 'dummy', 'auto' or 'safetensors' weights")


def _resume_mode(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("auto", "disable"):
        c.set(verl_key, value, "checkpoint.resume")
    else:  # resume_path: the path comes with trainer.resume_from_path
        c.drop(verl_key, value, "the checkpoint path comes from trainer.resume_from_path")


def _reward_manager(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("naive", "dapo"):
        c.drop(verl_key, value, "megarl scores each sample with the reward function; overlong shaping is "
                                "reward.overlong_buffer")
    else:
        c.refuse(verl_key, value, "megarl has one reward manager (per-sample functions)")


def _rs_threshold(c: Conversion, verl_key: str, value: Any) -> None:
    if value is None:
        c.drop(verl_key, value, "unset")
    elif isinstance(value, (int, float)) and value > 1:
        c.set(verl_key, value, "algorithm.rollout_correction.rejection_threshold", float(value))
    else:
        c.refuse(verl_key, value, "megarl rejects ratios outside [1/threshold, threshold] for one threshold > 1")


def _level(key: str, levels: tuple[str, ...]):
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if value is None:
            c.drop(verl_key, value, "off (megarl's default)")
        elif value in levels:
            c.set(verl_key, value, key)
        else:
            c.refuse(verl_key, value, f"megarl supports {', '.join(levels)} here")
    return rule


def _policy_loss(c: Conversion, verl_key: str, value: Any) -> None:
    from megarl.algo import POLICY_LOSSES

    if value in POLICY_LOSSES:
        c.set(verl_key, value, "actor.policy_loss")
    else:
        c.refuse(verl_key, value, f"megarl's policy losses are {sorted(POLICY_LOSSES)}")


def _lr_schedule(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("constant", "cosine", "linear"):
        c.set(verl_key, value, verl_key.replace(AR, "").rsplit(".", 1)[0] + ".lr_decay_style")
    else:
        c.refuse(verl_key, value, "megarl schedules: constant, linear, cosine")


_OFFLOAD = "megarl trains with Megatron and keeps parameters, gradients and optimizer states in accelerator " \
           "memory (no offload); drop it and check the memory with `megarl plan`"
_NO_PADDING_SWITCH = "megarl masks padding out of every loss; there is no padded/unpadded switch"
_FSDP = "an FSDP setting; megarl trains with Megatron (set parallelism.* instead)"
_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
             "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
             "use_distributed_optimizer", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")

RULES: dict[str, Callable[[Conversion, str, Any], None]] = {
    # data
    "data.train_files": _to("data.train_files", _files),
    "data.val_files": _to("data.val_files", _files),
    "data.max_prompt_length": _to("rollout.prompt_length"),
    "data.max_response_length": _to("rollout.response_length"),
    "data.reward_fn_key": _to("data.data_source_key"),
    "data.seed": _to("trainer.seed"),
    "data.truncation": _truncation,
    "data.filter_overlong_prompts": _filter_overlong,
    "data.filter_overlong_prompts_workers": _no_effect("megarl filters prompts in the loading process"),
    "data.return_raw_chat": _no_effect("megarl renders the chat template itself (data.apply_chat_template)"),
    "data.return_raw_input_ids": _no_effect("megarl renders the chat template itself (data.apply_chat_template)"),
    "data.tokenizer": _to("model.tokenizer_path"),
    # model
    AR + "model.path": _to("model.path"),
    AR + "model.trust_remote_code": _to("model.trust_remote_code"),
    AR + "model.enable_gradient_checkpointing": _recompute,
    AR + "model.use_remove_padding": _no_effect(_NO_PADDING_SWITCH),
    AR + "model.use_fused_kernels": _off_only("off", "megarl has no fused-kernel switch; drop it"),
    AR + "model.lora_rank": _off_only("no LoRA", "LoRA is not supported by megarl; full fine-tuning only"),
    AR + "model.use_shm": _off_only("off", "megarl reads the model from model.path; drop it"),
    # actor
    AR + "actor.grad_clip": _to("actor.optim.clip_grad"),
    AR + "actor.policy_loss.loss_mode": _policy_loss,
    AR + "actor.strategy": _accept(("megatron",), "megarl's trainer is Megatron", "megarl trains with Megatron "
                                   "whatever verl's strategy was; drop it (set parallelism.* for the layout)"),
    AR + "actor.ulysses_sequence_parallel_size": _off_only("no sequence parallelism over heads",
                                                           "Ulysses sequence parallelism is not supported; use "
                                                           "parallelism.tensor_model_parallel_size",
                                                           off=(None, 0, 1)),
    # rollout
    AR + "rollout.name": _rollout_name,
    AR + "rollout.mode": _no_effect("megarl's engine serves every request of a step together"),
    AR + "rollout.expert_parallel_size": _to("rollout.expert_model_parallel_size"),
    AR + "rollout.load_format": _load_format,
    AR + "rollout.multi_turn.enable": _to("rollout.multi_turn.enable"),
    AR + "rollout.micro_batch_size": _no_effect("deprecated in verl and unused"),
    AR + "rollout.prompt_length": _no_effect("verl derives it from data.max_prompt_length (rollout.prompt_length)"),
    AR + "rollout.response_length": _no_effect("verl derives it from data.max_response_length "
                                               "(rollout.response_length)"),
    # reference
    AR + "ref.log_prob_micro_batch_size_per_gpu": _to("ref.log_prob_micro_batch_size_per_gpu"),
    # critic
    "critic.model.path": _to("critic.model_path"),
    "critic.grad_clip": _to("critic.optim.clip_grad"),
    "critic.model.enable_gradient_checkpointing": _recompute,
    "critic.model.use_remove_padding": _no_effect(_NO_PADDING_SWITCH),
    "critic.model.trust_remote_code": _to("model.trust_remote_code"),
    "critic.ppo_mini_batch_size": _no_effect("megarl's critic uses the actor's mini-batches "
                                             "(actor.ppo_mini_batch_size)"),
    # reward
    "reward_model.enable": _off_only("no learned reward model", "learned reward models are not supported yet; "
                                     "use a rule-based or custom reward function (reward.reward_fn)"),
    "reward_model.reward_manager": _reward_manager,
    # algorithm
    "algorithm.rollout_correction.bypass_mode": _to("algorithm.rollout_correction.use_rollout_log_probs"),
    "algorithm.rollout_correction.rollout_is": _level("algorithm.rollout_correction.is_level", ("token", "sequence")),
    "algorithm.rollout_correction.rollout_is_threshold": _to("algorithm.rollout_correction.is_threshold", float),
    "algorithm.rollout_correction.rollout_rs": _level("algorithm.rollout_correction.rejection_level",
                                                      ("token", "sequence", "geometric")),
    "algorithm.rollout_correction.rollout_rs_threshold": _rs_threshold,
    "algorithm.rollout_correction.rollout_rs_threshold_lower": _off_only(
        "unset: the lower bound is 1/threshold", "megarl's lower bound is 1/rollout_rs_threshold; drop it"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": _off_only(
        "off", "batch-normalised importance weights are not supported; drop it"),
    "algorithm.rollout_correction.rollout_token_veto_threshold": _off_only(
        "off", "a token veto is not supported; use rollout_rs=token with rollout_rs_threshold"),
    "algorithm.rollout_correction.loss_type": _accept(("ppo_clip",), "megarl's loss is actor.policy_loss",
                                                      "megarl's correction reweights actor.policy_loss; drop it"),
    "algorithm.rollout_correction.use_policy_gradient": _off_only("off", "megarl's correction reweights "
                                                                  "actor.policy_loss; drop it"),
    # trainer
    "trainer.total_training_steps": _to("trainer.total_steps"),
    "trainer.save_freq": _freq("checkpoint.save_freq"),
    "trainer.test_freq": _freq("trainer.test_freq"),
    "trainer.critic_warmup": _to("critic.warmup_steps"),
    "trainer.logger": _logger,
    "trainer.project_name": _to("logging.wandb.project"),
    "trainer.experiment_name": _to("logging.wandb.name"),
    "trainer.default_local_dir": _to("trainer.run_dir"),
    "trainer.default_hdfs_dir": _off_only("unset", "megarl writes checkpoints to trainer.run_dir only; copy them "
                                          "to HDFS yourself"),
    "trainer.resume_mode": _resume_mode,
    "trainer.resume_from_path": _to("checkpoint.resume"),
    "trainer.max_actor_ckpt_to_keep": _to("checkpoint.keep_last_k"),
    "trainer.balance_batch": _no_effect("a throughput option; megarl has no equivalent and results do not depend "
                                        "on it"),
    "trainer.log_val_generations": _no_effect("megarl saves rollouts with logging.save_rollouts"),
    "trainer.total_epochs": lambda c, k, v: c.refuse(k, v, "megarl counts steps: set trainer.total_steps to "
                                                     f"{v} x (training prompts / data.train_batch_size)"),
}


# verl keys whose megarl key has the same name under the given section: {verl prefix: (megarl prefix, names)}
_SAME_NAMES = {
    "data.": ("data.", (
        "train_batch_size", "val_batch_size", "prompt_key", "shuffle", "dataloader_num_workers")),
    AR + "actor.": ("actor.", (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "shuffle", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
        "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")),
    AR + "rollout.": ("rollout.", (
        "n", "temperature", "top_p", "top_k", "do_sample", "ignore_eos", "dtype", "gpu_memory_utilization",
        "tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size", "enforce_eager",
        "free_cache_engine", "enable_chunked_prefill", "enable_prefix_caching", "max_num_batched_tokens",
        "max_num_seqs", "max_model_len", "calculate_log_probs", "log_prob_micro_batch_size_per_gpu",
        "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "update_weights_bucket_megabytes")),
    "critic.": ("critic.", (
        "enable", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "cliprange_value", "loss_agg_mode")),
    "reward_model.overlong_buffer.": ("reward.overlong_buffer.", (
        "enable", "len", "penalty_factor")),
    "algorithm.": ("algorithm.", (
        "adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty")),
    "algorithm.kl_ctrl.": ("algorithm.kl_ctrl.", (
        "type", "kl_coef", "target_kl", "horizon")),
    "algorithm.filter_groups.": ("algorithm.filter_groups.", (
        "enable", "metric", "max_num_gen_batches")),
    "trainer.": ("trainer.", (
        "val_before_train", "n_gpus_per_node", "nnodes", "device")),
}
RULES.update({verl + name: _to(megarl + name) for verl, (megarl, names) in _SAME_NAMES.items() for name in names})


def _family_rule(key: str) -> Optional[Callable[[Conversion, str, Any], None]]:
    """Rules for families of keys: optimizers, Megatron layouts, FSDP settings, validation sampling."""
    short = key.removeprefix(AR)
    role, _, rest = short.partition(".")
    if role in ("actor", "critic") and rest.startswith("optim."):
        name = rest.removeprefix("optim.")
        target = f"{role}.optim."
        if name in _OPTIM:
            return _to(target + name)
        if name in ("warmup_style", "lr_scheduler_type"):
            return _lr_schedule
        if name in ("lr_warmup_steps_ratio", "min_lr_ratio", "total_training_steps", "lr_warmup_init"):
            return _off_only("unset", f"give the warm-up in steps ({target}lr_warmup_steps) and the final rate "
                                      f"as a value ({target}min_lr)")
    if role in ("actor", "ref", "critic") and rest.startswith("megatron."):
        name = rest.removeprefix("megatron.")
        if name.removeprefix("override_transformer_config.") in _PARALLEL[-2:]:  # verl's uneven-stage settings
            name = name.removeprefix("override_transformer_config.")
        if name in _PARALLEL:
            return _to(f"parallelism.{name}")
        if "offload" in name:
            return _off_only("no offload", _OFFLOAD)
        if name == "seed":
            return _no_effect("megarl seeds everything from trainer.seed")
    if ".fsdp_config." in f".{rest}":
        return _off_only("no offload (an FSDP setting)", _OFFLOAD) if "offload" in key else _no_effect(_FSDP)
    if short.startswith("rollout.val_kwargs."):
        return _to("rollout.val_kwargs." + short.removeprefix("rollout.val_kwargs."))
    if short.startswith("actor.checkpoint.") or short.startswith("critic.checkpoint."):
        return _no_effect("megarl checkpoints the model, optimizer and scheduler together")
    return None


def convert(settings: dict[str, Any]) -> Conversion:
    c = Conversion()
    settings = dict(settings)
    reward_path = settings.pop("custom_reward_function.path", None)
    reward_name = settings.pop("custom_reward_function.name", None) or "compute_score"
    if reward_path:  # verl's file + function name is megarl's "file.py:function"
        c.set("custom_reward_function.path", reward_path, "reward.reward_fn", f"{reward_path}:{reward_name}")
    global_micro = {}
    # filter_overlong_prompts decides data.truncation whatever the order on the command line
    order = sorted(settings, key=lambda k: k != "data.filter_overlong_prompts")
    for key in order:
        value = settings[key]
        if isinstance(value, str) and "${" in value:
            c.drop(key, value, "a Hydra interpolation: megarl derives its own values")
            continue
        if key in _MICRO_GLOBAL:
            global_micro[key] = value
            continue
        rule = RULES.get(key) or _family_rule(key)
        if rule is None:
            c.refuse(key, value, "no megarl equivalent; drop it, or see `megarl validate` for megarl's keys")
        else:
            rule(c, key, value)
    world = _get(c.recipe, "trainer.nnodes", 1) * _get(c.recipe, "trainer.n_gpus_per_node",
                                                       VERL_DEFAULTS["trainer.n_gpus_per_node"])
    for key, value in global_micro.items():
        if value is None:
            c.drop(key, value, "unset")
        else:
            c.set(key, value, _MICRO_GLOBAL[key], max(1, math.ceil(int(value) / world)))
    for key, value in VERL_DEFAULTS.items():
        if _get(c.recipe, key) is None:
            _put(c.recipe, key, value)
            c.mapped.append(f"(verl default) -> {key} = {value!r}")
    _placeholder_notes(c)
    return c


def _placeholder_notes(c: Conversion) -> None:
    """Paths that must exist where megarl runs: hub ids and missing files are flagged for the user to fill in."""
    for key in ("model.path", "critic.model_path", "model.tokenizer_path"):
        value = _get(c.recipe, key)
        if value and not Path(os.path.expanduser(os.path.expandvars(value))).exists():
            c.notes.append(f"{key} = {value!r}: not a directory here; megarl reads a local Hugging Face model "
                           "directory: download it (e.g. `huggingface-cli download NAME --local-dir DIR`) and put "
                           "DIR here")
    if _get(c.recipe, "trainer.total_steps") is None:
        c.notes.append("trainer.total_steps: not given (verl counts epochs); megarl runs its default of 10 steps "
                       "unless you set it")
    if _get(c.recipe, "model.path") is None:
        _put(c.recipe, "model.path", "FILL_IN/hf_model_dir")
        c.notes.append("model.path: the verl config names no model; fill in a local Hugging Face model directory")
    for key in ("data.train_files", "data.val_files"):
        for f in _get(c.recipe, key) or []:
            if "$" in f or not Path(os.path.expanduser(f)).exists():
                c.notes.append(f"{key}: {f!r} is not a file here; point it at the parquet/jsonl file (megarl does "
                               "not expand shell variables)")


def to_recipe_text(c: Conversion, sources: Sequence[str]) -> str:
    head = ["# A megarl recipe converted from verl by `megarl convert-verl` from:"]
    head += [f"#   {s}" for s in sources[:8]] + (["#   ..."] if len(sources) > 8 else [])
    head += [f"# FILL IN: {n}" for n in c.notes]
    head += [f"# REFUSED (not in this recipe): {r}" for r in c.refused]
    return "\n".join(head) + "\n" + yaml.safe_dump(c.recipe, sort_keys=False, default_flow_style=False)


def report_lines(c: Conversion) -> list[str]:
    lines = [f"mapped ({len(c.mapped)}):"] + [f"  {m}" for m in c.mapped]
    if c.dropped:
        lines += [f"dropped, no effect in megarl ({len(c.dropped)}):"] + [f"  {d}" for d in c.dropped]
    if c.refused:
        lines += [f"REFUSED, not converted ({len(c.refused)}):"] + [f"  {r}" for r in c.refused]
    if c.notes:
        lines += ["fill in before training:"] + [f"  {n}" for n in c.notes]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                        help="verl config YAML, a shell script running verl, and/or overrides such as "
                        "actor_rollout_ref.rollout.n=8 (later ones win)")
    parser.add_argument("--out", "-o", default=None, help="write the recipe here instead of stdout")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any key was refused")


def run(args: argparse.Namespace) -> int:
    try:
        settings, notes = read_inputs(args.inputs)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        print(f"megarl convert-verl: {exc}", file=sys.stderr)
        return 1
    c = convert(settings)
    c.notes = notes + c.notes
    text = to_recipe_text(c, args.inputs)
    for line in report_lines(c):
        print(line, file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
        print(f"recipe: {args.out} (check it with `megarl validate {args.out}`)", file=sys.stderr)
    else:
        print(text, end="")
    return 1 if (args.strict and c.refused) else 0
