"""The full-tensor feed: a stream of buckets of FULL HF-named tensors (the bridge's export, a state dict) into an
engine in one process, each worker still receiving only its own shard of each tensor through the same bucket files
and worker extension as the trainer's delivery. For `megarl verify`, tests, benches and the engines' own
`load_weights`.

    feed = FullTensorFeed(model_path)          # kept by the engine handle that feeds itself (its update_weights)
    metrics = feed.run(engine, buckets)        # engine: layouts / begin_update / load_bucket / end_update / abort
"""
from __future__ import annotations

import os
import secrets
import time
from typing import Any, Iterable, Optional, Sequence


from megarl.bridge.mapping import Mapping
from megarl.sync.boxes import box_numel, full_box, relative_slices
from megarl.sync.moves import Move
from megarl.sync.shards import worker_needs
from megarl.sync.transports.common import BackgroundLoad, SlotFiles
from megarl.sync.wire import half_threads_during_sync, layout_bucket, region, shm_dir


class FeedSlots:
    """The reused slot files of the feed into one engine (two per worker, buckets alternate between them; a slot
    grows, under a new file name, when a bucket needs more than it has)."""

    def __init__(self, layouts: Sequence[dict], mapping: Mapping):
        self.prefix = os.path.join(shm_dir(), f"megarl-feed-{secrets.token_hex(4)}")
        self.needs = [worker_needs(mapping, lay) for lay in layouts]
        self.files = SlotFiles()
        self.current: dict = {}  # (worker, slot) -> (path, size)
        self.bucket = 0  # buckets written so far: picks the slot
        self.grown = 0

    def slot_name(self, w: int) -> str:
        return f"{self.prefix}-w{w}-slot{self.bucket % 2}"

    def file(self, w: int, size: int) -> tuple:
        key = (w, self.bucket % 2)
        path, have = self.current.get(key, (None, 0))
        if have < size:
            if path is not None:
                self.files.drop([path])
            self.grown += 1
            path, have = self.current[key] = (f"{self.slot_name(w)}-g{self.grown}", size)
        return path, have, self.files.file(path, have)

    def write(self, named: Sequence[tuple]) -> list:
        """Every worker's bucket file of one bucket of full HF tensors [(name, tensor)]: its metas for megarl_load
        (None for a worker that reads nothing of it)."""
        tensors = dict(named)
        dtypes = {name: str(t.dtype).replace("torch.", "") for name, t in named}
        shapes = {name: tuple(t.shape) for name, t in named}
        metas = []
        for w, needs in enumerate(self.needs):
            moves = [Move(name, 0, w, needs[name], full_box(t.shape), box_numel(needs[name]) * t.element_size())
                     for name, t in named if name in needs]
            if not moves:
                metas.append(None)
                continue
            f = layout_bucket(moves, w, "", shapes, dtypes, needs)
            f.path, f.size, buf = self.file(w, f.size)
            f.meta.update(path=f.path, size=f.size, slot=self.slot_name(w))
            for mv in moves:
                offset, dtype, shape = f.regions[mv.hf]
                sl = relative_slices(mv.box, full_box(shape))
                region(buf, dtype, shape, offset)[sl].copy_(tensors[mv.hf][sl])
            metas.append(f.meta)
        self.bucket += 1
        return metas


class FullTensorFeed:
    """Feeds one engine from streams of full-tensor buckets; its slot files are made at the first feed and kept
    (dropped after a failed one)."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.slots: Optional[FeedSlots] = None

    def run(self, engine: Any, buckets: Iterable, verify: bool = False) -> dict:
        """Load a stream of buckets of FULL HF-named tensors [(name, tensor)] into `engine`; returns its metrics."""
        from megarl.bridge.hf_config import load_spec

        if self.slots is None:
            self.slots = FeedSlots(engine.layouts, Mapping(load_spec(self.model_path)))
        stats = {"bytes": 0, "buckets": 0, "max_bucket": 0, "source_s": 0.0, "write_s": 0.0}
        t0 = time.perf_counter()
        loading = BackgroundLoad(engine)
        engine.begin_update(verify=verify)
        try:
            it = iter(buckets)
            with half_threads_during_sync():
                while True:
                    t_pull = time.perf_counter()
                    bucket = next(it, None)
                    stats["source_s"] += time.perf_counter() - t_pull
                    if bucket is None:
                        break
                    bucket = list(bucket)
                    size = sum(t.numel() * t.element_size() for _, t in bucket)
                    stats["bytes"] += size
                    stats["buckets"] += 1
                    stats["max_bucket"] = max(stats["max_bucket"], size)
                    t_write = time.perf_counter()  # while the engine loads the previous bucket from the other slot
                    metas = self.slots.write(bucket)
                    stats["write_s"] += time.perf_counter() - t_write
                    loading.start(metas)  # waits for the previous load first
                loading.wait()
        except BaseException:
            try:
                loading.wait()  # the engine takes one call at a time
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
            slots, self.slots = self.slots, None
            slots.files.drop()  # a worker unlinks what it maps; remove what a failed load left
            engine.abort_update()
            raise
        metrics = engine.end_update()
        seconds = time.perf_counter() - t0
        metrics.update({"weight_sync/bytes": float(stats["bytes"]), "weight_sync/seconds": seconds,
                        "weight_sync/source_seconds": stats["source_s"],
                        "weight_sync/load_seconds": seconds - stats["source_s"],
                        "weight_sync/write_seconds": stats["write_s"],
                        "weight_sync/num_buckets": float(stats["buckets"]),
                        "weight_sync/max_bucket_bytes": float(stats["max_bucket"]),
                        "weight_sync/gbps": stats["bytes"] / seconds / 1e9 if seconds > 0 else 0.0})
        return metrics
