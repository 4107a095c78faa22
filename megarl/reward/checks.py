"""`megarl validate` rules of rewards: the reward function, and the learned rewards (reward.reward_model, reward.judge,
reward.components, and `megarl rm`)."""
from __future__ import annotations

from pathlib import Path

from megarl.config.issues import Issue

RM, J, C = "reward.reward_model.", "reward.judge.", "reward.components."


def _rm_layout_issue(cfg) -> list[Issue]:
    """The reward model runs at the trainer's layout: TP must divide its heads, PP its layers."""
    from megarl.bridge.checks import config_json
    from megarl.bridge.hf_config import BridgeError, check_layout, spec_from_dict

    path = Path(cfg.reward.reward_model.path) / "config.json"
    hf = config_json(path)
    if hf is None:  # missing or damaged: megarl.validate.paths says which, and what writes it
        return []
    p = cfg.parallelism
    try:
        spec = spec_from_dict(hf, str(path))
        check_layout(spec, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
                     p.expert_tensor_parallel_size)
    except BridgeError as exc:
        return [Issue(RM + "path", cfg.reward.reward_model.path, f"the reward model runs at the trainer's layout, "
                      f"which cannot hold it: {exc}", "pick a parallelism.* layout that divides its heads and layers, "
                      "or another reward model", keys=(RM + "path", "parallelism.tensor_model_parallel_size",
                                                        "parallelism.pipeline_model_parallel_size"))]
    if not spec.score_head:
        return [Issue(RM + "path", cfg.reward.reward_model.path, f"{spec.architecture} is not a reward model: it "
                      "needs a *ForSequenceClassification with num_labels 1 (score.weight)",
                      "train one with `megarl rm`, or point it at a sequence-classification checkpoint",
                      keys=(RM + "path",))]
    return []


def _fn_issue(key: str, spec: str, file_only: bool = False) -> list[Issue]:
    from megarl.reward.registry import RewardError, get_reward_fn, load_reward_fn

    try:
        (load_reward_fn if file_only else get_reward_fn)(spec)
    except RewardError as exc:
        return [Issue(key, spec, str(exc), keys=(key,))]
    return []


def check_reward_fn(cfg) -> list[Issue]:
    """A named reward must exist and a file reward must import (caught here, before any process starts)."""
    spec = cfg.reward.reward_fn
    return [] if spec is None else _fn_issue("reward.reward_fn", spec)


def check_learned_rewards(cfg) -> list[Issue]:
    r, issues = cfg.reward, []
    rm, judge = r.reward_model, r.judge
    if rm.enable and not rm.path:
        issues.append(Issue(RM + "path", None, "an enabled reward model needs its directory",
                            "set reward.reward_model.path to a *ForSequenceClassification directory (e.g. what "
                            "`megarl rm` writes)", keys=(RM + "enable", RM + "path")))
    elif rm.enable:
        issues += _rm_layout_issue(cfg)
    else:
        defaults = type(rm)()
        for name in ("path", "micro_batch_size_per_gpu", "max_length"):
            if getattr(rm, name) != getattr(defaults, name):
                issues.append(Issue(RM + name, getattr(rm, name), "read only by an enabled reward model",
                                    "set reward.reward_model.enable=true, or unset it", keys=(RM + name, RM + "enable")))
    if judge.enable:
        if not judge.path:
            issues.append(Issue(J + "path", None, "an enabled judge needs a model", "set reward.judge.path to an HF "
                                "causal-LM directory", keys=(J + "path",)))
        if judge.parser is None:
            issues.append(Issue(J + "parser", None, "a judge needs a parser to turn its verdict into a score",
                                "set reward.judge.parser to number, regex (with parser_regex) or function (with "
                                "parser_fn)", keys=(J + "parser",)))
        elif judge.parser == "regex" and not judge.parser_regex:
            issues.append(Issue(J + "parser_regex", None, "parser regex needs the pattern", "set "
                                "reward.judge.parser_regex, group 1 being the score", keys=(J + "parser_regex",)))
        elif judge.parser == "function":
            issues += [Issue(J + "parser_fn", judge.parser_fn, "parser function needs 'path/to/file.py:function'",
                             keys=(J + "parser_fn",))] if not judge.parser_fn else _fn_issue(J + "parser_fn",
                                                                                             judge.parser_fn, True)
    else:
        defaults = type(judge)()
        for name in type(judge).model_fields:
            if name != "enable" and getattr(judge, name) != getattr(defaults, name):
                issues.append(Issue(J + name, getattr(judge, name), "read only by an enabled judge",
                                    "set reward.judge.enable=true, or unset it", keys=(J + name, J + "enable")))
    if rm.enable and judge.enable and not r.components:
        issues.append(Issue("reward.components", {}, "with both a reward model and a judge the step's reward needs "
                            "its components named", "list them, e.g. reward.components={rm: {type: reward_model}, "
                            "judge: {type: judge}}", keys=("reward.components", RM + "enable", J + "enable")))
    types = {name: c.type for name, c in r.components.items()}
    for name, c in r.components.items():
        if c.type == "reward_model" and not rm.enable:
            issues.append(Issue(C + name + ".type", c.type, "a reward_model component needs reward.reward_model",
                                "set reward.reward_model.enable=true and its path", keys=(C + name, RM + "enable")))
        if c.type == "judge" and not judge.enable:
            issues.append(Issue(C + name + ".type", c.type, "a judge component needs reward.judge",
                                "set reward.judge.enable=true (with path and parser)", keys=(C + name, J + "enable")))
        if c.type != "rule" and (c.fn or c.kwargs):
            issues.append(Issue(C + name + ".fn", c.fn or c.kwargs, "fn and kwargs belong to rule components",
                                "unset them", keys=(C + name,)))
        if c.type == "rule" and c.fn:
            issues += _fn_issue(C + name + ".fn", c.fn)
        if c.clip is not None and c.clip[0] > c.clip[1]:
            issues.append(Issue(C + name + ".clip", list(c.clip), "needs low <= high", keys=(C + name + ".clip",)))
    if r.components:
        for key, on, kind in ((RM + "enable", rm.enable, "reward_model"), (J + "enable", judge.enable, "judge")):
            if on and kind not in types.values():
                issues.append(Issue(key, True, f"with reward.components the {kind} only counts as a component of "
                                    f"type {kind}; none is listed", f"add one, e.g. reward.components.{kind}.type="
                                    f"{kind}, or disable it", keys=(key, "reward.components")))
    elif r.combine_fn:
        issues.append(Issue("reward.combine_fn", r.combine_fn, "combines reward.components, which are empty",
                            "list the components, or unset it", keys=("reward.combine_fn", "reward.components")))
    if r.combine_fn and r.components:
        issues += _fn_issue("reward.combine_fn", r.combine_fn, True)
    return issues
