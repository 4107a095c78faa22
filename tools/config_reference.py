"""The configuration reference, generated from the code: every recipe key of megarl's schema (megarl.config.schema)
with its type, default, allowed values and description, and the verl keys that `megarl convert-verl` maps to it (read
from convert-verl's own rules table by applying each rule, so the two cannot drift apart).

    python tools/config_reference.py            # writes docs/reference/configuration.md
    python tools/config_reference.py --check    # exit 1 when the committed file differs from a fresh generation

tests/unit/test_config_reference.py runs the check.
"""
from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "reference" / "configuration.md"

HEADER = """# Configuration reference

Every key a recipe can set, generated from the schema (`megarl/config/schema.py`) by `python tools/config_reference.py`
(a test fails when this file and a fresh generation differ). "verl" lists the verl keys `megarl convert-verl` maps to
the key (`actor_rollout_ref.` shortened to `arr.`); a key without one has no verl counterpart or is set by a rule
with its own logic (see `megarl convert-verl --help`). Recipes set keys in YAML (`rollout: {n: 8}`) or on the command
line (`rollout.n=8`); `megarl validate RECIPE` checks the rules between keys and prints the derived values.
"""


def _nested_model(annotation: Any):
    """The BaseModel class inside an annotation (X, Optional[X]), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _type_text(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else _type_text(a) for a in args)
    if origin in (list, tuple, dict, set):
        inner = ", ".join(_type_text(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _bounds(field) -> str:
    parts = []
    for m in field.metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(m, name, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _default_text(field) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return ""
        return "" if isinstance(value, BaseModel) else repr(value)
    return "" if field.default is PydanticUndefined else repr(field.default)


def schema_rows(model: type[BaseModel], prefix: str = "") -> list[dict]:
    """One row per key in declaration order, a section's own keys before its subsections: {key, section, type,
    default, bounds, description}."""
    rows, sections = [], []
    for name, field in model.model_fields.items():
        key = prefix + name
        nested = _nested_model(field.annotation)
        if nested is not None:
            sections.append([{"key": key, "section": True, "description": field.description or ""},
                             *schema_rows(nested, key + ".")])
            continue
        rows.append({"key": key, "section": False, "type": _type_text(field.annotation),
                     "default": _default_text(field), "bounds": _bounds(field),
                     "description": " ".join((field.description or "").split())})
    return rows + [row for section in sections for row in section]


_PROBES = (1, 2, 0.5, True, False, "auto", "x", [1], {"a": 1}, None)


def verl_map() -> dict:
    """{megarl key: sorted verl keys}: each verl key of convert-verl's rules (its own and its families') applied to
    probe values; every megarl key a rule sets for some probe counts."""
    from megarl.convert_verl import rules
    from megarl.convert_verl.record import Conversion

    keys = set(rules.RULES)
    for role, prefix in (("actor", rules.AR + "actor."), ("critic", "critic."), ("ref", rules.AR + "ref.")):
        if role != "ref":
            keys |= {f"{prefix}optim.{k}" for k in (*rules._OPTIM, "lr_warmup_steps", "lr_warmup_steps_ratio",
                                                    "total_training_steps", "lr_decay_style", "warmup_style")}
        keys |= {f"{prefix}megatron.{k}" for k in (*rules._PARALLEL, *rules._MEGATRON_OFFLOAD)}
    out: dict = {}
    for verl_key in sorted(keys):
        rule = rules.rule_for(verl_key)
        if rule is None:
            continue
        for probe in _PROBES:
            conv = Conversion()
            try:
                rule(conv, verl_key, probe)
            except Exception:  # noqa: BLE001 - a probe the rule does not take says nothing about its target
                continue
            for megarl_key in conv.sources:
                out.setdefault(megarl_key, set()).add(verl_key.replace(rules.AR, "arr."))
    return {k: sorted(v) for k, v in out.items()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    from megarl.config.schema import MegarlConfig

    verl = verl_map()
    lines = [HEADER]
    for row in schema_rows(MegarlConfig):
        if row["section"]:
            depth = row["key"].count(".")
            lines += ["", f"{'#' * min(2 + depth, 4)} `{row['key']}`", "", _cell(row["description"]), "",
                      "| key | type | default | allowed | description | verl |", "|---|---|---|---|---|---|"]
            continue
        names = ", ".join(f"`{k}`" for k in verl.get(row["key"], []))
        lines.append(f"| `{row['key']}` | {row['type']} | {_cell(row['default'])} | {row['bounds']} | "
                     f"{_cell(row['description'])} | {names} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is not what the schema generates: run python tools/config_reference.py")
            return 1
        print(f"{OUT.relative_to(ROOT)} is fresh")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
