"""The record of one conversion: the megarl recipe being built, and for every verl key the line that says what became
of it (mapped, dropped with the reason, refused with what to do, or converted but trained differently), with the
recipe text and the report printed from it."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import yaml

VERL_DEFAULT = "(verl default) "  # the label of a line set by verl's trainer defaults, not by the user


@dataclass
class Conversion:
    recipe: dict = field(default_factory=dict)
    mapped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    differs: list[str] = field(default_factory=list)  # converted, but megarl trains it differently from verl: why
    notes: list[str] = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # megarl key -> the verl key that set it
    label: str = ""  # VERL_DEFAULT while verl's trainer defaults are applied
    trainer: str = "ppo_trainer"  # verl's base trainer config the command names
    later: dict = field(default_factory=dict)  # verl keys decided once every other key is known
    layer: int = 1  # 0 verl's defaults, 1 config files, 2 command-line overrides: a later layer's key wins
    layers: dict = field(default_factory=dict)  # megarl key -> the layer that set it

    def set(self, verl_key: str, value: Any, key: str, new: Any = None, why: str = "") -> None:
        new = value if new is None else new
        if key in self.sources and self.layers.get(key, 0) < self.layer:  # a command-line key over a config file's
            old = self.sources.pop(key)
            self._forget_mapped(key)
            self.dropped.append(f"{old} = {get_key(self.recipe, key)!r}: overridden by {verl_key} (the command line)")
        if key in self.sources and get_key(self.recipe, key) != new:
            self.refuse(verl_key, value, f"megarl has one {key} (already {get_key(self.recipe, key)!r} from "
                                         f"{self.sources[key]}); set it once")
            return
        put_key(self.recipe, key, new)
        self.sources.setdefault(key, verl_key)
        self.layers.setdefault(key, self.layer)
        self.mapped.append(f"{self.label}{verl_key} = {value!r} -> {key} = {new!r}" + (f" ({why})" if why else ""))

    def drop(self, verl_key: str, value: Any, why: str) -> None:
        self.dropped.append(f"{self.label}{verl_key} = {value!r}: {why}")

    def refuse(self, verl_key: str, value: Any, why: str) -> None:
        self.refused.append(f"{self.label}{verl_key} = {value!r}: {why}")

    def unset(self, key: str) -> Optional[str]:
        """Take a megarl key out of the recipe again (validate refuses it): its mapped line goes too. The verl key
        that had set it, if any."""
        *parents, last = key.split(".")
        node = self.recipe
        for part in parents:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
        verl_key = self.sources.pop(key, None)
        self._forget_mapped(key)
        _prune(self.recipe)
        return verl_key

    def givers(self, key: str) -> list[str]:
        """The verl keys of the mapped lines that set megarl's `key` (two can agree on one value)."""
        return [m.split(" = ")[0].removeprefix(VERL_DEFAULT) for m in self.mapped if _sets(m, key)]

    def _forget_mapped(self, key: str) -> None:
        self.mapped = [m for m in self.mapped if not _sets(m, key)]

    @contextmanager
    def verl_default(self, on: bool = True):
        """Lines written inside are labelled as set by verl's defaults (when `on`)."""
        self.label = VERL_DEFAULT if on else ""
        try:
            yield
        finally:
            self.label = ""


def _sets(line: str, key: str) -> bool:
    return f" -> {key} = " in line


def _prune(tree: dict) -> None:
    for k in list(tree):
        if isinstance(tree[k], dict):
            _prune(tree[k])
            if not tree[k]:
                del tree[k]


def put_key(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def get_key(tree: dict, key: str, default: Any = None) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


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
