"""The precision policy: float32 means float32 unless the recipe allows TF32 (model.allow_tf32).

On Ampere and later GPUs a float32 matrix product may run on TF32 tensor cores (10-bit mantissa): about 1e-3 relative
error per product instead of 1e-7. torch decides this with three flags, Transformer Engine's cuBLAS GEMMs and other
CUDA libraries with the NVIDIA_TF32_OVERRIDE environment variable (read when the library initialises, so it is set
before CUDA starts in this process and inherited by the ranks it starts). `apply_precision` sets all of them from one
boolean, so a float32 run computes in float32 whatever the libraries' defaults are; bf16 runs are unaffected (their
matrix products are bf16).

    apply_precision(allow_tf32=False)   # before the first CUDA call of the process
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("megarl")

TF32_ENV = "NVIDIA_TF32_OVERRIDE"


def apply_precision(allow_tf32: bool) -> dict:
    """Set torch's TF32 flags and the CUDA libraries' override from `allow_tf32`; return the resulting state.

    allow_tf32=False: matmul.allow_tf32 = cudnn.allow_tf32 = False, float32 matmul precision "highest", and
    NVIDIA_TF32_OVERRIDE=0 (CUDA libraries, Transformer Engine included, then never use TF32).
    allow_tf32=True: the flags on, precision "high"; an NVIDIA_TF32_OVERRIDE=0 set by the user still wins (reported)."""
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")
    if not allow_tf32:
        if os.environ.get(TF32_ENV) != "0" and _cuda_initialized():
            log.warning("model.allow_tf32=false was applied after CUDA started in this process: torch's flags are off, "
                        "but CUDA libraries that read %s at start-up (Transformer Engine's GEMMs) may still use TF32",
                        TF32_ENV)
        os.environ[TF32_ENV] = "0"
    return precision_state()


def precision_state() -> dict:
    """What float32 matrix products may use now: torch's flags and the libraries' override."""
    return {"matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            TF32_ENV: os.environ.get(TF32_ENV)}


def tf32_in_effect() -> bool:
    """True when a float32 matrix product on this machine's GPU may run in TF32 (False without CUDA)."""
    if not torch.cuda.is_available() or os.environ.get(TF32_ENV) == "0":
        return False
    major, _ = torch.cuda.get_device_capability()
    return major >= 8 and (torch.backends.cuda.matmul.allow_tf32 or _te_gemms_use_tf32())


def _te_gemms_use_tf32() -> bool:
    # Transformer Engine's float32 GEMMs take the cuBLAS fast-TF32 path unless the override is 0
    import importlib.util

    from megarl.megatron.te_guard import te_import_failure

    return te_import_failure() is None and importlib.util.find_spec("transformer_engine") is not None


def _cuda_initialized() -> bool:
    return bool(getattr(torch.cuda, "is_initialized", lambda: False)())
