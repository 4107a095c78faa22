"""What the transports that fill bucket files share: the layouts of the reused slot files, their mappings, the engine
load that runs in a thread while the next bucket is written, and the per-rank traffic metrics.

Bucket files are reused: each receiving rank writes its buckets alternately into two shared-memory slot files, sized
once from the plan, which it and its worker keep mapped for the whole run (the worker unlinks each file when it first
maps it, so nothing is left in /dev/shm). A fresh file per bucket cost a page fault per 4 KiB written and a page free
per 4 KiB released, several times the copy itself; a reused slot costs the copy alone. The worker copies out whatever
vLLM still buffers from a slot (a layer whose tensors straddle buckets) before the slot is written again.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable, Optional, Sequence

import torch

from megarl.distributed import all_gather_objects
from megarl.sync.wire import ALIGN, BucketFile, layout_bucket, shm_dir


class SlotFiles:
    """The shared-memory files one writer fills for its engine workers, kept mapped between buckets and syncs.

    `file(path, size)` maps `path` (created at `size` bytes) the first time it is named and returns the same mapping
    after; the worker unlinks the file once it mapped it, and both mappings stay valid."""

    def __init__(self, device: Optional[torch.device] = None):
        self.mapped: dict = {}
        self.device = device  # a GPU: the "files" are device buffers its worker opens over CUDA IPC (megarl.sync.pull)

    def file(self, path: str, size: int) -> torch.Tensor:
        buf = self.mapped.get(path)
        if buf is None or buf.numel() < size:
            if self.device is not None:
                buf = self.mapped[path] = torch.empty(size, dtype=torch.uint8, device=self.device)
            else:
                buf = self.mapped[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return buf

    def drop(self, paths: Optional[Iterable[str]] = None) -> None:
        """Forget the mappings (of `paths`, default all) and remove their files where no worker unlinked them yet."""
        for path in list(self.mapped) if paths is None else list(paths):
            self.mapped.pop(path, None)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class BackgroundLoad:
    """engine.load_bucket in a thread, one bucket at a time, so that the next bucket is written (into the other slot)
    while the engine loads this one. `wait()` before any other call to the engine: calls never overlap."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.seconds = 0.0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, metas: list) -> None:
        self.wait()

        def load():
            t0 = time.perf_counter()
            try:
                self.engine.load_bucket(metas)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait() in the caller's thread
                self._error = exc
            self.seconds += time.perf_counter() - t0

        self._thread = threading.Thread(target=load, name="megarl-bucket-load", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the load in flight ended; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class BucketLayouts:
    """Where each bucket's pieces lie in the slot files of every host: buckets alternate between a host's two slot
    files, each sized for the largest bucket it carries, so every rank derives the same names and sizes from the plan.

    buckets: the moves of each bucket that go through files (not placed); needs: {host: {hf name: box}}."""

    def __init__(self, token: str, buckets: Sequence[list], shapes: dict, dtypes: dict, needs: dict):
        self.token, self.buckets, self.shapes, self.dtypes, self.needs = token, buckets, shapes, dtypes, needs
        self.hosts = [{mv.dst for mv in moves} for moves in buckets]  # per bucket: the hosts that get a file
        self._files: dict = {}  # (bucket, host) -> BucketFile
        self._slot_size: dict = {}  # (host, slot) -> bytes

    def path(self, slot: int, host: int) -> str:
        return os.path.join(shm_dir(), f"megarl-{self.token}-r{host}-slot{slot}")

    def paths(self, hosts: Sequence[int]) -> list:
        return [self.path(slot, host) for slot in (0, 1) for host in hosts]

    def file(self, b: int, host: int) -> BucketFile:
        """Bucket b's layout in the slot file of `host`."""
        key = (b, host)
        if key not in self._files:
            slot = b % 2
            if (host, slot) not in self._slot_size:
                self._slot_size[(host, slot)] = max((self._layout(i, host, "").size
                                                     for i in range(slot, len(self.buckets), 2)), default=ALIGN)
            f = self._layout(b, host, self.path(slot, host))
            f.size = self._slot_size[(host, slot)]
            f.meta.update(size=f.size, slot=f.path)
            self._files[key] = f
        return self._files[key]

    def _layout(self, b: int, host: int, path: str) -> BucketFile:
        return layout_bucket(self.buckets[b], host, path, self.shapes, self.dtypes, self.needs.get(host, {}))


def delivery_metrics(stats: dict, seconds: float, buckets: int, plan: dict) -> dict:
    """The sync's figures over every rank (a collective): bytes sent, received and loaded against the plan's
    ({kind: {rank: bytes}}), placed bytes, seconds."""
    # four numbers per rank: host objects over gloo (an NCCL group takes device tensors only)
    mine = [float(stats[k]) for k in ("sent", "received", "loaded", "placed")]
    every = torch.tensor(all_gather_objects(mine), dtype=torch.float64)
    out = {"weight_sync/seconds": seconds, "weight_sync/exchange_seconds": stats["exchange_s"],
           "weight_sync/engine_load_seconds": stats["load_s"], "weight_sync/num_buckets": float(buckets)}
    for i, kind in enumerate(("sent", "received", "loaded")):
        out[f"weight_sync/{kind}_bytes_max"] = float(every[:, i].max())
        out[f"weight_sync/{kind}_bytes_rank0"] = float(every[0, i])
        out[f"weight_sync/plan_{kind}_bytes_max"] = float(max(plan[kind].values(), default=0))
        out[f"weight_sync/plan_{kind}_bytes_rank0"] = float(plan[kind].get(0, 0))
    out["weight_sync/bytes"] = float(every[:, 2].sum())
    out["weight_sync/placed_bytes"] = float(every[:, 3].sum())  # of those, written into engine parameters directly
    out["weight_sync/gbps"] = out["weight_sync/bytes"] / seconds / 1e9 if seconds > 0 else 0.0
    return out
