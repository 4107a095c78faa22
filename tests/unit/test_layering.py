"""The floors of megarl's packages (docs/architecture.md, "Packages and floors"): a module may import its own package
and the floors below it, never one above, and no modules import each other round a circle. Read from the code's own
imports with `ast` (function-level ones, relative ones and `importlib.import_module("megarl...")` strings included),
so the rules hold without importing anything, and `layering_problems` runs on any tree (its own tests build small
ones)."""
import ast
from pathlib import Path

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
    ("references", {"hf_reference", "verify", "verify_vl", "rm_data"}),
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


def modules_of(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module under root/megarl; a package is named by its __init__.py."""
    found = {}
    for path in sorted((root / "megarl").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _known(name: str, modules) -> str:
    """The module `name` lives in: itself, or its longest prefix that is a module (a name imported from it)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _import_string(call: ast.Call):
    """The module an `importlib.import_module("...", package)` / `import_module(...)` call names, where the code
    spells it out; None for a name only known at run time."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    if not arg.value.startswith("."):
        return arg.value
    package = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "package"), None)
    if not (isinstance(package, ast.Constant) and isinstance(package.value, str)):
        return None
    level = len(arg.value) - len(arg.value.lstrip("."))
    base = package.value.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([arg.value[level:]] if arg.value[level:] else []))


def module_imports(module: str, path: Path, modules) -> list[tuple[int, str]]:
    """(line, imported module of megarl) of every import in the file, wherever it stands, relative ones resolved
    against the file's package and `from package import module` read as the module."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            found += [(node.lineno, f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
                      for a in node.names]
        elif isinstance(node, ast.Call) and (name := _import_string(node)):
            found.append((node.lineno, name))
    return [(line, _known(name, modules)) for line, name in found if name.split(".")[0] == "megarl"]


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """{module: {module of megarl it imports: first line}}."""
    modules = modules_of(root)
    graph = {}
    for module, path in modules.items():
        graph[module] = {}
        for line, target in module_imports(module, path, modules):
            if target != module:
                graph[module].setdefault(target, line)
    return graph


def upward_imports(root: Path, graph) -> list[str]:
    modules, found = modules_of(root), []
    for module, targets in graph.items():
        unit = unit_of(module)
        for target, line in targets.items():
            to = unit_of(target)
            if to != unit and to in FLOOR and unit in FLOOR and FLOOR[to] > FLOOR[unit] and (unit, to) not in EXCEPTIONS:
                found.append(f"{modules[module].relative_to(root)}:{line}: {unit} ({FLOORS[FLOOR[unit]][0]}) imports "
                             f"{to} ({FLOORS[FLOOR[to]][0]}), a floor above")
    return found


def circles(root: Path, graph) -> list[str]:
    """Each group of modules that import one another round a circle (a strongly connected component of the import
    graph, found with Tarjan's algorithm), with the imports that close it."""
    modules, index, low, stack, on_stack, groups = modules_of(root), {}, {}, [], set(), []

    def visit(v):  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [" <-> ".join(sorted(group)) + ": " + ", ".join(
        f"{modules[a].relative_to(root)}:{graph[a][b]} imports {b}" for a in sorted(group)
        for b in sorted(graph[a]) if b in group) for group in groups]


def layering_problems(root: Path) -> list[str]:
    """Every upward import and every import circle among the modules under root/megarl."""
    graph = import_graph(root)
    return upward_imports(root, graph) + circles(root, graph)


def test_every_unit_has_a_floor():
    units = {unit_of(module) for module in modules_of(ROOT)}
    assert units - set(FLOOR) == set(), ("give the new package or module a floor in FLOORS (and the floors table in "
                                         "docs/architecture.md)")


def test_the_tree_keeps_its_floors_and_has_no_circles():
    assert layering_problems(ROOT) == []


def _tree(tmp_path: Path, files: dict) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_an_upward_import_is_caught(tmp_path):
    """The check fails on an import that runs back up (here: the ground's types importing the trainer)."""
    root = _tree(tmp_path, {"megarl/types.py": "def f():\n    from megarl.trainer import train\n",
                            "megarl/trainer.py": "from megarl.types import f\n"})
    [problem] = upward_imports(root, import_graph(root))
    assert problem.startswith("megarl/types.py:2: types (ground) imports trainer (commands)")


def test_a_relative_upward_import_is_caught(tmp_path):
    """`from ..rollout import x` inside sync/ is rollout (a floor above), as the absolute import would be."""
    root = _tree(tmp_path, {"megarl/__init__.py": "", "megarl/sync/__init__.py": "",
                            "megarl/sync/delivery.py": "from ..rollout import engine\n",
                            "megarl/rollout/__init__.py": "", "megarl/rollout/engine.py": ""})
    assert import_graph(root)["megarl.sync.delivery"] == {"megarl.rollout.engine": 1}
    [problem] = layering_problems(root)
    assert problem.startswith("megarl/sync/delivery.py:1: sync (weight sync) imports rollout (engine), a floor above")


def test_an_import_string_is_caught(tmp_path):
    """`importlib.import_module("megarl.trainer")` (or `import_module(...)` imported bare) counts as an import."""
    root = _tree(tmp_path, {"megarl/__init__.py": "", "megarl/trainer.py": "",
                            "megarl/sync/__init__.py": "import importlib\n\n\n"
                                                       "def f():\n    return importlib.import_module('megarl.trainer')\n",
                            "megarl/algo/__init__.py": "from importlib import import_module\n"
                                                       "steps = import_module('.trainer', 'megarl')\n"})
    assert sorted(layering_problems(root)) == [
        "megarl/algo/__init__.py:2: algo (algorithms and data) imports trainer (commands), a floor above",
        "megarl/sync/__init__.py:5: sync (weight sync) imports trainer (commands), a floor above"]


def test_a_circle_inside_one_package_is_caught(tmp_path):
    """Modules of one package (one floor) importing each other round a circle, relatively and by function-level
    imports too; a module importing its neighbour one way only is no circle."""
    root = _tree(tmp_path, {"megarl/__init__.py": "", "megarl/sync/__init__.py": "",
                            "megarl/sync/a.py": "from . import b\n",
                            "megarl/sync/b.py": "def f():\n    from megarl.sync.c import g\n",
                            "megarl/sync/c.py": "from .a import h\n",
                            "megarl/sync/d.py": "from megarl.sync import a\n"})
    assert layering_problems(root) == [
        "megarl.sync.a <-> megarl.sync.b <-> megarl.sync.c: megarl/sync/a.py:1 imports megarl.sync.b, "
        "megarl/sync/b.py:2 imports megarl.sync.c, megarl/sync/c.py:1 imports megarl.sync.a"]


# The weight sync's two sides: what runs beside an engine (its workers, the receiver of a separately placed one)
# imports only what both sides agree on, never the trainer side's transports, plan or holdings.
SHARED_SYNC = {"megarl.sync", "megarl.sync.wire", "megarl.sync.transfer", "megarl.sync.boxes", "megarl.sync.shards",
               "megarl.sync.weights", "megarl.sync.placement", "megarl.sync.pull", "megarl.sync.delta",
               "megarl.sync.seam"}
ENGINE_SIDE = ("megarl.rollout.vllm.worker_ext", "megarl.rollout.hosting.receiver", "megarl.rollout.vllm.routes")


def engine_side_problems(root: Path) -> list[str]:
    graph = import_graph(root)
    return [f"{module} imports {name} (the trainer side of the weight sync)" for module in ENGINE_SIDE
            for name in sorted(graph.get(module, {})) if name.startswith("megarl.sync") and name not in SHARED_SYNC]


def test_the_engine_side_imports_only_what_both_sides_share():
    assert engine_side_problems(ROOT) == []


def test_an_engine_side_import_of_a_transport_is_caught(tmp_path):
    receiver = "from megarl.sync import wire\nfrom megarl.sync.transports.remote import RemoteSync\n"
    root = _tree(tmp_path, {"megarl/__init__.py": "", "megarl/sync/__init__.py": "", "megarl/sync/wire.py": "",
                            "megarl/sync/transports/__init__.py": "", "megarl/sync/transports/remote.py": "",
                            "megarl/rollout/__init__.py": "", "megarl/rollout/hosting/__init__.py": "",
                            "megarl/rollout/hosting/receiver.py": receiver})
    assert engine_side_problems(root) == ["megarl.rollout.hosting.receiver imports megarl.sync.transports.remote (the "
                                          "trainer side of the weight sync)"]
