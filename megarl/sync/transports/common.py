"""What the transports that fill bucket files share: the reused shared-memory slot files and the engine load that
runs in a thread while the next bucket is written."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable, Optional

import torch


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
