"""`megarl validate` rules of the algorithm settings: estimator, loss and KL names in the registries, the options each
loss reads, GDPO's reward dimensions, rollout correction's bounds and on-policy distillation. (The tensor argument
checks of the algo functions themselves are _checks.py.)"""
from __future__ import annotations

from megarl.algo._checks import lookup
from megarl.algo.advantages import ADV_ESTIMATORS
from megarl.algo.aggregation import LOSS_AGG_MODES
from megarl.algo.kl import KL_ESTIMATORS
from megarl.algo.losses import POLICY_LOSS_OPTIONS, POLICY_LOSSES
from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig, PolicyLossOptions


def _name_issue(key: str, value: str, registry: dict, what: str) -> list[Issue]:
    try:
        lookup(registry, value, what)
        return []
    except ValueError as exc:
        return [Issue(key, value, str(exc), keys=(key,))]


def check_algorithm_names(cfg: MegarlConfig) -> list[Issue]:
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
