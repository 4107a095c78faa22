"""Pulled writes: the weights into a colocated GPU engine without leaving the GPU.

On GPU a trainer rank and the engine worker it hosts share one device. The worker copies each piece of its shard from
the trainer rank's device memory straight into its own parameters, at the places vLLM's own loader would put it (the
placement records of megarl.sync.placement, found the same way as on CPU): one device-to-device copy per piece, no
host round trip, no loader walk per sync.

Why the worker pulls, where on CPU the trainer rank pushes into the worker's arena:
* vLLM's sleep mode allocates the weights from its cumem pool (physical memory mapped into reserved addresses with
  cuMemMap). torch's CUDA IPC cannot export that memory (its pluggable-allocator path has no IPC handle), and every
  sleep unmaps it and every wake maps new physical memory: a handle to it would go stale at each wake.
* The trainer's tensors come from torch's caching allocator, which torch's CUDA IPC exports; the handles are made at
  every sync from the live tensors, and torch does not reuse a sent block while a receiver still holds it.
So a stale handle cannot occur by construction: nothing of the worker's memory leaves its process (it resolves its
own parameter storages at every load and checks them against the placement), and the trainer's handles are fresh.

Per bucket, what crosses the worker's RPC is small: one handle per trainer storage the pieces lie in (the rank's
parameter storages, the buffers of pieces received from other ranks) and, per piece, (hf name, box, view spec).
The same code runs on CPU tensors (torch shares them through shared memory), which is how it is tested without a GPU.
"""
from __future__ import annotations

import inspect
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Optional, Sequence

import torch

from megarl.sync.boxes import Box
from megarl.sync.placement import parameter_regions, region_viewer, write_placed


def _storage_key(t: torch.Tensor) -> tuple:
    return t.device.type, t.device.index, t.untyped_storage().data_ptr()


class PullSources:
    """Trainer side: the storages the pieces of one bucket lie in, and each piece's view spec in them.

    `spec(view)` registers the storage of `view` and returns (source index, byte offset, sizes, strides, dtype);
    `meta(pieces)` is what the worker's load takes. The tensors stay referenced here until `release()`: torch's CUDA
    IPC wants the sender to keep a tensor while a receiver may still read it."""

    def __init__(self):
        self.index: dict = {}
        self.storages: list = []

    def spec(self, view: torch.Tensor) -> tuple:
        key = _storage_key(view)
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.storages)
            self.storages.append(torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage()))
        return (i, view.storage_offset() * view.element_size(), tuple(view.shape), tuple(view.stride()),
                str(view.dtype).replace("torch.", ""))

    def meta(self, pieces: Sequence[tuple]) -> dict:
        """{"sources": [handle of each storage], "pieces": [(hf name, box, spec)]}: the worker's pull for a bucket.
        On GPU every write into the sources must have finished (the caller synchronizes its device first)."""
        return {"sources": [bytes(ForkingPickler.dumps(s)) for s in self.storages], "pieces": list(pieces)}

    def handle(self, tensor: torch.Tensor) -> bytes:
        """A handle of a whole tensor (a device bucket its worker reads with its loaders), kept like the sources."""
        self.storages.append(tensor)
        return bytes(ForkingPickler.dumps(tensor))

    def release(self) -> None:
        self.index.clear()
        self.storages.clear()


_CUDA_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


class _OnThisDevice(pickle.Unpickler):
    """Unpickles torch.multiprocessing's tensors, opening CUDA ones on `device` instead of the sender's index."""

    def __init__(self, blob: bytes, device: Optional[int]):
        super().__init__(io.BytesIO(blob))
        self.device = device

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name)
        if (module, name) != _CUDA_REBUILD:
            return found
        at = list(inspect.signature(found).parameters).index("storage_device")

        def rebuild(*args):
            args = list(args)
            args[at] = torch.cuda.current_device() if self.device is None else self.device
            return found(*args)
        return rebuild


def open_shared(blob: bytes, device: Optional[int] = None) -> torch.Tensor:
    """A tensor another process shared with torch.multiprocessing's pickler (CUDA IPC for a device tensor, shared
    memory for a host one), opened here. A CUDA tensor opens on this process's current device (`device`: that index
    instead): the handle names its GPU by the sender's index, and an engine process that CUDA_VISIBLE_DEVICES gives
    only its replica's GPUs (megarl.layout.engine_devices) numbers them from 0. The pull reads its host rank's memory,
    which is on the worker's own GPU."""
    return _OnThisDevice(blob, device).load()


class PulledWrites:
    """Worker side: this worker's placement records and the sizes of the parameter storages they were recorded in.

    `load(params, meta)` opens the sources of one bucket and copies every piece into the parameters, then waits for
    the device, so the trainer may write its memory again once the call returned. The parameter storages are taken
    from `params` at every load, so memory that sleep/wake re-mapped (or that was re-allocated) is found anew; a
    layout that no longer matches the records is an error, never a write to a wrong place."""

    def __init__(self, records: dict, region_sizes: Sequence[int]):
        self.records = records
        self.region_sizes = [int(n) for n in region_sizes]
        # the sources opened during one update, kept until it ends (`release`): the trainer's parameter storages come
        # back in every bucket, and torch re-uses an opened handle only while a tensor of it is alive
        self._kept: dict = {}

    def regions(self, params: Sequence[torch.Tensor]) -> list:
        regions = parameter_regions(params)
        sizes = [r.numel() for r in regions]
        if sizes != self.region_sizes:
            raise RuntimeError(f"the engine worker's parameter storages changed since their placement was recorded "
                               f"({len(sizes)} storages of {sum(sizes)} bytes, recorded {len(self.region_sizes)} of "
                               f"{sum(self.region_sizes)}): re-plan the weight sync")
        return regions

    def load(self, params: Sequence[torch.Tensor], meta: dict) -> int:
        """Copy one bucket's pieces; returns the bytes written."""
        dst = region_viewer(self.regions(params))
        sources = [self._open(blob) for blob in meta["sources"]]
        src = region_viewer(sources)
        written = 0
        with torch.no_grad():
            for hf, box, spec in meta["pieces"]:
                written += write_placed(dst, self.records[hf], _box(box), src(tuple(spec)))
        device = sources[0].device if sources else None
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return written

    def _open(self, blob: bytes) -> torch.Tensor:
        t = open_shared(blob)
        self._kept[(t.device, t.data_ptr(), t.numel())] = t
        return t

    def release(self) -> None:
        """Let go of the host rank's memory opened during this update (it may free it: offload before rollout)."""
        self._kept = {}


def _box(box) -> Box:
    return tuple(tuple(int(v) for v in b) for b in box)


def records_from_report(placed: dict) -> dict:
    """Placement records as they come back from a worker's report (lists) -> tuples."""
    return {h: [(_box(rec[0]),) + (int(rec[1]), int(rec[2]), tuple(rec[3]), tuple(rec[4]), rec[5]) for rec in recs]
            for h, recs in placed.items()}


def pull_device(params: Sequence[torch.Tensor]) -> Optional[str]:
    """Why the worker with these parameters cannot pull its weights (None: it can): they must all be on one GPU."""
    devices = {p.device for p in params if p.numel()}
    if len(devices) != 1:
        return f"its parameters are on {len(devices)} devices"
    device = next(iter(devices))
    return None if device.type == "cuda" else f"its parameters are on {device.type}, not a GPU"
