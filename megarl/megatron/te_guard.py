"""Transformer Engine as an optional dependency: an installed TE whose import fails counts as absent, with the reason.

megatron-core imports `transformer_engine` at module level in `megatron.core.utils` (and in ~40 other modules) inside
`try: ... except ImportError`. TE's import can fail otherwise: without its core library (`transformer_engine_cu13`,
a separate wheel) `import transformer_engine` raises RuntimeError from its library loader, and a RuntimeError passes
through megatron's `except ImportError`, so `import megatron.core` itself fails and with it the path without TE.

`te_import_failure()` imports TE once per process (its top package and its PyTorch part, which megatron's layer specs
and optimizers import); when that raises anything, TE's modules are replaced by None in `sys.modules`, which Python
treats as absent: `import transformer_engine` raises ModuleNotFoundError (an ImportError, which megatron handles)
and `importlib.util.find_spec` returns None. The reason is logged once and kept for `megarl doctor`. megarl runs it
before `megatron.core` is imported (megarl.megatron.lean_import) and wherever it asks whether TE is there.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Optional

log = logging.getLogger("megarl")

# what megatron imports of TE; the first is the package whose import loads TE's core library
PROBED = ("transformer_engine", "transformer_engine.pytorch")
_TOP_LEVEL = ("transformer_engine", "transformer_engine_torch")
_UNPROBED = object()
_failure = _UNPROBED


def te_import_failure() -> Optional[str]:
    """None when TE is not installed or imports; otherwise why its import failed (TE is then hidden as absent)."""
    global _failure
    if _failure is _UNPROBED:
        _failure = _probe()
        if _failure is not None:
            _hide()
            log.warning("megarl: %s; Transformer Engine is treated as absent (megatron's local layer specs, no TE "
                        "fusions)", _failure)
    return _failure


def _probe() -> Optional[str]:
    if importlib.util.find_spec(PROBED[0]) is None:
        return None  # not installed (or hidden already): nothing to fall back from
    for name in PROBED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure of TE's import makes TE absent, the reason kept
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"transformer_engine is installed but `import {name}` raised {type(exc).__name__}: {first}"
    return None


def _hide() -> None:
    for name in list(sys.modules):
        if any(name == top or name.startswith(top + ".") for top in _TOP_LEVEL):
            del sys.modules[name]
    for top in _TOP_LEVEL:
        sys.modules[top] = None
