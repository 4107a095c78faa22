"""Live tensor bytes of this process, and their peak since a reset: what `megarl plan --measure` reads on CPU.

The mechanism is torch's own MemTracker's (torch.distributed._tools.mem_tracker): a TorchDispatchMode sees every
operator's output tensors; each new untyped storage is counted once, by its nbytes, and a weakref callback on the
storage takes its bytes off when it is freed (views share their base's storage, so they count nothing); storages
resized in place (torch.UntypedStorage.resize_, which no dispatch mode sees) are re-counted. MemTracker itself is not
used: it also hooks every module's forward and backward to attribute bytes per module and category (a snapshot copy
per module at each new peak, a cost on every operator), and its peak cannot be reset between phases.

What it counts: the storages created while it is active (models built inside it count whole: parameters, gradient
buffers, optimizer states, activations, temporaries that are an operator's output). What it does not: memory inside a
single operator's kernel that never becomes a tensor, tensors made outside it (e.g. torch.frombuffer over a file),
storages made while `paused()` (another process's memory this one maps, e.g. an engine's parameters the weight sync
writes; not later through views of them either), and the allocator's or runtime's own bytes (process RSS counts
those, and at small sizes they dominate it).
On CUDA the caching allocator's statistics are exact and cheap: megarl.plan.measure.PhaseMeter reads them instead.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from functools import wraps
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the live tensor storages created on `device_type` while the mode is active; `peak` the most at once
    since the last `reset_peak()`.

        with LiveTensorBytes() as live:
            model = build()            # counted
            live.reset_peak()
            run_phase(model)
            phase_peak = live.peak     # bytes
    """

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()  # storage -> [nbytes counted, weakref whose callback uncounts it]
        self._orig_resize = None
        self.counting = True
        self._foreign = WeakIdKeyDictionary()  # storages made while paused: never counted, not even through a view

    def reset_peak(self) -> int:
        """Start a new phase: the peak restarts at the bytes live now (returned)."""
        self.peak = self.current
        return self.current

    def _add(self, st: torch.UntypedStorage) -> None:
        entry = self._seen.get(st)
        size = st.nbytes()
        if entry is not None:
            if entry[0] != size:  # grown or shrunk in place since it was counted
                self.current += size - entry[0]
                entry[0] = size
        else:
            box = [size, None]
            box[1] = weakref.ref(st, lambda _ref, box=box: self._free(box))
            self._seen[st] = box
            self.current += size
        self.peak = max(self.peak, self.current)

    def _free(self, box: list) -> None:
        self.current -= box[0]
        box[0] = 0

    @contextmanager
    def paused(self):
        """Storages made inside are not counted, ever, nor later through views of them (e.g. another process's
        memory this one maps: an engine's parameters that the weight sync writes)."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors made outside the mode (e.g. before it was entered)."""
        for t in tensors:
            self._count(t)

    def _count(self, t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == self.device_type and not t.is_meta:
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
                return
            if st not in self._foreign:
                self._add(st)

    def __enter__(self):
        self._orig_resize = orig = torch.UntypedStorage.resize_

        @wraps(orig)
        def resize_(st, size):
            out = orig(st, size)
            if st in self._seen:
                self._add(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if self.counting:
                self._count(t)
            elif isinstance(t, torch.Tensor) and t.device.type == self.device_type and not t.is_meta:
                try:
                    st = t.untyped_storage()
                except (NotImplementedError, RuntimeError):
                    continue
                if st not in self._seen:
                    self._foreign[st] = True
        return out

