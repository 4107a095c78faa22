"""Input checks shared by the algo functions.

Every public algo function checks its arguments first, so that a wrong shape, dtype or value fails with a
message naming the argument instead of broadcasting silently into a wrong loss. Shape and dtype checks read
only metadata; value checks (mask holds 0/1, rewards finite) read data, so they are kept to the places where a
bad value is a real risk (masks given as numbers, rewards from user code).
"""
from __future__ import annotations

import difflib
from typing import Any, Mapping

import torch


def check_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> torch.Tensor:
    check_tensor(name, x)
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {layout} ({ndim}-D); got shape {tuple(x.shape)}")
    return x


def check_floating(name: str, x: torch.Tensor) -> torch.Tensor:
    check_tensor(name, x)
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {x.dtype}")
    return x


def check_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    check_tensor(name, x)
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; they must match"
        )
    return x


def check_batch_vector(name: str, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """x must be [B]: one value per sequence."""
    check_ndim(name, x, 1, "[B]")
    if x.shape[0] != batch_size:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but the batch has {batch_size} sequences; expected ({batch_size},)"
        )
    return x


def check_mask(name: str, mask: Any, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """Return `mask` as a bool tensor. Accepts bool, or integer/float tensors holding only 0 and 1.

    Anything else (e.g. 0.5, or a mask of token ids) is rejected: multiplying by it would silently reweight tokens.
    """
    check_tensor(name, mask)
    check_same_shape(name, mask, ref_name, ref)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{name} has dtype {mask.dtype}; expected bool, or an integer/float tensor of 0/1")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        examples = mask[bad][:3].tolist()
        raise ValueError(
            f"{name} (dtype {mask.dtype}) must hold only 0 and 1, or be bool; found {int(bad.sum())} other "
            f"value(s), e.g. {examples}"
        )
    return mask != 0


def check_finite(name: str, x: torch.Tensor, hint: str = "") -> torch.Tensor:
    """Raise naming how many entries of x are NaN/inf and in which rows (first dimension)."""
    check_tensor(name, x)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist() if x.dim() > 0 else []
        shown = ", ".join(str(r) for r in rows[:10]) + (", ..." if len(rows) > 10 else "")
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) (NaN or inf) in row(s) [{shown}] of shape "
            f"{tuple(x.shape)}" + (f"; {hint}" if hint else "")
        )
    return x


def check_range(name: str, value: float, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> float:
    """Check low <= value <= high (or low < value when low_open)."""
    ok = True
    if low is not None:
        ok = value > low if low_open else value >= low
    if high is not None:
        ok = ok and value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"<= {high}"
        raise ValueError(f"{name}={value!r} is out of range; expected {' and '.join(s for s in (lo, hi) if s)}")
    return value


def lookup(registry: Mapping[str, Any], name: str, kind: str) -> Any:
    """registry[name], or a ValueError listing the valid names and the closest match (for config validation)."""
    if name in registry:
        return registry[name]
    close = difflib.get_close_matches(str(name), list(registry), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown {kind} {name!r}; expected one of {sorted(registry)}{hint}")
