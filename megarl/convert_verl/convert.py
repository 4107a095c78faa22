"""The conversion: verl settings -> a megarl recipe, each verl key through its rule (megarl.convert_verl.rules) in
layers (verl's trainer defaults, then config files, then the command line: a later layer's key wins), then what verl
derives or fixes itself (megarl.convert_verl.verl_behaviour), then `megarl validate`'s own checks: whatever validate
would refuse is refused here with validate's message and left out of the recipe (one set of rules for what megarl
supports).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from megarl.convert_verl.inputs import EMPTY
from megarl.convert_verl.record import Conversion, get_key, put_key
from megarl.convert_verl.rules import rule_for
from megarl.convert_verl.verl_behaviour import AR, TRAINER_DEFAULTS, derive, fixed_aggregation

_MICRO_GLOBAL = {  # verl's deprecated global micro-batch sizes -> the per-GPU megarl key (divided by the world size)
    AR + "actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size_per_gpu",
    AR + "rollout.log_prob_micro_batch_size": "rollout.log_prob_micro_batch_size_per_gpu",
    AR + "ref.log_prob_micro_batch_size": "ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
}
# verl keys converted outside the rules table (each read together with another key): verl key -> the megarl key
MAPPED_OUTSIDE_RULES = {"custom_reward_function.path": "reward.reward_fn",
                        "custom_reward_function.name": "reward.reward_fn", **_MICRO_GLOBAL}
HUGE_STEPS = 1_000_000  # total_steps when verl's run length is given in epochs only: trainer.total_epochs decides
FILL_IN_MODEL = "FILL_IN/hf_model_dir"


def _apply(c: Conversion, key: str, value: Any, global_micro: dict) -> None:
    """One verl key through its rule; a value the rule cannot use is refused by name, never a traceback."""
    if value == EMPTY:
        c.refuse(key, value, "an empty value (an unset shell variable?); give it a value or drop it")
        return
    if isinstance(value, str) and "${" in value:
        c.drop(key, value, "a Hydra interpolation: megarl derives its own values")
        return
    if key in _MICRO_GLOBAL:
        global_micro[key] = value
        return
    rule = rule_for(key)
    if rule is None:
        c.refuse(key, value, "no megarl equivalent; drop it, or see `megarl validate` for megarl's keys")
        return
    try:
        rule(c, key, value)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
        c.refuse(key, value, f"not a usable value ({exc}); fix it or drop it")


def convert(settings: dict[str, Any], defaults: Optional[dict] = None, unresolved: Sequence = (),
            trainer: str = "ppo_trainer", check: bool = True, from_files: frozenset = frozenset()) -> Conversion:
    """verl settings -> a megarl recipe. `defaults`: verl's trainer defaults (applied under `settings`; None: those of
    `trainer`); `unresolved`: (key, text, why) of inputs that could not be read, refused by name; `check`: run
    megarl validate's rules and refuse what they refuse; `from_files`: keys read from config files (the command
    line's keys win over them)."""
    c = Conversion(trainer=trainer)
    defaults = TRAINER_DEFAULTS[trainer] if defaults is None else defaults
    settings = dict(settings)
    for key, text, why in unresolved:
        c.refuse(key, text, f"{why}; set it (export it, or --env NAME=VALUE) and convert again")
    _reward_function(c, settings)
    global_micro: dict = {}
    _apply_layers(c, settings, defaults, from_files, global_micro)
    _per_gpu_micro_batches(c, global_micro)
    derive(c)
    fixed_aggregation(c)
    if get_key(c.recipe, "model.path") is None:
        put_key(c.recipe, "model.path", FILL_IN_MODEL)
        c.notes.append("model.path: the verl config names no model; fill in a local Hugging Face model directory")
    if check:
        validate_against_megarl(c)
    _run_length(c)
    _placeholder_notes(c)
    return c


def _reward_function(c: Conversion, settings: dict) -> None:
    """verl's file + function name is megarl's "file.py:function" (taken out of `settings`)."""
    reward_path = settings.pop("custom_reward_function.path", None)
    reward_name = settings.pop("custom_reward_function.name", None) or "compute_score"
    if reward_path and reward_path != EMPTY:
        c.set("custom_reward_function.path", reward_path, "reward.reward_fn", f"{reward_path}:{reward_name}")


def _apply_layers(c: Conversion, settings: dict, defaults: dict, from_files: frozenset, global_micro: dict) -> None:
    """verl's defaults (where the user set nothing), then config-file keys, then the command line's, so the command
    line wins where two verl keys set one megarl key; filter_overlong_prompts goes first in its layer, so it decides
    data.truncation whatever the order on the command line."""
    c.layer = 0
    with c.verl_default():
        for key, value in defaults.items():
            if key not in settings:  # an unresolved override leaves verl's default (and is refused by name)
                _apply(c, key, value, global_micro)
    order = sorted(settings, key=lambda k: (k not in from_files, k != "data.filter_overlong_prompts"))
    for key in order:
        c.layer = 1 if key in from_files else 2
        _apply(c, key, settings[key], global_micro)
    c.layer = 2


def _per_gpu_micro_batches(c: Conversion, global_micro: dict) -> None:
    """verl's global micro-batch sizes divided by the world size (nnodes x n_gpus_per_node; 8 when not a count)."""
    nodes, gpus = get_key(c.recipe, "trainer.nnodes", 1), get_key(c.recipe, "trainer.n_gpus_per_node", 8)
    world = nodes * gpus if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (nodes, gpus)) else 8
    for key, value in global_micro.items():
        try:
            c.set(key, value, _MICRO_GLOBAL[key], max(1, math.ceil(int(value) / world)))
        except (TypeError, ValueError) as exc:
            c.drop(key, value, "unset") if value is None else c.refuse(key, value, f"not a usable value ({exc})")


def _run_length(c: Conversion) -> None:
    """verl counts epochs; megarl steps: a run given in epochs only gets steps enough for the epochs to decide."""
    if get_key(c.recipe, "trainer.total_epochs") is not None and get_key(c.recipe, "trainer.total_steps") is None:
        with c.verl_default():
            c.set("trainer.total_training_steps", None, "trainer.total_steps", HUGE_STEPS)
        c.notes.append(f"trainer.total_steps = {HUGE_STEPS}: verl's run length is trainer.total_epochs (no "
                       "trainer.total_training_steps); megarl stops at whichever ends first")


def validate_against_megarl(c: Conversion) -> None:
    """Run `megarl validate`'s rules on the recipe; refuse each verl key whose megarl key they reject, with validate's
    own message, and take it out of the recipe. Problems of settings no verl key gave are refused as the recipe's."""
    from megarl.config import ConfigError
    from megarl.validate import load_config
    from megarl.validate.paths import PathIssue

    seen = set()
    for _ in range(6):
        try:
            load_config(data=c.recipe)
            return
        except ConfigError as exc:  # paths are of the machine converting, not the one the recipe is for: notes
            issues = [i for i in exc.issues if not isinstance(i, PathIssue)]
        progress = False
        for issue in issues:
            keys = [issue.key] + [k for k in issue.keys if k != issue.key]
            owner = next((k for k in keys if k in c.sources), None)
            text = issue.render()
            if owner is None:
                if text not in seen:  # a rule over settings no verl key gave (or one already refused)
                    seen.add(text)
                    c.refused.append(f"(recipe) megarl validate: {text}")
                continue
            _refuse_owner(c, owner, text)
            progress = True
        if not progress:
            return


def _refuse_owner(c: Conversion, owner: str, text: str) -> None:
    """Every verl key that set megarl's `owner` (two can agree on one value) is refused with validate's message."""
    value = get_key(c.recipe, owner)
    givers = c.givers(owner)
    verl_key = c.unset(owner)
    for giver in dict.fromkeys([verl_key] + [g for g in givers if g != verl_key]):
        c.refused.append(f"{giver} = {value!r} -> {owner}: megarl validate refuses it: {text}")


def _placeholder_notes(c: Conversion) -> None:
    """Paths that must exist where megarl runs: hub ids and missing files are flagged for the user to fill in."""
    for key in ("model.path", "critic.model_path", "model.tokenizer_path"):
        value = get_key(c.recipe, key)
        if value and value != FILL_IN_MODEL and not Path(os.path.expanduser(value)).exists():
            c.notes.append(f"{key} = {value!r}: not a directory here; megarl reads a local Hugging Face model "
                           "directory: download it (e.g. `huggingface-cli download NAME --local-dir DIR`) and put "
                           "DIR here" + (" (or, to check the layout before downloading, set model.config_path to the "
                                         "model's config.json)" if key == "model.path" else ""))
    if get_key(c.recipe, "trainer.total_steps") is None:
        c.notes.append("trainer.total_steps: not given (verl counts epochs); megarl runs its default of 10 steps "
                       "unless you set it")
    for key in ("data.train_files", "data.val_files"):
        for f in get_key(c.recipe, key) or []:
            if not Path(os.path.expanduser(f)).exists():
                c.notes.append(f"{key}: {f!r} is not a file here; point it at the parquet/jsonl file")
