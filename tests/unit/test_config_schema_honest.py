"""An honest schema: every config field is read by the code that acts on it, or refused by validation.

A field nobody reads is a silent no-op: a user sets it, nothing changes, and nothing says so. This test walks every
leaf of the schema and looks for a read of it (an attribute access in the syntax tree) in megarl/**.py outside
validation (megarl/config/, megarl/validate/ and each feature's checks.py: a rule reads a field to refuse it, not to
act on it). A field name that is not unique (`enable`, `n`, `dtype` on a tensor, `sequence_parallel` on megatron's
config, ...) must be read through its own section: `<section>.<field>`, or a variable bound to that section
(`r = cfg.rollout`, `cfg: RolloutConfig`). Reads inside the schema's properties count when the property is read
(`critic_enabled`); reads by the memory planner count only for fields whose description names `plan`; a Literal with
a single value needs no read (the schema refuses every other value). A field that is not read must appear in REFUSED
with the reason validation gives, and validation must refuse a non-default value of it.
"""
import ast
from collections import Counter
from pathlib import Path
from typing import Literal

import pytest
import torch

from megarl.config import ConfigError
from megarl.config.loader import _model_fields, schema_paths
from megarl.config.schema import MegarlConfig
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]

# Accepted but not read here; validation refuses any value other than the one given (and says why).
REFUSED = {
    "data.dataloader_num_workers": (2, "prompts are read into memory once at start"),
    "rollout.pipeline_model_parallel_size": (2, "use rollout.tensor_model_parallel_size"),
}

# Section classes by the dotted path of their section, to resolve `cfg: RolloutConfig` parameters.
def _sections(cls=MegarlConfig, prefix=""):
    out = {}
    for name, sub in _model_fields(cls).items():
        if sub is not None:
            out[sub.__name__] = prefix + name
            out.update(_sections(sub, prefix + name + "."))
    return out


def _leaves() -> list[str]:
    sections = set(_sections().values())
    return [p for p in schema_paths() if p not in sections]


def _field(leaf: str):
    cls = MegarlConfig
    *sections, field = leaf.split(".")
    for name in sections:
        cls = _model_fields(cls)[name]
    return cls.model_fields[field]


# fields the schema expands into other fields when it loads (tests/unit/test_rollout_correction_presets.py checks it)
EXPANDED = {"algorithm.rollout_correction.preset"}


def _single_choice(leaf: str) -> bool:
    """A Literal with one value (e.g. rollout.name: 'vllm'): nothing to read."""
    ann = _field(leaf).annotation
    return getattr(ann, "__origin__", None) is Literal and len(ann.__args__) == 1


def _last_name(node) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


class _Reads(ast.NodeVisitor):
    """Attribute reads `<x>.<field>`, each with the set of section names `<x>` may stand for."""

    def __init__(self, section_of_class: dict):
        self.section_of_class = section_of_class
        self.aliases: dict[str, set] = {}  # variable -> section names it was bound to (per module, flow-insensitive)
        self.reads: list[tuple[str, ast.AST]] = []

    def _names(self, node) -> set:
        """Section names an expression may evaluate to: `cfg.rollout` -> {rollout}, `a if c else b` -> both."""
        if isinstance(node, ast.IfExp):
            return self._names(node.body) | self._names(node.orelse)
        last = _last_name(node)
        if last is None:
            return set()
        return {last} | self.aliases.get(last, set())

    def visit_Assign(self, node):
        pairs = []
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += zip(target.elts, node.value.elts)
            else:
                pairs.append((target, node.value))
        for target, value in pairs:
            name = _last_name(target)
            if name is not None:
                self.aliases.setdefault(name, set()).update(self._names(value))
        self.generic_visit(node)

    def visit_arg(self, node):
        ann = node.annotation
        cls = _last_name(ann) if ann is not None else None
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            cls = ann.value.split(".")[-1]
        if cls in self.section_of_class:
            self.aliases.setdefault(node.arg, set()).add(self.section_of_class[cls].rsplit(".", 1)[-1])

    def visit_Attribute(self, node):
        self.reads.append((node.attr, node.value))
        self.generic_visit(node)


def _module_reads(tree: ast.AST) -> tuple[set, set]:
    visitor = _Reads(_sections())
    visitor.visit(tree)  # first pass: aliases
    visitor.reads.clear()
    visitor.visit(tree)
    plain = {attr for attr, _ in visitor.reads}
    qualified = {(section, attr) for attr, value in visitor.reads for section in visitor._names(value)}
    return plain, qualified


def _validation(rel: tuple) -> bool:
    """megarl/config/ (but outputs.py: where the commands that write data and models read their output paths),
    megarl/validate/ and each feature's rules (checks.py)."""
    return rel[0] == "config" and rel != ("config", "outputs.py") or rel[0] == "validate" or rel[-1] == "checks.py"


def _reads(planner: bool = False) -> tuple[set, set]:
    """(field names read, (section name, field) pairs read through their section) by megarl/ outside validation and
    the memory planner, plus the schema's own properties that such code reads (critic_enabled, world_size, ...).
    The planner (the plan package) estimates the memory of every setting without acting on any: planner=True gives its reads
    alone, which count only for fields whose description says they serve `plan`."""
    plain, qualified = set(), set()
    for path in (ROOT / "megarl").rglob("*.py"):
        rel = path.relative_to(ROOT / "megarl").parts
        if _validation(rel) or (rel[0] == "plan") != planner:
            continue
        p, q = _module_reads(ast.parse(path.read_text()))
        plain |= p
        qualified |= q
    # the schema's own properties and methods that such code reads (critic_enabled, resolved_dtype, ...) read their
    # fields through `self`, which stands for the section of their class
    sections = _sections()
    schema = ast.parse((ROOT / "megarl" / "config" / "schema.py").read_text())
    for cls in (n for n in ast.walk(schema) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.name in plain:
                visitor = _Reads(sections)
                if cls.name in sections:
                    visitor.aliases["self"] = {sections[cls.name].rsplit(".", 1)[-1]}
                visitor.visit(node)
                plain |= {attr for attr, _ in visitor.reads}
                qualified |= {(section, attr) for attr, value in visitor.reads for section in visitor._names(value)}
    return plain, qualified


def test_every_field_is_read_or_refused():
    plain, qualified = _reads()
    plan_plain, plan_qualified = _reads(planner=True)
    leaves = _leaves()
    counts = Counter(p.rsplit(".", 1)[-1] for p in leaves)
    # names that tensors or megatron's TransformerConfig also have (config.sequence_parallel is not a read of ours)
    from megatron.core.transformer.transformer_config import TransformerConfig

    other_attrs = set(dir(torch.empty(0))) | set(TransformerConfig.__dataclass_fields__)
    unread = []
    for leaf in leaves:
        if _single_choice(leaf):
            continue  # the schema itself refuses every other value
        section, field = leaf.rsplit(".", 2)[-2:]
        ambiguous = counts[field] > 1 or field in other_attrs
        by_plan = "`plan`" in (_field(leaf).description or "")
        read = ((section, field) in qualified or by_plan and (section, field) in plan_qualified if ambiguous
                else field in plain or by_plan and field in plan_plain)
        if not read and leaf not in REFUSED and leaf not in EXPANDED:
            unread.append(leaf)
    assert not unread, f"config fields nobody reads (make them work, or refuse them in validation): {unread}"


def test_refused_fields_are_refused_with_their_reason():
    tiny = {"model": {"path": "x", "create_tiny": {}}, "rollout": {"n": 4}}
    for key, (value, reason) in REFUSED.items():
        load_config(data=tiny)  # the default is accepted
        with pytest.raises(ConfigError) as err:
            load_config(data=tiny, overrides=[f"{key}={value}"])
        issue = {i.key: i for i in err.value.issues}[key]
        assert reason in issue.fix, (key, issue.render())


def test_refused_fields_are_really_unread():
    """A field that became read must leave REFUSED (and its refusal must go)."""
    plain, qualified = _reads()
    for key in REFUSED:
        section, field = key.rsplit(".", 2)[-2:]
        assert (section, field) not in qualified, f"{key} is read now: drop it from REFUSED and from validation"


def test_the_walk_tells_a_section_read_from_a_same_named_attribute():
    """The check itself can fail: `tensor.dtype` is not a read of model.dtype; `cfg.model.dtype`, an alias of the
    section, or a parameter annotated with the section's class is."""
    code = """
def f(tensor, cfg, rollout_cfg: RolloutConfig, other: "ValKwargs"):
    x = tensor.dtype + tensor.device
    m = cfg.model
    src = cfg.rollout.val_kwargs if x else cfg.rollout
    return m.recompute, src.do_sample, rollout_cfg.temperature, other.top_p, cfg.trainer.seed
"""
    plain, qualified = _module_reads(ast.parse(code))
    assert {"dtype", "device"} <= plain
    assert not {("model", "dtype"), ("trainer", "device")} & qualified
    assert {("model", "recompute"), ("val_kwargs", "do_sample"), ("rollout", "do_sample"), ("rollout", "temperature"),
            ("val_kwargs", "top_p"), ("trainer", "seed")} <= qualified
