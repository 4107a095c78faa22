"""The floors of megarl's packages (docs/architecture.md, "Packages and floors"): a module may import its own package
and the floors below it, never one above. Read from the code's own imports (function-level ones included) with `ast`,
so the rule holds without importing anything."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# from the ground up; a package (folder) or a top-level module is one unit, named as imported under megarl
FLOORS = [
    ("ground", {"__init__", "types", "numerics", "lifecycle", "report", "layout", "console", "import_hooks",
                "distributed"}),
    ("schema", {"config", "batching"}),
    ("algorithms and data", {"algo", "agent", "data", "metrics"}),
    ("model mapping", {"bridge"}),
    ("adapters and inputs", {"lora", "prepare"}),
    ("training model", {"megatron"}),
    ("weight sync", {"sync"}),
    ("engine", {"rollout", "launch_local"}),
    ("rewards", {"reward"}),
    ("references", {"hf_reference", "verify", "rm_data"}),
    ("checkpoints", {"checkpoint", "doctor"}),
    ("run start-up", {"runtime"}),
    ("loop stages", {"steps", "sft", "validate"}),
    ("commands", {"trainer", "rm", "plan", "convert_verl", "get_model"}),
    ("entry points", {"cli", "__main__"}),
]
FLOOR = {unit: i for i, (_, units) in enumerate(FLOORS) for unit in units}
# imports allowed to run back up, each with its reason
EXCEPTIONS = {
    ("__init__", "megatron"): "megarl/__init__.py hooks megatron-core's import (megarl.megatron.lean_import) before any "
                              "module of megarl can import it: the package root is the one place that runs first",
}


def unit_of(module: str) -> str:
    """'megarl.sync.delivery' -> 'sync'; 'megarl' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def megarl_imports(path: Path):
    """(line, imported unit) of every import of megarl in the file, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, unit_of(a.name)) for a in node.names if a.name.split(".")[0] == "megarl")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "megarl":  # from megarl import runtime, algo
                yield from ((node.lineno, a.name) for a in node.names)
            elif node.module.startswith("megarl."):
                yield node.lineno, unit_of(node.module)


def upward_imports(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "megarl").rglob("*.py")):
        rel = path.relative_to(root)
        unit = unit_of(".".join(rel.with_suffix("").parts))
        for line, target in megarl_imports(path):
            if target != unit and target in FLOOR and FLOOR[target] > FLOOR[unit] \
                    and (unit, target) not in EXCEPTIONS:
                found.append(f"{rel}:{line}: {unit} ({FLOORS[FLOOR[unit]][0]}) imports {target} "
                             f"({FLOORS[FLOOR[target]][0]}), a floor above")
    return found


def test_every_unit_has_a_floor():
    units = {unit_of(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in (ROOT / "megarl").rglob("*.py")}
    assert units - set(FLOOR) == set(), ("give the new package or module a floor in FLOORS (and the floors table in "
                                         "docs/architecture.md)")


def test_no_import_runs_back_up():
    assert upward_imports(ROOT) == []


def test_an_upward_import_is_caught(tmp_path):
    """The check fails on an import that runs back up (here: the ground's types importing the trainer)."""
    (tmp_path / "megarl").mkdir()
    (tmp_path / "megarl" / "types.py").write_text("def f():\n    from megarl.trainer import train\n")
    (tmp_path / "megarl" / "trainer.py").write_text("from megarl.types import f\n")
    [problem] = upward_imports(tmp_path)
    assert problem.startswith("megarl/types.py:2: types (ground) imports trainer (commands)")
