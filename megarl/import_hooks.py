"""Code that must run when a given module is imported, whenever and by whichever import that happens.

    after_import("vllm.model_executor.layers.utils", patch)   # patch(module) now if imported, else right after
    around_import("megatron.core", around)                    # around(run, module) wraps the module's execution
    refusing_import("wandb")                                  # a context: `import wandb` fails inside it

Why not patch at import time of the patching module: which module is imported first depends on the process (a
vLLM worker that megarl's extension is imported into, a forked or spawned child, a user's script importing megarl
before vLLM), and a patch applied to a module not yet imported, or skipped because it was not, silently does
nothing. One finder at the front of `sys.meta_path` wraps the loader of each named module instead.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any, Callable, Optional


class _Loader(importlib.abc.Loader):
    """The real loader of a module, with `around(run, module)` wrapped around the execution of its code."""

    def __init__(self, loader, around: Callable):
        self._loader, self._around = loader, around

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._around(lambda: self._loader.exec_module(module), module)

    def __getattr__(self, name: str):  # get_source, is_package, ... as the real loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.after: dict = {}  # module name -> [fn(module)]
        self.around: dict = {}  # module name -> around(run, module)
        self.refused: dict = {}  # module name -> why its import fails now

    def find_spec(self, name: str, path, target=None):
        if name in self.refused:
            raise ModuleNotFoundError(f"No module named {name!r} ({self.refused[name]})", name=name)
        if name not in self.after and name not in self.around:
            return None
        spec = self._real_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self._runner(name))
        return spec

    def _runner(self, name: str) -> Callable:
        around = self.around.get(name, lambda run, module: run())

        def run_hooks(run: Callable, module: Any) -> None:
            around(run, module)
            for fn in self.after.pop(name, []):
                fn(module)

        return run_hooks

    def _real_spec(self, name: str, path, target) -> Optional[Any]:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


def _finder() -> _Finder:
    for f in sys.meta_path:
        if isinstance(f, _Finder):
            return f
    f = _Finder()
    sys.meta_path.insert(0, f)
    return f


def after_import(name: str, fn: Callable[[Any], None]) -> None:
    """Call fn(module) once module `name` is imported: now if it already is, else right after its code ran."""
    if name in sys.modules:
        fn(sys.modules[name])
    else:
        _finder().after.setdefault(name, []).append(fn)


def around_import(name: str, around: Callable[[Callable, Any], None]) -> None:
    """Run the code of module `name`, when it is first imported, as around(run, module) (around calls run())."""
    if name not in sys.modules:
        _finder().around[name] = around


@contextlib.contextmanager
def refusing_import(name: str, why: str):
    """Within the block, importing `name` (not imported yet) raises ModuleNotFoundError as if it were absent."""
    finder = _finder()
    if name in sys.modules:
        yield
        return
    finder.refused[name] = why
    try:
        yield
    finally:
        finder.refused.pop(name, None)
