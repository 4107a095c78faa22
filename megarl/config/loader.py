"""Recipe loading: YAML with `base:` inheritance, `a.b=c` overrides, schema validation, one report of all problems."""
from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from pydantic import BaseModel, ValidationError

from megarl.config.issues import _MISSING, ConfigError, Issue
from megarl.config.schema import MegarlConfig


def _deep_merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _recipe_error(path: Path, key: str, value, rule: str, fix: str = "") -> ConfigError:
    """A recipe file that cannot be read as one (troubleshooting entry config-recipe)."""
    return ConfigError(str(path), [Issue(key, value, rule, fix, error_id="config-recipe")])


def read_recipe(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a recipe YAML, resolving `base: other.yaml` (relative to the file) recursively."""
    path = Path(path).resolve()
    if path in _chain:
        raise _recipe_error(path, "base", str(path), "recipes extend each other in a cycle: "
                            + " -> ".join(str(p) for p in _chain + (path,)), "remove one `base:`")
    if not path.is_file():
        raise _recipe_error(path, "recipe", str(path), "file not found",
                            "pass the path of a YAML recipe, e.g. recipes/grpo_tiny_cpu.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise _recipe_error(path, "recipe", str(path), f"not valid YAML: {exc}", "fix the syntax") from None
    if not isinstance(data, dict):
        raise _recipe_error(path, "recipe", type(data).__name__, "the top level must be a mapping of sections "
                            "(data, model, actor, ...)")
    base = data.pop("base", None)
    if base:
        parent = read_recipe(path.parent / base, _chain + (path,))
        data = _deep_merge(parent, data)
    return data


def parse_value(text: str) -> Any:
    """Coerce an override's text the way YAML would: 0.7 -> float, true -> bool, [1,2] -> list, null -> None."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: Iterable[str]) -> list[Issue]:
    """Apply `section.key=value` overrides in place; return issues for malformed ones."""
    issues = []
    for item in overrides:
        if "=" not in item:
            issues.append(Issue(item, _MISSING, "an override must look like section.key=value",
                                f"e.g. {item}=VALUE", error_id="config-override"))
            continue
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = parse_value(text)
    return issues


def _model_fields(cls: type[BaseModel]) -> dict[str, Optional[type[BaseModel]]]:
    """Field name -> nested section class (or None for a leaf)."""
    out = {}
    for name, info in cls.model_fields.items():
        ann = info.annotation
        if getattr(ann, "__origin__", None) is dict:  # named entries (reward.components): pydantic checks their keys
            out[name] = None
            continue
        candidates = [ann] + list(getattr(ann, "__args__", ()))
        out[name] = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return out


def schema_paths(cls: type[BaseModel] = MegarlConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections and leaves, depth first (e.g. 'rollout', 'rollout.val_kwargs.n')."""
    out = []
    for name, sub in _model_fields(cls).items():
        out.append(prefix + name)
        if sub is not None:
            out += schema_paths(sub, prefix + name + ".")
    return out


def _suggest(key: str, prefix: str, fields: dict) -> str:
    """The same name in another section first (trainer.save_freq -> checkpoint.save_freq), then the closest name in
    this section, then the closest anywhere."""
    elsewhere = sorted((p for p in schema_paths() if p.rsplit(".", 1)[-1] == key),
                       key=lambda p: not p.startswith(prefix))  # nested in this section first
    if elsewhere:
        return f"did you mean {' or '.join(repr(p) for p in elsewhere[:3])}?"
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    by_leaf = {p.rsplit(".", 1)[-1]: p for p in schema_paths()}
    close = difflib.get_close_matches(key, list(by_leaf), n=1, cutoff=0.75)
    if close:
        return f"did you mean '{by_leaf[close[0]]}'?"
    return f"valid keys: {', '.join(sorted(fields))}"


def unknown_key_issues(data: dict, cls: type[BaseModel] = MegarlConfig, prefix: str = "") -> list[Issue]:
    """Every key of `data` that the schema does not know, with the closest valid name."""
    issues = []
    fields = _model_fields(cls)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            where = f"'{prefix[:-1]}'" if prefix else "the top level"
            issues.append(Issue(path, value, f"unknown key in {where}", _suggest(str(key), prefix, fields),
                                keys=(path,), error_id="config-unknown-key"))
        elif fields[key] is not None and isinstance(value, dict):
            issues += unknown_key_issues(value, fields[key], path + ".")
    return issues


def _get(data: dict, path: tuple) -> Any:
    node = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _delete(data: dict, path: tuple) -> None:
    node = data
    for part in path[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(path[-1], None)


def _schema_issues(data: dict) -> tuple[Optional[MegarlConfig], list[Issue]]:
    """Validate against the schema; on errors, drop the bad keys and validate again so later checks can still run."""
    issues: list[Issue] = []
    data = copy.deepcopy(data)
    for _ in range(5):
        try:
            return MegarlConfig.model_validate(data), issues
        except ValidationError as exc:
            for err in exc.errors():
                loc = tuple(str(p) for p in err["loc"] if not isinstance(p, int))
                if err["type"] == "extra_forbidden":  # reported with a suggestion by unknown_key_issues
                    _delete(data, loc)
                    continue
                key = ".".join(loc)
                value = err.get("input", _get(data, loc))
                issues.append(Issue(key, value, err["msg"], _type_hint(key), keys=(key,), error_id="config-value"))
                _delete(data, loc)
    return None, issues


def _type_hint(key: str) -> str:
    section, _, field = key.partition(".")
    cls = _model_fields(MegarlConfig).get(section)
    parts = field.split(".") if field else []
    info = None
    while cls is not None and parts:
        name = parts.pop(0)
        info = cls.model_fields.get(name)
        cls = _model_fields(cls).get(name) if info else None
    if info is None:
        return ""
    desc = f" ({info.description})" if info.description else ""
    return f"expected {getattr(info.annotation, '__name__', str(info.annotation)).replace('typing.', '')}{desc}"


def parse_config(recipe: str | Path | None = None, overrides: Iterable[str] = (), *,
                 data: Optional[dict] = None) -> tuple[Optional[MegarlConfig], list[Issue]]:
    """Load and override a recipe and hold it against the schema: the config (built without the keys the schema
    refuses; None where even that fails) and every problem found. Raises ConfigError only for a recipe that cannot be
    read (a missing file, bad YAML, `base:` files in a cycle). The cross-field rules are megarl.validate's."""
    data = copy.deepcopy(data) if data is not None else read_recipe(recipe) if recipe else {}
    issues = apply_overrides(data, list(overrides))
    issues += unknown_key_issues(data)
    cfg, schema_issues = _schema_issues(data)
    return cfg, issues + schema_issues


def config_or_error(recipe: str | Path | None, cfg: Optional[MegarlConfig], issues: list[Issue]) -> MegarlConfig:
    """The config with its warnings (cfg._warnings); ConfigError listing every error if there is one."""
    errors = [i for i in issues if not i.warning]
    if errors:
        raise ConfigError(str(recipe) if recipe else "<config>", errors)
    cfg._warnings = [i for i in issues if i.warning]  # type: ignore[attr-defined]
    return cfg


def load_unchecked(recipe: str | Path | None = None, overrides: Iterable[str] = (), *,
                   data: Optional[dict] = None) -> MegarlConfig:
    """A recipe held against the schema alone, without the cross-field rules (megarl.validate.load_config has them):
    for code that builds a config it knows the rules would refuse, e.g. a test of one mechanism on a stand-in model."""
    return config_or_error(recipe, *parse_config(recipe, overrides, data=data))
