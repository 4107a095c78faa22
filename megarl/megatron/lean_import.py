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

Before megatron.core's own code runs, an installed Transformer Engine whose import fails is made absent
(megarl.megatron.te_guard): megatron catches only ImportError around its TE imports.

`install()` (run by `import megarl`) hooks these into the imports of those modules (megarl.import_hooks); it changes
nothing if megatron.core was imported before megarl.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from megarl.import_hooks import after_import, around_import, refusing_import

_CORE = "megatron.core"


def _after_jit(module: Any) -> None:
    import torch

    if not torch.cuda.is_available():
        module.disable_jit_fuser()


def _core_import(run: Callable, module: Any) -> None:
    from megarl.megatron.te_guard import te_import_failure

    te_import_failure()
    with refusing_import("wandb", "not imported with megatron.core: megarl does not use megatron's wandb logging"):
        run()


def install() -> None:
    """Hook the imports of megatron.core and its jit module (idempotent; a no-op once megatron.core was imported)."""
    if _CORE in sys.modules:
        return
    around_import(_CORE, _core_import)
    after_import("megatron.core.jit", _after_jit)
