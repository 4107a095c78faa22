"""docs/support.md against the test suite: the files it cites exist and hold tests of the column's kind (CPU tests in
the CPU column, `gpu`-marked tests in the GPU column), every `gpu`-marked test is cited, and every refusal it lists is
what `megarl validate` reports, with that troubleshooting id, for the overrides the page gives."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "support.md"
BASE_RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"
HEADER = ["feature", "tested on CPU", "tested on GPU", "written for GPU, never run", "refused by `validate`"]
CITED = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")
REFUSAL = re.compile(r"`(config-[a-z-]+)` with `([^`]+)`")


def _cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rows() -> list:
    lines = [ln for ln in PAGE.read_text().splitlines() if ln.startswith("|")]
    assert _cells(lines[0]) == HEADER, lines[0]
    return [dict(zip(HEADER, _cells(ln))) for ln in lines[2:]]


def _is_gpu_mark(node) -> bool:
    """pytest.mark.gpu, as an expression (a decorator, or an item of a pytestmark list)."""
    return isinstance(node, ast.Attribute) and node.attr == "gpu" and ast.unparse(node.value) == "pytest.mark"


def marked_tests(path: Path) -> dict:
    """{test function name: True if gpu-marked}, read from the file's syntax (marks on the module or the function)."""
    tree = ast.parse(path.read_text())
    module_gpu = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            value = node.value
            module_gpu = any(_is_gpu_mark(v) for v in (value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]))
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            found[node.name] = module_gpu or any(_is_gpu_mark(d) for d in node.decorator_list)
    return found


def all_gpu_tests() -> set:
    return {f"{p.relative_to(ROOT).as_posix()}::{name}" for p in sorted((ROOT / "tests").rglob("test_*.py"))
            for name, gpu in marked_tests(p).items() if gpu}


def test_the_ast_reading_of_marks():
    marks = marked_tests(ROOT / "tests" / "gpu" / "test_ipc_sync.py")  # module-level pytestmark
    assert marks and all(marks.values())
    marks = marked_tests(ROOT / "tests" / "e2e" / "test_doctor.py")  # one decorated test among CPU ones
    assert marks["test_doctor_passes_on_the_gpu"] and not marks["test_doctor_passes_without_the_engine_probe"]


def test_cpu_column_cites_files_with_cpu_tests():
    problems = []
    for row in rows():
        cell = row["tested on CPU"]
        cited = CITED.findall(cell)
        if not cited and not cell.startswith("no"):
            problems.append(f"{row['feature']}: cites no test file and does not say no")
        for path, name in cited:
            if not (ROOT / path).is_file():
                problems.append(f"{row['feature']}: {path} does not exist")
                continue
            marks = marked_tests(ROOT / path)
            cpu = [n for n, gpu in marks.items() if not gpu and (not name or n == name)]
            if not cpu:
                problems.append(f"{row['feature']}: {path}{'::' + name if name else ''} holds no CPU test")
    assert not problems, "\n".join(problems)


def test_gpu_column_cites_every_gpu_test_and_only_gpu_tests():
    gpu_tests, cited = all_gpu_tests(), set()
    problems = []
    for row in rows():
        cell = row["written for GPU, never run"]
        found = CITED.findall(cell)
        if not found and not (cell == "none" or cell.startswith("none (")):
            problems.append(f"{row['feature']}: {cell!r} is neither test names nor 'none'")
        for path, name in found:
            node = f"{path}::{name}"
            cited.add(node)
            if not name or node not in gpu_tests:
                problems.append(f"{row['feature']}: {node} is not a gpu-marked test")
    problems += [f"gpu-marked test cited nowhere: {node}" for node in sorted(gpu_tests - cited)]
    assert gpu_tests and not problems, "\n".join(problems)


def test_gpu_measured_column_says_no_or_links_the_measurement():
    bad = [row["feature"] for row in rows()
           if not (row["tested on GPU"].startswith("no") or "(results.md#" in row["tested on GPU"])]
    assert not bad, bad


def refusals() -> list:
    found = [(row["feature"], rule_id, overrides.split())
             for row in rows() for rule_id, overrides in REFUSAL.findall(row["refused by `validate`"])]
    return found


def test_refusal_cells_are_an_id_with_overrides_or_none():
    bad = [row["feature"] for row in rows() if row["refused by `validate`"] != "none"
           and not REFUSAL.search(row["refused by `validate`"])
           and not row["refused by `validate`"].startswith("none (")]
    assert refusals() and not bad, bad


@pytest.mark.parametrize("feature,rule_id,overrides", refusals(), ids=lambda v: v if isinstance(v, str) else None)
def test_each_refusal_is_what_validate_reports(feature, rule_id, overrides):
    from megarl.config.issues import ConfigError
    from megarl.validate import CHECKS, load_config, rule_id as id_of

    assert rule_id in {id_of(check) for check in CHECKS}, f"{rule_id} names no rule of megarl.validate"
    load_config(BASE_RECIPE)  # the base recipe alone passes: the refusal comes from the overrides
    with pytest.raises(ConfigError) as err:
        load_config(BASE_RECIPE, overrides)
    ids = {issue.error_id for issue in err.value.issues if not issue.warning}
    assert rule_id in ids, f"{feature}: {overrides} gave {sorted(ids)}:\n{err.value}"
