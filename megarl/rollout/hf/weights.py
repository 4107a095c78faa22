"""The transformers engine's weights: where each HF checkpoint tensor lives in the live model, how the weight sync
writes there, and how the engine lets its weights go while it sleeps.

A transformers model holds most checkpoint tensors as parameters of the same name; some architectures fuse them
(transformers 5 keeps an MoE layer's experts as two 3-D parameters: `experts.gate_up_proj` [E, 2I, H] with expert e's
gate_proj in rows [0, I) and its up_proj in rows [I, 2I), and `experts.down_proj` [E, H, I]). `weight_targets` maps
every HF name the bridge mapping exports to a view of the parameter that holds it, so an update is one copy per tensor
into the live parameters, with no re-processing (the HF engine is one worker at TP1: every tensor is read whole).

The sync's placed writes (megarl.sync.placement) work unchanged: the parameters move into a shared-memory arena, the
records are found by running `copy_into_targets` under the placement probe, and the hosting trainer rank writes each
piece straight into them, as it does for a vLLM worker with plain CPU weights.
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Iterable, Sequence

import torch

_FUSED_EXPERT = re.compile(r"^(?P<module>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


# checkpoint prefixes a transformers-5 vision-language model holds under other names (Qwen2.5-VL's checkpoint writes
# model.layers.* and visual.*; the model's parameters are model.language_model.* and model.visual.*)
_VL_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def _renamed(params: dict, name: str):
    """The parameter of checkpoint tensor `name` under a vision-language model's own prefix (None: none)."""
    for old, new in _VL_PREFIXES:
        if name.startswith(old) and not name.startswith(new) and new + name[len(old):] in params:
            return params[new + name[len(old):]]
    return None


class UnmappedTensor(ValueError):
    """A checkpoint tensor the transformers model has no parameter for."""


def weight_targets(model: torch.nn.Module, shapes: dict) -> dict:
    """{hf name: the view of the model's parameter that holds it} for every name of `shapes` ({hf name: shape}, the
    bridge mapping's). Raises UnmappedTensor naming the first tensor without a place or with another shape."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, shape in shapes.items():
        view = params.get(name)
        if view is None:
            view = _renamed(params, name)
        m = _FUSED_EXPERT.match(name)
        if view is None and m is not None:
            e, proj = int(m["expert"]), m["proj"]
            fused = params.get(f"{m['module']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
            if fused is not None:
                view = fused[e]
                if proj != "down_proj":
                    half = fused.shape[1] // 2
                    view = view[:half] if proj == "gate_proj" else view[half:]
        if view is None:
            raise UnmappedTensor(f"{type(model).__name__} has no parameter for checkpoint tensor {name}")
        if tuple(view.shape) != tuple(shape):
            raise UnmappedTensor(f"{type(model).__name__}: checkpoint tensor {name} has shape {tuple(shape)}, its "
                                 f"parameter view {tuple(view.shape)}")
        out[name] = view
    return out


def copy_into_targets(targets: dict, named: Iterable[tuple]) -> int:
    """Copy each (hf name, full tensor) into its target view; returns the tensors copied. The one loader of the
    engine: bucket-file loads call it, and the placement probe records where its copies land."""
    n = 0
    with torch.no_grad():
        for name, tensor in named:
            targets[name].copy_(tensor)
            n += 1
    return n


def tied_names(model: torch.nn.Module) -> dict:
    """{alias: canonical} of parameters that share one tensor (a tied LM head: lm_head.weight -> embed_tokens)."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes the parameters' storages hold now (0 for a storage released by `drop_storages`)."""
    seen, total = set(), 0
    for p in model.parameters():
        s = p.untyped_storage()
        key = s._cdata  # the C storage's address: one per storage, whatever Python object wraps it
        if key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def _parameter_storages(model: torch.nn.Module) -> list:
    out, seen = [], set()
    for p in model.parameters():
        s = p.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(s)
    return out


def drop_storages(model: torch.nn.Module, keep_on_host: bool) -> list:
    """Release the parameters' storages (every view of them stays valid and takes memory again on `restore_storages`):
    returns [(storage, size in bytes, host copy or None)]."""
    out = []
    for s in _parameter_storages(model):
        backup = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).to("cpu", copy=True) if keep_on_host \
            else None
        out.append((s, s.nbytes(), backup))
        s.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def restore_storages(dropped: Sequence[tuple]) -> None:
    """Take the memory back (new addresses); copy the host copies in where kept (else the contents are undefined
    until the next weight sync)."""
    for s, size, backup in dropped:
        s.resize_(size)
        if backup is not None:
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(backup)


class Arena:
    """The shared-memory file the parameters live in once the sync places its writes (megarl.sync.placement). Its
    pages can be released while the mappings stay (the engine's and its trainer rank's): `release` punches them out
    (reads give zeros, the next sync's writes take pages again), `resident_bytes` counts what it holds."""

    def __init__(self, path: str, size: int):
        self.size = size
        self.fd = os.open(path, os.O_RDWR)  # kept: the trainer rank unlinks the path once it mapped the file

    def resident_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def release(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        punch_hole, keep_size = 0x02, 0x01
        if libc.fallocate(self.fd, punch_hole | keep_size, 0, self.size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"releasing the engine's weight arena: {os.strerror(err)}")

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
