"""Gathering verl's inputs: YAML configs, launch scripts (read by megarl.convert_verl.interpreter) and key=value
overrides -> the user's settings as flat verl keys, the verl trainer they build on, and what could not be read.

Config files named by --config-path/--config-name are read with the part of Hydra's defaults list verl's configs use: a
string entry is a file beside the config (read first), verl's base trainers stand for their defaults table
(megarl.convert_verl.verl_behaviour), and the config's own keys win over its defaults wherever `_self_` stands (as with
`_self_` last, Hydra's default). Entries of another form (config groups, `override`, package paths) are not read: each
is refused by name. Later inputs win over earlier ones, and command-line overrides win over config files.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from megarl.config.loader import parse_value as override_value
from megarl.convert_verl.interpreter import ScriptRead, read_script
from megarl.convert_verl.verl_behaviour import BASE_TRAINERS, base_trainer

EMPTY = ""  # a `key=` override with nothing after the `=` (an unset shell variable, typically)
_MAX_DEFAULTS_DEPTH = 8  # config files including each other deeper than this are not read (a cycle, most likely)


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


@dataclass
class VerlInputs:
    """Everything read from the command line: the user's settings (config files, then overrides), the verl trainer
    named, inputs that could not be read (refused by name) and notes."""

    settings: dict = field(default_factory=dict)
    trainer: str = "ppo_trainer"
    unresolved: list = field(default_factory=list)  # (key, text as written, why)
    notes: list = field(default_factory=list)
    config_path: Optional[str] = None
    config_name: Optional[str] = None
    script: Optional[Path] = None
    file_keys: frozenset = frozenset()  # keys of settings read from config files (overridable by the command line)


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
        settings.update(_defaults_entry(entry, path, dirs, inputs, depth))
    settings.update(flatten(data))
    return settings


def _defaults_entry(entry: Any, path: Path, dirs: Sequence[Path], inputs: VerlInputs, depth: int) -> dict:
    """The settings one entry of a config's Hydra defaults list contributes (see the module docstring)."""
    if entry == "_self_":
        return {}
    if isinstance(entry, str) and entry.removesuffix(".yaml") in BASE_TRAINERS:
        inputs.trainer = entry.removesuffix(".yaml")
        return {}
    readable = isinstance(entry, str) and depth < _MAX_DEFAULTS_DEPTH
    found = _find_config(entry, [path.parent, *dirs]) if readable else None
    if found is not None:
        return _load_config_file(found, dirs, inputs, depth + 1)
    inputs.unresolved.append((f"defaults[{entry}]", f"{path.name}: defaults: {entry}", "a Hydra defaults entry the "
                              "converter cannot find beside the config; its settings are not read: pass that file "
                              "as an input"))
    return {}


def _config_dirs(config_path: Optional[str], base_dir: Optional[Path]) -> list[Path]:
    """Where --config-name is looked for: --config-path (from here, or from the script's directory), then the
    script's config/, its own directory and ../config."""
    dirs = []
    if config_path:
        cp = Path(os.path.expanduser(config_path))
        dirs += [cp] if cp.is_absolute() else [Path.cwd() / cp] + ([base_dir / cp] if base_dir else [])
    if base_dir:
        dirs += [base_dir / "config", base_dir, base_dir.parent / "config"]
    return dirs


def _apply_config(inputs: VerlInputs, base_dir: Optional[Path]) -> dict:
    """The settings of --config-path/--config-name (or the script's): read when the file is found; verl's own trainer
    configs stand for their defaults table."""
    name = inputs.config_name
    if not name:
        return {}
    stem = name.removesuffix(".yaml")
    dirs = _config_dirs(inputs.config_path, base_dir)
    found = _find_config(stem, dirs)
    if stem in BASE_TRAINERS and (found is None or found.parent.parts[-3:] == ("verl", "trainer", "config")):
        inputs.trainer = stem
        return {}
    inputs.trainer = base_trainer(stem)  # unless its defaults name the trainer
    if found is None:
        where = ", ".join(str(d) for d in dirs) or "any directory"
        inputs.unresolved.append(("--config-name", name, f"not found in {where}; its settings are not read (the "
                                  f"defaults of verl's {inputs.trainer} are used): give its directory with "
                                  "--config-path"))
        return {}
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
            base_dir = path.resolve().parent
            _take_script(inputs, path, read, config_path, config_name)
            _read_overrides(read.overrides, overrides, inputs)
        elif "=" in item:
            _read_overrides([item], overrides, inputs)
        else:
            raise ValueError(f"{item!r} is neither a key=value override nor a YAML or shell file")
    from_files = {**_apply_config(inputs, base_dir), **yaml_settings}
    inputs.settings = {**from_files, **overrides}
    inputs.file_keys = frozenset(k for k in from_files if k not in overrides)
    for key in {key for key, _, _ in inputs.unresolved}:  # an unresolved override stands in for a file's value
        inputs.settings.pop(key, None)
    return inputs


def _take_script(inputs: VerlInputs, path: Path, read: ScriptRead, config_path: Optional[str],
                 config_name: Optional[str]) -> None:
    """A launch script's notes, config flags and unresolved overrides into `inputs` (its overrides are read apart)."""
    inputs.script = path
    inputs.notes += read.notes
    inputs.config_path = config_path or read.config_path  # the converter's own flags win over the script's
    inputs.config_name = config_name or read.config_name
    if inputs.config_name is None and read.module and read.module.endswith("main_dapo"):
        inputs.config_name = "dapo_trainer"  # verl-recipe's DAPO entry point reads dapo_trainer.yaml
    for text, names, why in read.unresolved:
        key, sep, value = text.partition("=")
        inputs.unresolved.append((key.lstrip("+~"), value if sep else text, why))


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
