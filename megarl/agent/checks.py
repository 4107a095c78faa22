"""`megarl validate` rules of multi-turn rollouts with tools (rollout.multi_turn)."""
from __future__ import annotations

from pathlib import Path

from megarl.agent.tools import ToolConfigError, load_tools
from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig


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
                            "set it to a YAML file with a 'tools:' list (see docs/multiturn.md)",
                            keys=(M + "tool_config_path",)))
    elif Path(mt.tool_config_path).is_file():  # otherwise check_paths says where it is not
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
