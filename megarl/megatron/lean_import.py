"""Import megatron-core without what megarl never uses of it: every rank (and every test) pays its import time.

Two parts of `import megatron.core` cost about 3 s of the 6-7 s it takes on a 2-core CPU machine, for nothing megarl
runs:
* `megatron.core.jit` makes `torch.compile` the decorator of megatron's fused kernels, and decorating imports torch's
  whole compiler stack (dynamo, inductor: ~2.2 s). On a machine without CUDA none of those kernels runs (megarl builds
  the model with every fusion off), so there megatron's own `disable_jit_fuser()` runs before any kernel is decorated.
  With CUDA nothing changes.
* megatron's inference context and timers import wandb when it is installed (~0.8 s), for logging megarl does not use
  (megarl's own wandb logger imports it when `logging.wandb` asks). While megatron.core itself is being imported,
  `import wandb` fails as if wandb were absent; afterwards it imports normally.

`install()` (run by `import megarl`) adds a finder to `sys.meta_path` that wraps the loaders of those two modules; it
changes nothing if megatron.core was imported before megarl.
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable, Optional

_JIT = "megatron.core.jit"
_CORE = "megatron.core"
_SKIPPED = "wandb"


def _after_jit(module: Any) -> None:
    import torch

    if not torch.cuda.is_available():
        module.disable_jit_fuser()


class _Loader(importlib.abc.Loader):
    """The real loader of a module, with `around(run)` wrapped around the execution of its code."""

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
        self.importing_core = False

    def find_spec(self, name: str, path, target=None):
        if name == _SKIPPED and self.importing_core:
            raise ModuleNotFoundError(f"No module named {_SKIPPED!r} (not imported with megatron.core: megarl does not "
                                      "use megatron's wandb logging)", name=name)
        around = {_JIT: self._around_jit, _CORE: self._around_core}.get(name)
        if around is None:
            return None
        spec = _real_spec(self, name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, around)
        return spec

    @staticmethod
    def _around_jit(run: Callable, module: Any) -> None:
        run()
        _after_jit(module)

    def _around_core(self, run: Callable, module: Any) -> None:
        self.importing_core = _SKIPPED not in sys.modules
        try:
            run()
        finally:
            self.importing_core = False


def _real_spec(me: _Finder, name: str, path, target) -> Optional[Any]:
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


def install() -> None:
    """Add the finder once, before megatron.core is imported (idempotent; a no-op once it was imported)."""
    if _CORE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
