"""Trainer states to host memory and back around rollout (actor.offload, critic.offload, ref.offload).

A colocated engine generates on the GPUs the trainer trains on. While it does, the trainer's parameters, gradient
buffers and optimizer states (fp32 main parameters, Adam moments) are idle; moving them to pinned host memory gives the
engine their GPU memory for its KV cache, as verl's Megatron workers do (param_offload, grad_offload,
optimizer_offload).

How: every tensor of a category is a view of some storage (megatron's DDP keeps parameters and main_grad in a few
flat buffers; the distributed optimizer's shards are views of them too), so the unit moved is the storage. `offload`
copies each distinct storage's bytes into its slice of one host staging area and resizes the storage to 0 bytes, which
releases its memory while every view keeps its shape, strides and offset; `onload` resizes it back and copies the bytes
in. Nothing is re-created, so the model, the DDP buckets and the optimizer see the same tensors, bitwise. The same
happens on CPU (the staging area is another allocation; the original storage is released), so the CPU tests measure it.

The staging area is allocated once, at the exact size, and reused by every offload (grown when the states grow: the
optimizer's appear at its first step); on CUDA it is page-locked with cudaHostRegister. torch's pinned allocator
would round each buffer up to a power of two and keep it cached after use, so one buffer per storage per offload
could pin up to twice the states, and a second model's on top. `release()` unpins and frees it.

A storage belongs to the first category that holds it (params, then grads, then optimizer): with float32 weights the
distributed optimizer's main parameters are views of the parameter buffer and move with `params`.

    offloader = StateOffloader(trainable.chunks, trainable.optimizer, params=True, grads=True, optimizer=True)
    stats = offloader.offload()    # {"bytes": ..., "seconds": ..., "freed_bytes": ...}
    ...                            # the engine generates
    offloader.onload()             # before the next forward
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

CATEGORIES = ("params", "grads", "optimizer")


ALIGN = 4096  # each storage's slice of the staging area starts on a page


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    host: Optional[torch.Tensor] = None  # uint8 [nbytes]: its slice of the staging area while offloaded


class Staging:
    """One host buffer reused by every offload: page-locked (pinned) when `pin`, at exactly the bytes asked for."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.pinned = False

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A uint8 buffer of at least nbytes (the one already held when it is large enough)."""
        if self.buffer is None or self.buffer.numel() < nbytes or (pin and not self.pinned):
            self.release()
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
            self.pinned = pin and _register(self.buffer)
        return self.buffer

    def release(self) -> None:
        if self.buffer is not None and self.pinned:
            _unregister(self.buffer)
        self.buffer, self.pinned = None, False

    def __del__(self):  # registered pages go back to the allocator unpinned
        self.release()


def _register(buf: torch.Tensor) -> bool:
    """Page-lock buf for the device's DMA engines (asynchronous copies); False, with the reason logged, if the driver
    refuses (the copies then go through pageable memory: correct, slower)."""
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        import logging

        logging.getLogger("megarl").warning("offload: cudaHostRegister of %.1f GiB failed (%s); the states go to "
                                            "pageable host memory", buf.numel() / 2 ** 30, err)
        return False
    return True


def _unregister(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def _byte_view(storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


def _optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron optimizer (ChainedOptimizer holds several)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is not None:
        return [o for c in inner for o in _optimizers(c)]
    return [getattr(optimizer, "optimizer", optimizer)]


def category_tensors(chunks: Iterable, optimizer=None) -> dict:
    """{category: [tensors]} of a model's chunks and its megatron optimizer."""
    chunks = list(chunks)
    params = [p for c in chunks for p in c.parameters()]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    for c in chunks:  # megatron DDP's flat buffers (main_grad is a view of grad_data; param_data under dist-opt)
        for buf in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", [])):
            if getattr(buf, "param_data", None) is not None:
                params.append(buf.param_data)
            if getattr(buf, "grad_data", None) is not None:
                grads.append(buf.grad_data)
    opt = []
    for o in _optimizers(optimizer):
        for group in o.param_groups:
            opt.extend(p for p in group["params"])  # fp32 main params (or the model's own in fp32)
        for state in o.state.values():
            opt.extend(v for v in state.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optimizer": opt}


def storages(tensors: Iterable[torch.Tensor]) -> dict:
    """{storage key: (storage, device)} of the distinct non-empty storages behind `tensors`."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in out:
            out[s.data_ptr()] = (s, t.device)
    return out


def resident_bytes(chunks: Iterable, optimizer=None) -> int:
    """Bytes currently allocated by the distinct storages of a model's parameters, gradient buffers and optimizer
    states (0 for an offloaded storage): what offloading can free."""
    tensors = [t for ts in category_tensors(chunks, optimizer).values() for t in ts]
    return sum(s.nbytes() for s, _ in storages(tensors).values())


class StateOffloader:
    """Moves the selected categories of one model's states to host memory and back (see the module docstring)."""

    def __init__(self, chunks, optimizer=None, params: bool = True, grads: bool = True, optimizer_states: bool = True):
        self.chunks = list(chunks)
        self.optimizer = optimizer
        self.selected = {"params": params, "grads": grads, "optimizer": optimizer_states}
        self._held: dict = {}  # storage key -> _Held, while offloaded
        self._staging = Staging()
        self.offloaded = False

    def _targets(self) -> list:
        seen: dict = {}
        for category, tensors in category_tensors(self.chunks, self.optimizer).items():
            for key, (s, device) in storages(tensors).items():
                if key not in seen:
                    seen[key] = (category, s, device)
        return [(s, device) for category, s, device in seen.values() if self.selected[category]]

    def offload(self) -> dict:
        """Copy the selected states to host memory and release their device memory. Returns bytes moved, seconds,
        and the device memory freed (CUDA: measured by the allocator after emptying its cache; CPU: the storages'
        bytes released). A no-op when already offloaded."""
        if self.offloaded:
            return {"bytes": 0, "seconds": 0.0, "freed_bytes": 0}
        cuda = torch.cuda.is_available()
        _sync()
        before = torch.cuda.memory_reserved() if cuda else None
        t0 = time.perf_counter()
        held = {}
        targets = self._targets()
        offsets, total = [], 0
        for s, _ in targets:
            offsets.append(total)
            total += -(-s.nbytes() // ALIGN) * ALIGN
        staging = self._staging.take(total, pin=any(device.type == "cuda" for _, device in targets))
        for (s, device), at in zip(targets, offsets):
            n = s.nbytes()
            host = staging[at:at + n]
            host.copy_(_byte_view(s, n, device), non_blocking=device.type == "cuda")
            held[s.data_ptr()] = _Held(s, n, device, host)
        _sync()  # the copies are done before the memory is released
        moved = 0
        for h in held.values():
            h.storage.resize_(0)
            moved += h.nbytes
        if cuda:
            torch.cuda.empty_cache()
        seconds = time.perf_counter() - t0
        self._held = held
        self.offloaded = True
        freed = (before - torch.cuda.memory_reserved()) if cuda else moved
        return {"bytes": moved, "seconds": seconds, "freed_bytes": freed}

    def onload(self) -> dict:
        """Restore every offloaded storage in place, bitwise. Returns bytes moved and seconds. A no-op when nothing
        is offloaded."""
        if not self.offloaded:
            return {"bytes": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        moved = 0
        for h in self._held.values():
            h.storage.resize_(h.nbytes)
            _byte_view(h.storage, h.nbytes, h.device).copy_(h.host, non_blocking=h.device.type == "cuda")
            moved += h.nbytes
        _sync()
        self._held = {}
        self.offloaded = False
        return {"bytes": moved, "seconds": time.perf_counter() - t0}

    def release(self) -> None:
        """Free the host staging area (onloaded first if offloaded): for a model that is not offloaded again."""
        self.onload()
        self._staging.release()

    def staging_bytes(self) -> int:
        """Host bytes the staging area holds now (0 once released)."""
        return 0 if self._staging.buffer is None else self._staging.buffer.numel()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
