"""The engine host's end of a remote weight transfer (rollout.mode=ray, rollout.placement=separate): receives the
pieces its workers need from the trainer ranks over the transfer group (megarl.sync.transfer) into each worker's
bucket file (megarl.sync.wire), and loads them through the engine's worker extension while the next bucket arrives.
The trainer's end is megarl.sync.transports.remote.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megarl.sync.boxes import box_shape, full_box, relative_slices
from megarl.sync.delta import DENSE, ENTRY, apply, checksum, payload
from megarl.sync.transfer import ReceivePlan, TransferSpec, join_group, leave_group, piece_key
from megarl.sync.wire import layout_bucket, region, shm_dir


@dataclass
class _Posted:
    files: dict
    buffers: dict
    works: list
    copies: list = field(default_factory=list)
    nbytes: int = 0
    changes: list = field(default_factory=list)  # delta: (mirror, header entry, tensors) to apply once received
    arrivals: list = field(default_factory=list)  # delta over NCCL: (host tensor, device buffer received into)


class WeightReceiver:
    """Receives the weights of one engine replica from the trainer ranks and loads them through the engine's worker
    extension (begin_update / load_bucket / end_update; a failure aborts the update and the engine keeps its
    previous weight version). Lives in the engine host, next to its VLLMEngine."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.group = None
        self.plan: Optional[ReceivePlan] = None
        self.mirror: dict = {}  # delta: {(bucket, move index): what the workers last received of the piece}

    def join(self, spec: TransferSpec, rank: int) -> None:
        self.group = join_group(spec, rank)

    def leave(self) -> None:
        """Leave the transfer group (another engine host restarted: the trainer forms a new one with the same plan,
        RemoteSync.rejoin). The mirror stays: this host's next update can be a delta one."""
        group, self.group = self.group, None
        leave_group(group)

    def receive(self, sync: int, verify=False) -> dict:
        """One sync: every bucket with pieces for this host, received while the previous one loads. verify: what the
        workers check after loading (the engine's begin_update: True, False or the HF names to check)."""
        if self.group is None or self.plan is None:
            raise RuntimeError("receive_weights before the transfer group was joined and the receive plan was set")
        t0 = time.perf_counter()
        stats = {"received": 0, "receive_s": 0.0, "load_s": 0.0}
        todo = [b for b, moves in enumerate(self.plan.buckets) if moves]
        self.engine.begin_update(verify=verify)
        try:
            posted = self._post(sync, todo[0]) if todo else None
            for i, b in enumerate(todo):
                files = self._finish(posted, stats)
                posted = self._post(sync, todo[i + 1]) if i + 1 < len(todo) else None
                t1 = time.perf_counter()
                self.engine.load_bucket([files[w].meta if w in files else None for w in self.plan.workers])
                stats["load_s"] += time.perf_counter() - t1
        except BaseException:
            self.engine.abort_update()
            self._remove_files(sync)
            self._break_group()
            raise
        metrics = self.engine.end_update()
        sums = ({piece_key(b, mv): checksum(self.mirror[(b, j)]) for b in todo
                 for j, mv in enumerate(self.plan.buckets[b])} if self.plan.delta else {})
        # loaded: what the workers report they loaded (their shards), counted apart from what arrived
        return {"metrics": metrics, "received": stats["received"], "loaded": int(metrics["weight_sync/engine_bytes"]),
                "receive_s": stats["receive_s"], "load_s": stats["load_s"], "seconds": time.perf_counter() - t0,
                "sums": sums}

    def _break_group(self) -> None:
        """Close this end of the transfer group after a failed sync, so that trainer ranks waiting to send to this
        host fail at once instead of at the group's timeout (the run stops; the group is not used again)."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - best effort: the error being raised says what went wrong
                pass

    def _path(self, sync: int, b: int, worker: int) -> str:
        return os.path.join(shm_dir(), f"megarl-{self.plan.token}-s{sync}-b{b}-w{worker}")

    def _post(self, sync: int, b: int) -> _Posted:
        plan = self.plan
        moves = plan.buckets[b]
        posted = _Posted({}, {}, [])
        for w in plan.workers:
            if any(mv.dst == w for mv in moves):
                f = layout_bucket(moves, w, self._path(sync, b, w), plan.shapes, plan.dtypes, plan.needs[w])
                posted.files[w] = f
                posted.buffers[w] = torch.from_file(f.path, shared=True, size=f.size, dtype=torch.uint8)
        if plan.delta:
            self._post_delta(b, posted)
            return posted
        for mv in moves:
            target = self._target(posted, mv)
            into = target
            if plan.device != "cpu" or not target.is_contiguous():
                into = torch.empty(box_shape(mv.box), dtype=target.dtype, device=plan.device)
                posted.copies.append((target, into))
            posted.works.append(self.group.recv([into], mv.src, b))
            posted.nbytes += mv.nbytes
        return posted

    def _target(self, posted: _Posted, mv) -> torch.Tensor:
        """Where piece `mv` goes in its worker's bucket file."""
        offset, dtype, shape = posted.files[mv.dst].regions[mv.hf]
        return region(posted.buffers[mv.dst], dtype, shape, offset)[relative_slices(mv.box, full_box(shape))]

    def _post_delta(self, b: int, posted: _Posted) -> None:
        """Bucket b of a delta-capable sync: each sender's header first (one megarl.sync.delta entry per piece it sends
        this host, in bucket order), then the pieces whole (received straight into the mirror, in host memory) or
        their changes; _finish applies those and writes the mirror into the files."""
        plan = self.plan
        moves = list(enumerate(plan.buckets[b]))
        senders = sorted({mv.src for _, mv in moves})
        headers = {src: torch.empty((sum(1 for _, mv in moves if mv.src == src), ENTRY), dtype=torch.int64)
                   for src in senders}
        waiting = _Posted({}, {}, [])
        for src in senders:
            waiting.works.append(self._recv_into(headers[src], src, b, waiting))
        self._finish_arrivals(waiting)
        for src in senders:
            for entry, (j, mv) in zip(headers[src].tolist(), [(j, mv) for j, mv in moves if mv.src == src]):
                entry = tuple(entry)
                dtype = getattr(torch, plan.dtypes[mv.hf])
                mirror = self.mirror.get((b, j))
                if entry[0] == DENSE and mirror is None:
                    mirror = self.mirror[(b, j)] = torch.empty(box_shape(mv.box), dtype=dtype)
                elif mirror is None:
                    raise RuntimeError(f"delta weight update of {mv.hf} (bucket {b}) without a full update before it "
                                       f"on this engine host: the trainer must send a full update after a restart")
                if entry[0] == DENSE:
                    tensors = [mirror.view(-1)]  # received in place: apply has nothing to copy
                else:
                    tensors = [torch.empty(n, dtype=dt) for n, dt in payload(entry, mirror.numel(), dtype)]
                posted.works += [self._recv_into(t, src, b, posted) for t in tensors]
                posted.nbytes += sum(t.numel() * t.element_size() for t in tensors)
                posted.changes.append((mirror, entry, tensors))
                posted.copies.append((self._target(posted, mv), mirror))

    def _recv_into(self, host: torch.Tensor, src: int, b: int, posted: _Posted):
        """Receive into the host tensor `host`: directly over gloo; over NCCL into a device buffer copied to it once
        the receive completed (_finish_arrivals)."""
        if self.plan.device == "cpu":
            return self.group.recv([host], src, b)
        staging = torch.empty_like(host, device=self.plan.device)
        posted.arrivals.append((host, staging))
        return self.group.recv([staging], src, b)

    @staticmethod
    def _finish_arrivals(posted: _Posted) -> None:
        for work in posted.works:
            work.wait()
        posted.works.clear()
        for host, staging in posted.arrivals:
            host.copy_(staging)
        posted.arrivals.clear()

    def _finish(self, posted: _Posted, stats: dict) -> dict:
        t0 = time.perf_counter()
        self._finish_arrivals(posted)
        for mirror, entry, tensors in posted.changes:
            apply(mirror, entry, tensors)
        for target, piece in posted.copies:
            target.copy_(piece)
        posted.buffers.clear()  # the workers map the files themselves
        stats["received"] += posted.nbytes
        stats["receive_s"] += time.perf_counter() - t0
        return posted.files

    def _remove_files(self, sync: int) -> None:
        """After a failed sync: the bucket files the workers never mapped (a worker unlinks each file it maps)."""
        for b in range(len(self.plan.buckets)):
            for w in self.plan.workers:
                try:
                    os.unlink(self._path(sync, b, w))
                except FileNotFoundError:
                    pass
