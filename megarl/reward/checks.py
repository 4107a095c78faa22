"""`megarl validate` rules of rewards: the reward function (and, routed by data_source, one for every row of the
prompt files), and the learned rewards (reward.reward_model, reward.judge, reward.components, and `megarl rm`)."""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Optional

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
    """A named reward must exist and a file reward must import (caught here, before any process starts); without one,
    every row's data_source must route to a registered reward (at run time the first unknown one stops the run only
    after the first validation pass or rollout, minutes into a real model's run)."""
    spec = cfg.reward.reward_fn
    return _data_source_issues(cfg) if spec is None else _fn_issue("reward.reward_fn", spec)


def data_source_counts(path: str, key: str) -> Optional[Counter]:
    """{data_source: rows} of a .parquet or .jsonl prompt file, reading that column only (parquet) or parsing only
    the lines that mention it (jsonl); None where the file cannot say (no such column, unreadable, another type):
    the data loader names those problems when it reads the file at start."""
    counts: Counter = Counter()
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            if key not in pf.schema_arrow.names:
                return None
            column = pf.read(columns=[key]).column(0)
        except Exception:  # noqa: BLE001 - pyarrow raises several types for a damaged file; the loader names it
            return None
        import pyarrow.compute as pc

        for item in pc.value_counts(column).to_pylist():
            if item["values"] is not None:
                counts[str(item["values"])] += item["counts"]
        return counts
    if not path.endswith(".jsonl"):
        return None
    needle = json.dumps(key, ensure_ascii=False).encode()
    # the key first on its line (as megarl's synthetic rows have it) is the row's own: its string is read alone
    first = re.compile(rb'\s*\{\s*' + re.escape(needle) + rb'\s*:\s*("(?:[^"\\]|\\.)*")\s*[,}]')
    with open(path, "rb") as f:
        for line in f:
            found = line.count(needle)
            if not found:  # no such key on this row: nothing to parse
                continue
            try:
                m = first.match(line) if found == 1 else None
                row = {key: json.loads(m.group(1))} if m else json.loads(line)
            except ValueError:
                return None
            value = row.get(key) if isinstance(row, dict) else None
            if value is not None:
                counts[str(value)] += 1
    return counts


def _rows_routed(cfg) -> tuple[bool, bool]:
    """(train rows, val rows) scored by routing on data_source, with reward.reward_fn unset."""
    r = cfg.reward
    # the step's reward: a rule component without its own fn, or the rule alone (megarl.reward.combine)
    rule = (any(c.type == "rule" and not c.fn for c in r.components.values()) if r.components
            else not (r.reward_model.enable or r.judge.enable))
    pairs = cfg.rm.policy_pairs.enable  # `megarl rm` scores the policy's samples on both splits' prompts
    # validation is always scored by the rule (steps.validate)
    return rule or pairs, cfg.trainer.val_before_train or bool(cfg.trainer.test_freq) or pairs


def _data_source_issues(cfg) -> list[Issue]:
    from megarl.reward.registry import ALIASES, REGISTRY, RewardError, RewardRouter

    router, key, issues = RewardRouter(), cfg.data.data_source_key, []
    for section, files, routed in zip(("data.train_files", "data.val_files"), (cfg.data.train_files,
                                                                               cfg.data.val_files), _rows_routed(cfg)):
        for i, path in enumerate(files if routed else ()):
            counts = data_source_counts(path, key) if os.path.isfile(path) else None  # missing: paths.py says so
            unknown = []
            for source, n in sorted((counts or {}).items()):
                try:
                    router.resolve(source)
                except RewardError:
                    unknown.append((source, n))
            if not unknown:
                continue
            shown = ", ".join(f"{s!r} ({n} row{'s' if n != 1 else ''})" for s, n in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            aliases = sorted(a for a, name in ALIASES.items() if a != name)
            issues.append(Issue(
                f"{section}[{i}]", path, f"no reward function for {key} {shown}{more}: reward.reward_fn is unset, so "
                f"each row is scored by the reward its {key} names; registered: {sorted(REGISTRY)}, aliases: "
                f"{aliases}", "set reward.reward_fn to a registered name or 'path/to/file.py:function' (it scores "
                "every row and is passed each row's data_source), or register the name with megarl.reward."
                f"register_reward(NAME, fn, aliases=[{unknown[0][0]!r}]), or fix the column (data.data_source_key="
                f"{key!r})", keys=(f"{section}[{i}]", "reward.reward_fn", "data.data_source_key")))
    return issues


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
