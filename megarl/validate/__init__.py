"""A recipe loaded and checked: the schema (megarl.config), then every feature's rules, all problems reported at once.

    cfg = load_config("recipes/grpo_tiny_cpu.yaml", ["rollout.temperature=0.7", "trainer.total_steps=10"])

Each feature's rules live beside the feature (algo/, bridge/, data/, lora/, megatron/, reward/, rollout/ and agent/
checks.py; the files a recipe names: paths.py here). This module composes them in the order their problems are
listed and holds the rules that read several features' settings. A rule returns Issues naming the keys it reads; none
raises.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Callable, Iterable, Optional

from megarl.agent.checks import check_multi_turn
from megarl.algo.checks import check_algorithm_names, check_distillation
from megarl.bridge.checks import check_architecture, check_model_source
from megarl.config.issues import Issue
from megarl.config.loader import config_or_error, parse_config
from megarl.config.schema import MegarlConfig
from megarl.data.checks import check_data_files, check_synthetic
from megarl.lora.checks import check_lora
from megarl.megatron.checks import (check_batches, check_device, check_layout, check_model_layout,
                                    check_parallel_options, check_router_replay, check_virtual_pipeline, check_warmup)
from megarl.reward.checks import check_learned_rewards, check_reward_fn
from megarl.rollout.checks import (check_engine_dtype, check_engine_layout, check_lengths,
                                   check_quantization, check_rollout_logprobs, check_sampling, check_trainer_mode,
                                   cpu_engine_issues)
from megarl.rollout.hf.checks import check_engine_available, check_hf_engine
from megarl.validate.images import check_image_rows
from megarl.validate.paths import check_paths


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


def check_wandb(cfg: MegarlConfig) -> list[Issue]:
    if cfg.logging.wandb.enable and importlib.util.find_spec("wandb") is None:
        return [Issue("logging.wandb.enable", True, "the wandb package is not installed",
                      "pip install 'megarl[wandb]', or set logging.wandb.enable=false", keys=("logging.wandb.enable",))]
    return []


CHECKS: tuple[Callable[[MegarlConfig], list[Issue]], ...] = (
    check_paths, check_distillation,
    check_engine_available, check_hf_engine,
    check_model_source, check_layout, check_model_layout, check_architecture, check_engine_layout,
    cpu_engine_issues, check_engine_dtype,
    check_batches,
    check_lengths, check_warmup,
    check_algorithm_names, check_data_files, check_image_rows, check_reward_fn, check_not_yet_supported,
    check_sampling,
    check_rollout_logprobs, check_quantization, check_device, check_parallel_options,
    check_dependent_settings,
    check_trainer_mode, check_synthetic, check_multi_turn, check_wandb, check_learned_rewards,
    check_router_replay, check_lora, check_virtual_pipeline)


def rule_id(check: Callable) -> str:
    """The troubleshooting id of every problem a rule finds, from the rule's name (check_lengths -> config-lengths):
    a new rule has one without being told, and tests/unit/test_error_ids.py asks the page for its entry."""
    return "config-" + check.__name__.removeprefix("check_").removesuffix("_issues").replace("_", "-")


def run_checks(cfg: MegarlConfig) -> list[Issue]:
    issues = []
    for check in CHECKS:
        issues += [dataclasses.replace(issue, error_id=rule_id(check)) for issue in check(cfg)]
    return issues


def load_config(recipe: str | Path | None = None, overrides: Iterable[str] = (), *,
                data: Optional[dict] = None) -> MegarlConfig:
    """Load, override and check a recipe; raise ConfigError listing every problem found (warnings: cfg._warnings)."""
    cfg, issues = parse_config(recipe, overrides, data=data)
    if cfg is not None:
        bad_keys = {i.key for i in issues}  # a rule over a key the schema refused would report it again
        issues += [i for i in run_checks(cfg) if not (set(i.keys) & bad_keys)]
    return config_or_error(recipe, cfg, issues)
