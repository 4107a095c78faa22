"""`megarl convert-verl`: a verl Hydra config (YAML), verl command line or launch script -> a megarl recipe.

Every verl key is either mapped (printed as `verl key = value -> megarl key = value`), dropped because it asks for
nothing megarl would do differently (printed with the reason), or refused by name with what to do instead. Scripts are
read as bash would expand them (megarl.convert_verl.interpreter), never run; an override naming a variable that cannot
be resolved is refused by the variable's name. `--config-path/--config-name` files (and their Hydra `defaults`) are
read. The defaults of the verl trainer the command names (ppo_trainer, or ppo_megatron_trainer with its sequence
parallelism and distributed optimizer) that differ from megarl's are applied first, so the recipe trains what the verl
command would have. Where verl's code computes something other than its keys say (sapo and geo_mean fix their own
aggregation, VERL_FIXED_AGGREGATION), the recipe names what verl computes; what megarl would still train differently is
listed as DIFFERS (and fails --strict). Finally the recipe goes through `megarl validate`'s own checks: whatever
validate would refuse is refused here with validate's message and left out of the recipe (one set of rules for what
megarl supports).
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
from megarl.convert_verl.interpreter import ShellParseError, read_script

DESCRIPTION = ("Turn a verl Hydra config (YAML) or a verl command line (key=value overrides, or a .sh script that "
               "runs verl.trainer.main_ppo) into a megarl recipe. Prints every key it mapped and refuses, by name, "
               "each it cannot; the recipe goes to stdout or --out.")

AR = "actor_rollout_ref."
_OPTIM = ("lr", "weight_decay", "betas", "clip_grad", "min_lr")
_MICRO_GLOBAL = {  # verl's deprecated global micro-batch sizes -> the per-GPU megarl key (divided by the world size)
    AR + "actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size_per_gpu",
    AR + "rollout.log_prob_micro_batch_size": "rollout.log_prob_micro_batch_size_per_gpu",
    AR + "ref.log_prob_micro_batch_size": "ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
}
# verl's defaults (verl/trainer/config/_generated_ppo_trainer.yaml and _generated_ppo_megatron_trainer.yaml) that
# differ from megarl's and change what is trained or where; applied under the user's settings, through the same rules.
_VERL_COMMON_DEFAULTS = {
    "algorithm.adv_estimator": "gae",
    "data.train_batch_size": 1024,
    AR + "actor.ppo_mini_batch_size": 256,
    AR + "rollout.tensor_model_parallel_size": 2,
    "trainer.n_gpus_per_node": 8,
    "trainer.total_epochs": 30,
    "trainer.device": "cuda",
}
TRAINER_DEFAULTS = {
    "ppo_trainer": dict(_VERL_COMMON_DEFAULTS),
    "ppo_megatron_trainer": {**_VERL_COMMON_DEFAULTS,
                             AR + "actor.megatron.sequence_parallel": True,  # verl turns it off at TP 1 (kept so here)
                             AR + "actor.megatron.use_distributed_optimizer": True},
}
VERL_DEFAULTS = {"algorithm.adv_estimator": "gae", "data.train_batch_size": 1024, "actor.ppo_mini_batch_size": 256,
                 "trainer.n_gpus_per_node": 8}  # megarl keys of the common defaults (README, tests)
EMPTY = ""  # a `key=` override with nothing after the `=` (an unset shell variable, typically)
HUGE_STEPS = 1_000_000  # total_steps when verl's run length is given in epochs only: trainer.total_epochs decides


@dataclass
class Conversion:
    recipe: dict = field(default_factory=dict)
    mapped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    differs: list[str] = field(default_factory=list)  # converted, but megarl trains it differently from verl: why
    notes: list[str] = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # megarl key -> the verl key that set it
    label: str = ""  # "(verl default) " while verl's trainer defaults are applied
    trainer: str = "ppo_trainer"  # verl's base trainer config the command names
    later: dict = field(default_factory=dict)  # verl keys decided once every other key is known
    layer: int = 1  # 0 verl's defaults, 1 config files, 2 command-line overrides: a later layer's key wins
    layers: dict = field(default_factory=dict)  # megarl key -> the layer that set it

    def set(self, verl_key: str, value: Any, key: str, new: Any = None, why: str = "") -> None:
        new = value if new is None else new
        if key in self.sources and self.layers.get(key, 0) < self.layer:  # a command-line key over a config file's
            old = self.sources.pop(key)
            self.mapped = [m for m in self.mapped if f" -> {key} = " not in m]
            self.dropped.append(f"{old} = {_get(self.recipe, key)!r}: overridden by {verl_key} (the command line)")
        if key in self.sources and _get(self.recipe, key) != new:
            self.refuse(verl_key, value, f"megarl has one {key} (already {_get(self.recipe, key)!r} from "
                                         f"{self.sources[key]}); set it once")
            return
        _put(self.recipe, key, new)
        self.sources.setdefault(key, verl_key)
        self.layers.setdefault(key, self.layer)
        self.mapped.append(f"{self.label}{verl_key} = {value!r} -> {key} = {new!r}" + (f" ({why})" if why else ""))

    def drop(self, verl_key: str, value: Any, why: str) -> None:
        self.dropped.append(f"{self.label}{verl_key} = {value!r}: {why}")

    def refuse(self, verl_key: str, value: Any, why: str) -> None:
        self.refused.append(f"{self.label}{verl_key} = {value!r}: {why}")

    def unset(self, key: str) -> None:
        """Take a megarl key out of the recipe again (validate refuses it): its mapped line goes too."""
        *parents, last = key.split(".")
        node = self.recipe
        for part in parents:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
        verl_key = self.sources.pop(key, None)
        self.mapped = [m for m in self.mapped if f" -> {key} = " not in m]
        _prune(self.recipe)
        return verl_key


def _prune(tree: dict) -> None:
    for k in list(tree):
        if isinstance(tree[k], dict):
            _prune(tree[k])
            if not tree[k]:
                del tree[k]


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
    """The key=value arguments of a shell command line (no variables): tokens after the command up to a pipe, `&&`
    or redirection. Scripts go through megarl.convert_verl.interpreter instead (variables, arrays, conditions)."""
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
    """A nested verl config -> {dotted key: leaf value} (lists stay values; Hydra's `_target_` class names go)."""
    flat = {}
    for key, value in tree.items():
        if key == "_target_":
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


BASE_TRAINERS = tuple(TRAINER_DEFAULTS)


@dataclass
class VerlInputs:
    """Everything read from the command line: the user's settings (config files, then overrides), the defaults of the
    verl trainer named, inputs that could not be read (refused by name) and notes."""

    settings: dict = field(default_factory=dict)
    trainer: str = "ppo_trainer"
    unresolved: list = field(default_factory=list)  # (key, text as written, why)
    notes: list = field(default_factory=list)
    config_path: Optional[str] = None
    config_name: Optional[str] = None
    script: Optional[Path] = None
    file_keys: frozenset = frozenset()  # keys of settings read from config files (overridable by the command line)

    @property
    def defaults(self) -> dict:
        return TRAINER_DEFAULTS[self.trainer]


def _base_trainer(name: str) -> str:
    """verl's base trainer a config name stands for: the Megatron one for any '*megatron*' name."""
    return "ppo_megatron_trainer" if "megatron" in name else "ppo_trainer"


def _find_config(name: str, dirs: Sequence[Path]) -> Optional[Path]:
    stem = name[:-5] if name.endswith(".yaml") else name
    for d in dirs:
        candidate = d / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    return None


def _load_config_file(path: Path, dirs: Sequence[Path], inputs: VerlInputs, depth: int = 0) -> dict:
    """A verl config file's settings, its Hydra `defaults` first (files beside it; verl's base trainers by name)."""
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a verl config must be a mapping")
    data.pop("hydra", None)  # Hydra's own search path: nothing to train
    settings: dict = {}
    for entry in data.pop("defaults", None) or []:
        if entry == "_self_":
            continue
        if isinstance(entry, str) and entry.removesuffix(".yaml") in BASE_TRAINERS:
            inputs.trainer = entry.removesuffix(".yaml")
            continue
        found = _find_config(entry, [path.parent, *dirs]) if isinstance(entry, str) and depth < 8 else None
        if found is not None:
            settings.update(_load_config_file(found, dirs, inputs, depth + 1))
        else:
            inputs.unresolved.append((f"defaults[{entry}]", f"{path.name}: defaults: {entry}", "a Hydra defaults "
                                      "entry the converter cannot find beside the config; its settings are not read: "
                                      "pass that file as an input"))
    settings.update(flatten(data))
    return settings


def _apply_config(inputs: VerlInputs, base_dir: Optional[Path]) -> dict:
    """The settings of --config-path/--config-name (or the script's): read when the file is found; verl's own trainer
    configs stand for their defaults table."""
    name = inputs.config_name
    if not name:
        return {}
    stem = name.removesuffix(".yaml")
    dirs = []
    if inputs.config_path:
        cp = Path(os.path.expanduser(inputs.config_path))
        dirs += [cp] if cp.is_absolute() else [Path.cwd() / cp] + ([base_dir / cp] if base_dir else [])
    if base_dir:
        dirs += [base_dir / "config", base_dir, base_dir.parent / "config"]
    found = _find_config(stem, dirs)
    if stem in BASE_TRAINERS and (found is None or found.parent.parts[-3:] == ("verl", "trainer", "config")):
        inputs.trainer = stem
        return {}
    if found is None:
        inputs.trainer = _base_trainer(stem)
        where = ", ".join(str(d) for d in dirs) or "any directory"
        inputs.unresolved.append(("--config-name", name, f"not found in {where}; its settings are not read (the "
                                  f"defaults of verl's {inputs.trainer} are used): give its directory with "
                                  "--config-path"))
        return {}
    inputs.trainer = _base_trainer(stem)  # unless its defaults name the trainer
    inputs.notes.append(f"read verl config {found}")
    return _load_config_file(found, dirs, inputs)


def gather(items: Sequence[str], environ: Optional[dict] = None, config_path: Optional[str] = None,
           config_name: Optional[str] = None) -> VerlInputs:
    """verl settings from YAML files, .sh scripts and key=value overrides, later ones winning."""
    inputs = VerlInputs(config_path=config_path, config_name=config_name)
    overrides: dict[str, Any] = {}
    yaml_settings: dict[str, Any] = {}
    base_dir = None
    env = dict(os.environ) if environ is None else environ
    for item in items:
        path = Path(item)
        if "=" not in item and path.suffix in (".yaml", ".yml") and path.is_file():
            yaml_settings.update(flatten(yaml.safe_load(path.read_text()) or {}))
        elif "=" not in item and path.is_file():
            read = read_script(path, env)
            inputs.script, base_dir = path, path.resolve().parent
            inputs.notes += read.notes
            inputs.config_path = config_path or read.config_path  # the converter's own flags win over the script's
            inputs.config_name = config_name or read.config_name
            if inputs.config_name is None and read.module and read.module.endswith("main_dapo"):
                inputs.config_name = "dapo_trainer"  # verl-recipe's DAPO entry point reads dapo_trainer.yaml
            for text, names, why in read.unresolved:
                key, sep, value = text.partition("=")
                inputs.unresolved.append((key.lstrip("+~"), value if sep else text, why))
            _read_overrides(read.overrides, overrides, inputs)
        elif "=" in item:
            _read_overrides([item], overrides, inputs)
        else:
            raise ValueError(f"{item!r} is neither a key=value override nor a YAML or shell file")
    from_files = {**_apply_config(inputs, base_dir), **yaml_settings}
    inputs.settings = {**from_files, **overrides}
    inputs.file_keys = frozenset(k for k in from_files if k not in overrides)
    unresolved_keys = {key for key, _, _ in inputs.unresolved}
    for key in unresolved_keys:  # an unresolved override stands in for any value of the same key from a file
        inputs.settings.pop(key, None)
    return inputs


def _read_overrides(items: Sequence[str], settings: dict, inputs: VerlInputs) -> None:
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            inputs.unresolved.append((item, item, "not a key=value override"))
            continue
        if key.startswith("~"):
            inputs.notes.append(f"{item}: Hydra deletions have no meaning for a megarl recipe (skipped)")
            continue
        if key.startswith("hydra."):
            inputs.notes.append(f"{item}: a setting of Hydra itself (skipped)")
            continue
        settings[key.lstrip("+")] = parse_value(text) if text.strip() else EMPTY


def read_inputs(items: Sequence[str], environ: Optional[dict] = None) -> tuple[dict[str, Any], list[str]]:
    """verl settings (the user's, without verl's defaults) from YAML files, .sh scripts and overrides; and notes."""
    inputs = gather(items, environ)
    return inputs.settings, inputs.notes


# ----------------------------------------------------------------------------------------------------------------------
# Rules, one per verl key or key family


def _optional(key: str) -> bool:
    """Whether megarl's field `key` accepts None (null)."""
    from megarl.config.loader import _model_fields
    from megarl.config.schema import MegarlConfig

    cls, parts = MegarlConfig, key.split(".")
    for part in parts[:-1]:
        cls = _model_fields(cls).get(part)
        if cls is None:
            return False
    info = cls.model_fields.get(parts[-1])
    return info is not None and not info.is_required() and (info.default is None or type(None) in
                                                            getattr(info.annotation, "__args__", ()))


def _to(key: str, fn: Optional[Callable[[Any], Any]] = None):
    """A rule mapping the verl value to `key` (through fn); null maps to null where megarl's key takes it, and
    otherwise leaves megarl's default (verl's null means 'unset')."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if value is None and not _optional(key):
            c.drop(verl_key, value, f"null (unset): megarl keeps its default for {key}")
            return
        c.set(verl_key, value, key, fn(value) if fn and value is not None else None)
    return rule


def _files(value: Any) -> list:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError("expected a file path or a list of them")


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
    return _to(key, lambda v: 0 if int(v) < 0 else int(v))


def _recompute(c: Conversion, verl_key: str, value: Any) -> None:
    if c.trainer == "ppo_megatron_trainer" and verl_key.endswith("enable_gradient_checkpointing"):
        # verl's Megatron workers recompute per override_transformer_config.recompute_*; this FSDP switch is unread
        c.drop(verl_key, value, "read by verl's FSDP workers only; its Megatron trainer recomputes per "
                                "override_transformer_config.recompute_granularity")
        return
    c.set(verl_key, value, "model.recompute", "full" if value else "none")


def _recompute_granularity(c: Conversion, verl_key: str, value: Any) -> None:
    if value in (None, "full", "selective"):
        c.set(verl_key, value, "model.recompute", value or "none")
    else:
        c.refuse(verl_key, value, "megarl recomputes 'full' layers or 'selective' (the attention core), or nothing")


def _recompute_detail(allowed: tuple, what: str):
    return _accept(allowed, f"megarl's {what}", f"megarl's full recomputation is uniform over 1-layer chunks and its "
                   "selective one recomputes the attention core; drop it")


def _steps_or_unset(key: str, why_unset: str):
    """verl's -1 / null mean 'derive it' (warm-up from a ratio, steps from epochs)."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value < 0):
            c.drop(verl_key, value, why_unset)
        else:
            c.set(verl_key, value, key)
    return rule


def _router_dtype(c: Conversion, verl_key: str, value: Any) -> None:
    if value in (None, "fp32", "fp64"):
        c.set(verl_key, value, "model.moe_router_dtype")
    else:
        c.refuse(verl_key, value, "megatron computes the router in fp32 or fp64 (or the model dtype: null)")


def _megatron_dtype(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("bfloat16", "float16", "float32"):
        c.set(verl_key, value, "model.dtype")
    else:
        c.refuse(verl_key, value, "megarl trains in float32, bfloat16 or float16 (model.dtype)")


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
    if not names:
        c.drop(verl_key, value, "no logger: megarl still prints a line per reported step")
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


def _lora_merge(c: Conversion, verl_key: str, value: Any) -> None:
    if value in (True, False, None):
        c.set(verl_key, value, "actor.lora.sync", "merged" if value else "adapter")
    else:
        c.refuse(verl_key, value, "true (merged weights into the engine) or false (adapters into vLLM's LoRA support)")


def _resume_mode(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("auto", "disable"):
        c.set(verl_key, value, "checkpoint.resume")
    else:  # resume_path: the path comes with trainer.resume_from_path
        c.drop(verl_key, value, "the checkpoint path comes from trainer.resume_from_path")


def _reward_manager(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("naive", "dapo", None):
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


# verl 0.9.1's policy losses whose policy term does not follow actor.loss_agg_mode (verl/trainer/ppo/core_algos.py;
# vanilla, gspo, cispo, gpg, clip_cov, kl_cov, dro, dppo_tv, dppo_kl and bypass_mode's losses pass the mode on to
# agg_loss): the megarl mode that computes what verl computes, and what verl does. megarl's losses all follow the mode,
# so the recipe names verl's aggregation. verl's entropy bonus and KL loss still follow loss_agg_mode.
VERL_FIXED_AGGREGATION = {
    "sapo": ("seq-mean-token-mean", "verl 0.9.1's sapo aggregates its policy loss seq-mean-token-mean whatever "
                                    "loss_agg_mode says"),
    "geo_mean": ("seq-mean-token-mean", "verl 0.9.1's geo_mean takes the mean over sequences of each sequence's "
                                        "loss, loss_agg_mode 'not used'"),
}
_GEO_MEAN_MICRO_BATCHES = (
    "verl 0.9.1 takes geo_mean's mean over each micro-batch's sequences and adds the micro-batches (unlike its other "
    "losses it ignores the mini-batch's size), so its gradient is about (micro-batches per mini-batch and rank) times "
    "the mean over the mini-batch's sequences, and with use_dynamic_bsz a sequence in a smaller micro-batch weighs "
    "more; megarl divides by the mini-batch's sequence count (the paper's mean; verl's too with one micro-batch per "
    "mini-batch and rank)")


def _active(value: Any, default: Any) -> bool:
    """A loss term's switch or coefficient that is on (a value validate will refuse counts as off here)."""
    value = default if value is None else value
    return value is not False and isinstance(value, (bool, int, float)) and value != 0


def _fixed_aggregation(c: Conversion) -> None:
    """Where verl's policy loss fixes its own aggregation, the recipe's loss_agg_mode says it (megarl's losses follow
    the mode); what megarl then aggregates differently from verl is listed in c.differs."""
    loss = _get(c.recipe, "actor.policy_loss")
    if loss not in VERL_FIXED_AGGREGATION:
        return
    mode, what = VERL_FIXED_AGGREGATION[loss]
    if loss == "geo_mean":
        c.differs.append(f"{AR}actor.policy_loss.loss_mode = 'geo_mean': {_GEO_MEAN_MICRO_BATCHES}")
    verl_mode = _get(c.recipe, "actor.loss_agg_mode", "token-mean")  # verl's default is megarl's
    if verl_mode == mode:
        return
    verl_key = c.unset("actor.loss_agg_mode")
    c.label = "" if verl_key else "(verl default) "
    c.set(verl_key or AR + "actor.loss_agg_mode", verl_mode, "actor.loss_agg_mode", mode,
          why=f"{what}; megarl's {loss} follows the mode, so the recipe names verl's")
    c.label = ""
    terms = [name for name, on in (
        ("KL loss", _active(_get(c.recipe, "actor.use_kl_loss"), False)
         and _active(_get(c.recipe, "actor.kl_loss_coef"), 0.001)),
        ("entropy bonus", _active(_get(c.recipe, "actor.entropy_coeff"), 0.0))) if on]
    if terms:
        both = " and ".join(terms)
        c.differs.append(f"{AR}actor.loss_agg_mode = {verl_mode!r}: verl aggregates the {both} with it and only "
                         f"{loss}'s policy term {mode}; megarl's one actor.loss_agg_mode serves all, so the {both} "
                         f"weigh each sequence equally here instead of as {verl_mode!r} does; for the same objective "
                         f"in both, set {AR}actor.loss_agg_mode={mode} in the verl run")


def _lr_schedule(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("constant", "cosine", "linear"):
        c.set(verl_key, value, verl_key.replace(AR, "").rsplit(".", 1)[0] + ".lr_decay_style")
    else:
        c.refuse(verl_key, value, "megarl schedules: constant, linear, cosine")


_OFFLOAD = "megarl trains with Megatron; its offload around rollout is the megatron keys (param_offload, " \
           "grad_offload, optimizer_offload -> actor/critic.offload.*, ref.offload); check the memory with `megarl plan`"
# verl's Megatron offload keys -> megarl's (the reference has parameters only)
_MEGATRON_OFFLOAD = {"param_offload": "params", "grad_offload": "grads", "optimizer_offload": "optimizer"}
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
    # LoRA: verl's keys under model (FSDP workers) and under actor.peft (Megatron workers) -> actor.lora
    AR + "model.lora_rank": _to("actor.lora.rank"),
    AR + "model.lora_alpha": _to("actor.lora.alpha"),
    AR + "model.target_modules": _to("actor.lora.target_modules"),
    AR + "actor.peft.lora_rank": _to("actor.lora.rank"),
    AR + "actor.peft.lora_alpha": _to("actor.lora.alpha"),
    AR + "actor.peft.target_modules": _to("actor.lora.target_modules"),
    AR + "actor.peft.peft_type": _accept(("lora", "LORA", None), "megarl's actor.lora is LoRA",
                                         "megarl implements LoRA adapters only (peft_type: lora)"),
    # verl's LoRA rollout: adapters into vLLM's LoRA support (TensorLoRARequest) unless model.lora.merge merges them
    AR + "model.lora.merge": _lora_merge,
    AR + "rollout.layered_summon": _no_effect("verl gathers FSDP-sharded weights layer by layer to save memory; megarl "
                                              "gathers only the adapters (actor.lora.sync=adapter) or merges each "
                                              "rank's own shards (merged), never the whole model"),
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
    "reward_model.enable": _to("reward.reward_model.enable"),
    "reward_model.model.path": _to("reward.reward_model.path"),
    "reward_model.micro_batch_size_per_gpu": _to("reward.reward_model.micro_batch_size_per_gpu"),
    "reward_model.max_length": _to("reward.reward_model.max_length"),
    "reward_model.reward_manager": _reward_manager,
    # algorithm
    "algorithm.rollout_correction.bypass_mode": _to("algorithm.rollout_correction.use_rollout_log_probs"),
    "algorithm.rollout_correction.rollout_is": _level("algorithm.rollout_correction.is_level", ("token", "sequence")),
    "algorithm.rollout_correction.rollout_is_threshold": _to("algorithm.rollout_correction.is_threshold", float),
    "algorithm.rollout_correction.rollout_rs": _level("algorithm.rollout_correction.rejection_level",
                                                      ("token", "sequence", "geometric", "seq_mean_k3")),
    "algorithm.rollout_correction.preset": _to("algorithm.rollout_correction.preset"),
    "algorithm.rollout_correction.rollout_rs_threshold": _rs_threshold,
    "algorithm.rollout_correction.rollout_rs_threshold_lower": _off_only(
        "unset: the lower bound is 1/threshold", "megarl's lower bound is 1/rollout_rs_threshold; drop it"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": _off_only(
        "off", "batch-normalised importance weights are not supported; drop it"),
    "algorithm.rollout_correction.rollout_token_veto_threshold": _off_only(
        "off", "a token veto is not supported; use rollout_rs=token with rollout_rs_threshold"),
    "algorithm.rollout_correction.loss_type": _to("algorithm.rollout_correction.loss_type"),
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
    "trainer.total_epochs": _to("trainer.total_epochs"),
    "trainer.total_training_steps": _steps_or_unset("trainer.total_steps", "unset: the run length comes from "
                                                    "trainer.total_epochs"),
    "data.trust_remote_code": _to("model.trust_remote_code"),
    "data.gen_batch_size": lambda c, k, v: c.later.__setitem__(k, v),
    AR + "hybrid_engine": _accept((True,), "megarl's engines always receive the actor's weights after each update",
                                  "megarl's rollout always uses the actor's latest weights; drop it"),
    AR + "nccl_timeout": _no_effect("a collective-communication timeout; megarl keeps torch.distributed's default"),
    AR + "model.use_fused_kernels": _no_effect("verl's fused log-prob/entropy kernel saves memory; the values are the "
                                               "same, and megarl computes log-probs from vocab-parallel logits itself"),
    AR + "model.override_config.model_config.max_position_embeddings": lambda c, k, v: c.refuse(
        k, v, "megarl reads the model's config.json as it is; raise max_position_embeddings there if you need to"),
    AR + "ref.log_prob_use_dynamic_bsz": _to("rollout.log_prob_use_dynamic_bsz"),
    AR + "ref.log_prob_max_token_len_per_gpu": _to("rollout.log_prob_max_token_len_per_gpu"),
    AR + "ref.strategy": _accept(("megatron",), "megarl's trainer is Megatron", "megarl computes the reference with "
                                 "Megatron whatever verl's strategy was; drop it"),
    "critic.strategy": _accept(("megatron",), "megarl's trainer is Megatron", "megarl trains the critic with "
                               "Megatron whatever verl's strategy was; drop it"),
    "reward_model.reward_kwargs.max_resp_len": lambda c, k, v: c.later.__setitem__(k, v),
    "reward.reward_kwargs.max_resp_len": lambda c, k, v: c.later.__setitem__(k, v),
    "reward.reward_manager.name": _reward_manager,
}
for _prefix in ("reward_model.reward_kwargs.overlong_buffer_cfg.", "reward.reward_kwargs.overlong_buffer_cfg."):
    RULES.update({_prefix + name: _to("reward.overlong_buffer." + name) for name in ("enable", "len",
                                                                                     "penalty_factor")})
    RULES[_prefix + "log"] = _no_effect("a logging switch of verl's DAPO reward manager; it changes no reward")
RULES["reward_model.overlong_buffer.log"] = RULES["reward_model.reward_kwargs.overlong_buffer_cfg.log"]
_MULTI_TURN = AR + "rollout.multi_turn."
RULES.update({_MULTI_TURN + name: _to("rollout.multi_turn." + name) for name in (
    "max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length",
    "tool_response_truncate_side", "tool_config_path", "format")})
RULES.update({
    _MULTI_TURN + "interaction_config_path": _off_only("unset", "simulated-user interactions are not supported by "
                                                       "megarl; drop it"),
    _MULTI_TURN + "use_inference_chat_template": _off_only("off", "megarl renders every turn with the training chat "
                                                           "template; drop it"),
    _MULTI_TURN + "tokenization_sanity_check_mode": _no_effect(
        "megarl builds the trajectory from the engine's own tokens; rollout.multi_turn.sanity_check counts drift"),
    _MULTI_TURN + "num_repeat_rollouts": _off_only("unset", "megarl samples rollout.n responses per prompt; drop it"),
})


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
    AR + "actor.policy_loss.": ("actor.policy_loss_options.", (
        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")),
    "algorithm.": ("algorithm.", (
        "adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty",
        "gdpo_reward_keys", "gdpo_reward_weights")),
    "algorithm.kl_ctrl.": ("algorithm.kl_ctrl.", (
        "type", "kl_coef", "target_kl", "horizon")),
    "algorithm.filter_groups.": ("algorithm.filter_groups.", (
        "enable", "metric", "max_num_gen_batches")),
    "trainer.": ("trainer.", (
        "val_before_train", "n_gpus_per_node", "nnodes", "device")),
}
RULES.update({verl + name: _to(megarl + name) for verl, (megarl, names) in _SAME_NAMES.items() for name in names})
RULES.update({AR + f"actor.{name}": _to(f"actor.policy_loss_options.{name}") for name in ("tau_pos", "tau_neg")})


_FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
            "gradient_accumulation_fusion", "persist_layer_norm", "moe_permute_fusion", "cross_entropy_loss_fusion")


def _transformer_override(name: str) -> Optional[Callable[[Conversion, str, Any], None]]:
    """verl's +override_transformer_config.* (megatron TransformerConfig fields)."""
    if name in _FUSIONS:
        return _no_effect("a kernel-fusion switch (the same math); megarl builds its layers with these fusions off")
    if name == "moe_grouped_gemm":
        return _no_effect("megarl uses grouped-GEMM experts whenever it uses Transformer Engine")
    if name in ("moe_token_dispatcher_type", "moe_enable_deepep", "moe_shared_expert_overlap"):
        return _no_effect("how tokens travel to their experts (communication, the same results); megarl uses "
                          "megatron's allgather dispatcher")
    if name in ("deallocate_pipeline_outputs", "attention_backend", "use_flash_attn"):
        return _no_effect("a memory/kernel choice with the same results; megarl leaves it to megatron")
    if name == "recompute_granularity":
        return _recompute_granularity
    if name == "recompute_method":
        return _recompute_detail((None, "uniform"), "full recomputation is uniform")
    if name == "recompute_num_layers":
        return _recompute_detail((None, 1), "full recomputation takes 1-layer chunks")
    if name == "recompute_modules":
        return _recompute_detail((None, ["core_attn"]), "selective recomputation is the attention core")
    if name == "moe_router_dtype":
        return _router_dtype
    return None


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
        if name == "lr_decay_style":
            return _lr_schedule
        if name == "lr_warmup_steps":
            return _steps_or_unset(target + name, "verl's -1: the warm-up comes from lr_warmup_steps_ratio")
        if name in ("lr_decay_steps", "use_checkpoint_opt_param_scheduler", "lr_wsd_decay_steps"):
            return _off_only("unset: the schedule spans the run", "megarl's schedule decays over the whole run; "
                             "drop it")
        if name in ("weight_decay_incr_style", "lr_wsd_decay_style"):
            return _accept(("constant", "exponential") if "wsd" in name else ("constant",), "megarl's default",
                           "megarl keeps the weight decay constant; drop it")
        if name == "optimizer":
            return _accept(("adam", "adamw", "AdamW"), "megarl's optimizer is Adam with decoupled weight decay",
                           "megarl's optimizer is Adam (AdamW); drop it")
        if name in ("lr_warmup_steps_ratio", "min_lr_ratio", "total_training_steps", "lr_warmup_init"):
            return _off_only("unset", f"give the warm-up in steps ({target}lr_warmup_steps) and the final rate "
                                      f"as a value ({target}min_lr)")
    if role in ("actor", "ref", "critic") and rest.startswith("megatron."):
        name = rest.removeprefix("megatron.")
        if name.removeprefix("override_transformer_config.") in _PARALLEL[-2:]:  # verl's uneven-stage settings
            name = name.removeprefix("override_transformer_config.")
        if name in _PARALLEL:
            return _to(f"parallelism.{name}")
        if name == "router_replay.mode" and role == "actor":  # verl's "disabled" is megarl's "none"
            return _to("actor.router_replay.mode", lambda v: "none" if v in ("disabled", "none") else v)
        if name.startswith("router_replay."):  # verl's record/replay file paths and the ref's own copy of the mode
            return _no_effect("megarl's routing replay is actor.router_replay.mode alone; routes stay in memory")
        if name in _MEGATRON_OFFLOAD and role == "ref":
            return _to("ref.offload") if name == "param_offload" else _no_effect("the reference has no gradients "
                                                                                  "or optimizer states")
        if name in _MEGATRON_OFFLOAD:
            return _to(f"{role}.offload.{_MEGATRON_OFFLOAD[name]}")
        if "offload" in name:
            return _off_only("no offload", _OFFLOAD)
        if name == "seed":
            return _no_effect("megarl seeds everything from trainer.seed")
        if name in ("use_mbridge", "vanilla_mbridge"):
            return _no_effect("megarl converts Hugging Face weights to Megatron and back itself (megarl.bridge)")
        if name in ("use_remove_padding",):
            return _no_effect(_NO_PADDING_SWITCH)
        if name in ("forward_only", "dist_checkpointing_prefix"):
            return _no_effect("internal to verl's Megatron workers")
        if name in ("use_dist_checkpointing", "dist_checkpointing_path"):
            return _off_only("off: the initial weights come from the Hugging Face model", "megarl loads the initial "
                             "weights from the Hugging Face directory in model.path; drop it and point model.path at "
                             "the Hugging Face model")
        if name == "dtype":
            return _megatron_dtype
        if name.startswith("override_transformer_config."):
            return _transformer_override(name.removeprefix("override_transformer_config."))
    if ".fsdp_config." in f".{rest}":
        return _off_only("no offload (an FSDP setting)", _OFFLOAD) if "offload" in key else _no_effect(_FSDP)
    if short == "rollout.enable_rollout_routing_replay":  # verl's engine half of R3: megarl's mode R3 asks for it
        return _no_effect("megarl derives it from actor.router_replay.mode (R3 is the mode that needs the "
                          "engine's routes)")
    if short.startswith("rollout.val_kwargs."):
        return _to("rollout.val_kwargs." + short.removeprefix("rollout.val_kwargs."))
    if rest == "use_torch_compile" or short == "actor.use_torch_compile":
        return _no_effect("torch.compile of verl's own helpers: speed only")
    if short.startswith("actor.checkpoint.") or short.startswith("critic.checkpoint."):
        return _no_effect("megarl checkpoints the model, optimizer and scheduler together")
    return None


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
    rule = RULES.get(key) or _family_rule(key)
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
    reward_path = settings.pop("custom_reward_function.path", None)
    reward_name = settings.pop("custom_reward_function.name", None) or "compute_score"
    if reward_path and reward_path != EMPTY:  # verl's file + function name is megarl's "file.py:function"
        c.set("custom_reward_function.path", reward_path, "reward.reward_fn", f"{reward_path}:{reward_name}")
    global_micro: dict = {}
    c.label, c.layer = "(verl default) ", 0
    for key, value in defaults.items():
        if key not in settings:  # an unresolved override leaves verl's default (and is refused by name above)
            _apply(c, key, value, global_micro)
    c.label = ""
    # config-file keys first, so the command line wins where two verl keys set one megarl key; and
    # filter_overlong_prompts decides data.truncation whatever the order on the command line
    order = sorted(settings, key=lambda k: (k not in from_files, k != "data.filter_overlong_prompts"))
    for key in order:
        c.layer = 1 if key in from_files else 2
        _apply(c, key, settings[key], global_micro)
    c.layer = 2
    nodes, gpus = _get(c.recipe, "trainer.nnodes", 1), _get(c.recipe, "trainer.n_gpus_per_node", 8)
    world = nodes * gpus if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (nodes, gpus)) else 8
    for key, value in global_micro.items():
        try:
            c.set(key, value, _MICRO_GLOBAL[key], max(1, math.ceil(int(value) / world)))
        except (TypeError, ValueError) as exc:
            c.drop(key, value, "unset") if value is None else c.refuse(key, value, f"not a usable value ({exc})")
    _derived(c, settings, defaults)
    _fixed_aggregation(c)
    if _get(c.recipe, "model.path") is None:
        _put(c.recipe, "model.path", "FILL_IN/hf_model_dir")
        c.notes.append("model.path: the verl config names no model; fill in a local Hugging Face model directory")
    if check:
        validate_against_megarl(c)
    if _get(c.recipe, "trainer.total_epochs") is not None and _get(c.recipe, "trainer.total_steps") is None:
        c.label = "(verl default) "
        c.set("trainer.total_training_steps", None, "trainer.total_steps", HUGE_STEPS)
        c.label = ""
        c.notes.append(f"trainer.total_steps = {HUGE_STEPS}: verl's run length is trainer.total_epochs (no "
                       "trainer.total_training_steps); megarl stops at whichever ends first")
    _placeholder_notes(c)
    return c


def _derived(c: Conversion, settings: dict, defaults: dict) -> None:
    """Settings verl derives from others: sequence parallelism off at TP 1, the log-prob token budgets following the
    actor's, DAPO's reward length and generation batch."""
    if _get(c.recipe, "parallelism.sequence_parallel") and _get(c.recipe, "parallelism.tensor_model_parallel_size",
                                                                1) == 1:
        verl_key = c.unset("parallelism.sequence_parallel")
        c.drop(verl_key, True, "verl turns sequence parallelism off at tensor_model_parallel_size 1 (so does megarl)")
    for actor_key, megarl_key in (("actor.use_dynamic_bsz", "rollout.log_prob_use_dynamic_bsz"),
                                  ("actor.ppo_max_token_len_per_gpu", "rollout.log_prob_max_token_len_per_gpu")):
        value = _get(c.recipe, actor_key)
        if value is not None and _get(c.recipe, megarl_key) is None:  # verl: ${oc.select:actor_rollout_ref.actor...}
            c.label = "(verl default) "
            c.set(f"{AR}rollout.{megarl_key.rsplit('.', 1)[1]}", f"as {AR}{actor_key}", megarl_key, value)
            c.label = ""
    rank = _get(c.recipe, "actor.lora.rank")
    if isinstance(rank, int) and rank > 0 and _get(c.recipe, "actor.lora.sync") is None:
        # verl's LoRA rollout loads the adapters into vLLM (model.lora.merge: false) unless told to merge
        c.label = "(verl default) "
        c.set(f"{AR}model.lora.merge", False, "actor.lora.sync", "adapter")
        c.label = ""
    for key, value in c.later.items():
        if key.endswith("max_resp_len"):
            length = _get(c.recipe, "rollout.response_length", 512)
            if value is None or value == length:
                c.drop(key, value, "megarl's overlong buffer ends at rollout.response_length (the same length)")
            else:
                c.refuse(key, value, f"megarl's overlong penalty counts up to rollout.response_length = {length}; set "
                                     "max_resp_len to data.max_response_length")
        elif key == "data.gen_batch_size":
            train = _get(c.recipe, "data.train_batch_size", 8)
            if value is None or value == train:
                c.drop(key, value, "generation rounds of data.train_batch_size prompts (megarl's default)")
            elif isinstance(value, int) and value > train:
                c.set(key, value, "rollout.over_sample_rate", (value - train) / train)
            else:
                c.refuse(key, value, "megarl generates at least data.train_batch_size prompts per round; drop it")


def validate_against_megarl(c: Conversion) -> None:
    """Run `megarl validate`'s rules on the recipe; refuse each verl key whose megarl key they reject, with validate's
    own message, and take it out of the recipe. Problems of settings no verl key gave are refused as the recipe's."""
    from megarl.config import ConfigError, load_config
    from megarl.config.paths import PathIssue

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
            value = _get(c.recipe, owner)
            # every verl key that set this megarl key (two can agree on one value) is refused, none lost
            givers = [m.split(" = ")[0].removeprefix("(verl default) ") for m in c.mapped if f" -> {owner} = " in m]
            verl_key = c.unset(owner)
            for giver in dict.fromkeys([verl_key] + [g for g in givers if g != verl_key]):
                c.refused.append(f"{giver} = {value!r} -> {owner}: megarl validate refuses it: {text}")
            progress = True
        if not progress:
            return


def _placeholder_notes(c: Conversion) -> None:
    """Paths that must exist where megarl runs: hub ids and missing files are flagged for the user to fill in."""
    for key in ("model.path", "critic.model_path", "model.tokenizer_path"):
        value = _get(c.recipe, key)
        if value and value != "FILL_IN/hf_model_dir" and not Path(os.path.expanduser(value)).exists():
            c.notes.append(f"{key} = {value!r}: not a directory here; megarl reads a local Hugging Face model "
                           "directory: download it (e.g. `huggingface-cli download NAME --local-dir DIR`) and put "
                           "DIR here" + (" (or, to check the layout before downloading, set model.config_path to the "
                                         "model's config.json)" if key == "model.path" else ""))
    if _get(c.recipe, "trainer.total_steps") is None:
        c.notes.append("trainer.total_steps: not given (verl counts epochs); megarl runs its default of 10 steps "
                       "unless you set it")
    for key in ("data.train_files", "data.val_files"):
        for f in _get(c.recipe, key) or []:
            if not Path(os.path.expanduser(f)).exists():
                c.notes.append(f"{key}: {f!r} is not a file here; point it at the parquet/jsonl file")


def to_recipe_text(c: Conversion, sources: Sequence[str]) -> str:
    head = ["# A megarl recipe converted from verl by `megarl convert-verl` from:"]
    head += [f"#   {s}" for s in sources[:8]] + (["#   ..."] if len(sources) > 8 else [])
    head += [f"# FILL IN: {n}" for n in c.notes]
    head += [f"# REFUSED (not in this recipe): {r}" for r in c.refused]
    head += [f"# DIFFERS FROM VERL: {d}" for d in c.differs]
    return "\n".join(head) + "\n" + yaml.safe_dump(c.recipe, sort_keys=False, default_flow_style=False)


def report_lines(c: Conversion) -> list[str]:
    lines = [f"mapped ({len(c.mapped)}):"] + [f"  {m}" for m in c.mapped]
    if c.dropped:
        lines += [f"dropped, no effect in megarl ({len(c.dropped)}):"] + [f"  {d}" for d in c.dropped]
    if c.refused:
        lines += [f"REFUSED, not converted ({len(c.refused)}):"] + [f"  {r}" for r in c.refused]
    if c.differs:
        lines += [f"DIFFERS, converted but trained differently from verl ({len(c.differs)}):"]
        lines += [f"  {d}" for d in c.differs]
    if c.notes:
        lines += ["fill in before training:"] + [f"  {n}" for n in c.notes]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                        help="verl config YAML, a shell script running verl, and/or overrides such as "
                        "actor_rollout_ref.rollout.n=8 (later ones win)")
    parser.add_argument("--out", "-o", default=None, help="write the recipe here instead of stdout")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any key was refused or the recipe "
                        "trains something different from verl (the DIFFERS lines)")
    parser.add_argument("--config-path", "-cp", default=None, help="verl's --config-path: the directory of the "
                        "--config-name file (a script's own flags are read from the script)")
    parser.add_argument("--config-name", "-cn", default=None, help="verl's --config-name: a config file whose "
                        "settings (and Hydra defaults) are read under the overrides; verl's ppo_trainer / "
                        "ppo_megatron_trainer select that trainer's defaults")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a shell variable for the script (as if exported before running it); repeatable")


def run(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"megarl convert-verl: --env {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 1
        environ[name] = value
    try:
        inputs = gather(args.inputs, environ, args.config_path, args.config_name)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        print(f"megarl convert-verl: {exc}", file=sys.stderr)
        return 1
    c = convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer, from_files=inputs.file_keys)
    c.notes = inputs.notes + c.notes
    text = to_recipe_text(c, args.inputs)
    print(f"verl trainer: {inputs.trainer} (its defaults that differ from megarl's apply under the settings given)",
          file=sys.stderr)
    for line in report_lines(c):
        print(line, file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
        print(f"recipe: {args.out} (check it with `megarl validate {args.out}`)", file=sys.stderr)
    else:
        print(text, end="")
    return 1 if (args.strict and (c.refused or c.differs)) else 0
