"""The configuration reference, generated from the code: every recipe key of megarl's schema (megarl.config.schema)
with its type, default (read from a freshly built MegarlConfig()), allowed values and description, the verl keys that
`megarl convert-verl` maps to it (read from the targets convert-verl's own rules declare, so the two cannot drift
apart), and the derived values `megarl validate` prints.

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "reference" / "configuration.md"

HEADER = """# Configuration reference

Every key a recipe can set, generated from the schema (`megarl/config/schema.py`) by `python tools/config_reference.py`
(a test fails when this file and a fresh generation differ). "default" is the value in a config built with no
settings (`MegarlConfig()`): a section can give its keys other defaults than the same keys elsewhere (critic.optim.lr
is {critic_lr}, actor.optim.lr {actor_lr}); a section that is off by default (`data.synthetic`,
`model.create_tiny`: null) shows the defaults its keys take once the section is given. "verl" lists the verl keys `megarl convert-verl` maps to
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


def default_value(cfg: BaseModel, key: str) -> Any:
    """The value of `key` in a config built with no settings (its resolved default: a section's default_factory can
    override the nested class's own field default, as critic.optim.lr's does). A key under a section whose default is
    None reads that section's class defaults."""
    node: Any = cfg
    for part in key.split("."):
        if node is None:
            return None
        value = getattr(node, part)
        if value is None and part != key.rsplit(".", 1)[-1]:
            field = type(node).model_fields[part]
            nested = _nested_model(field.annotation)
            value = nested() if nested is not None else None
        node = value
    return node


def _default_text(cfg: BaseModel, key: str, field) -> str:
    if field.is_required():
        return ""
    value = default_value(cfg, key)
    return "" if isinstance(value, BaseModel) else repr(value)


def schema_rows(model: type[BaseModel], prefix: str = "", cfg: BaseModel | None = None) -> list[dict]:
    """One row per key in declaration order, a section's own keys before its subsections: {key, section, type,
    default, bounds, description}; defaults are read from `cfg` (default: a freshly built MegarlConfig())."""
    if cfg is None:
        from megarl.config.schema import MegarlConfig

        cfg = MegarlConfig()
    rows, sections = [], []
    for name, field in model.model_fields.items():
        key = prefix + name
        nested = _nested_model(field.annotation)
        if nested is not None:
            sections.append([{"key": key, "section": True, "description": field.description or ""},
                             *schema_rows(nested, key + ".", cfg)])
            continue
        rows.append({"key": key, "section": False, "type": _type_text(field.annotation),
                     "default": _default_text(cfg, key, field), "bounds": _bounds(field),
                     "description": " ".join((field.description or "").split())})
    return rows + [row for section in sections for row in section]


def verl_map() -> dict:
    """{megarl key: sorted verl keys}: every verl key convert-verl's rules table knows (megarl.convert_verl.rules
    .known_keys) listed under each megarl key its rule declares it writes (`rule.targets`), plus the keys converted
    outside the table."""
    from megarl.convert_verl import rules
    from megarl.convert_verl.convert import MAPPED_OUTSIDE_RULES

    out: dict = {}
    for verl_key in rules.known_keys():
        for megarl_key in rules.rule_for(verl_key).targets:
            out.setdefault(megarl_key, set()).add(verl_key.replace(rules.AR, "arr."))
    for verl_key, megarl_key in MAPPED_OUTSIDE_RULES.items():
        out.setdefault(megarl_key, set()).add(verl_key.replace(rules.AR, "arr."))
    return {k: sorted(v) for k, v in out.items()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def derived_section() -> list[str]:
    """The values `megarl validate` prints under `derived:` (megarl.config.resolve.derived), each with what it is."""
    from megarl.config.resolve import DERIVED_MEANINGS

    lines = ["", "## Derived values", "", "Computed from the keys above, never set: `megarl validate RECIPE` prints "
             "them under `derived:` after the resolved config, and every run writes them to "
             "`RUN_DIR/config.resolved.yaml`.", "",
             "| value | what it is |", "|---|---|"]
    return lines + [f"| `{key}` | {_cell(text)} |" for key, text in DERIVED_MEANINGS.items()]


def render() -> str:
    from megarl.config.schema import MegarlConfig

    verl = verl_map()
    cfg = MegarlConfig()
    lines = [HEADER.replace("{critic_lr}", repr(cfg.critic.optim.lr)).replace("{actor_lr}", repr(cfg.actor.optim.lr))]
    for row in schema_rows(MegarlConfig, cfg=cfg):
        if row["section"]:
            depth = row["key"].count(".")
            lines += ["", f"{'#' * min(2 + depth, 4)} `{row['key']}`", "", _cell(row["description"]), "",
                      "| key | type | default | allowed | description | verl |", "|---|---|---|---|---|---|"]
            continue
        names = ", ".join(f"`{k}`" for k in verl.get(row["key"], []))
        lines.append(f"| `{row['key']}` | {row['type']} | {_cell(row['default'])} | {row['bounds']} | "
                     f"{_cell(row['description'])} | {names} |")
    return "\n".join(lines + derived_section()) + "\n"


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
