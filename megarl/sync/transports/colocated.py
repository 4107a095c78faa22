"""Per-rank weight delivery: every engine worker receives only its own shard, from the trainer ranks that hold it.

    trainer rank k ──(its HF chunks, cut to the pieces each worker needs)──► rank hosting the worker (p2p, gloo)
    hosting rank ──(pieces written into a sparse shared-memory bucket file)──► its engine worker (megarl_load)

The plan (megarl.sync.shards, megarl.sync.moves) is computed once from the bridge mapping, the trainer's parameters
and the layout each engine worker reports; every rank derives the same moves and buckets from it, so no metadata
travels per step. A rank sends only pieces of its own parameters and receives only pieces its worker loads; nothing
gathers whole tensors, nothing is broadcast to the world.

Bucket files are reused slots (megarl.sync.transports.common).

Where a CPU engine worker takes its weights in place, its host writes straight into the worker's parameters instead
(megarl.sync.transports.placed): one copy per piece, no bucket file, no load call; on GPU the worker pulls them.

Everything an update needs is compiled once, when the sync is planned (`_Bucket`, one per bucket, this rank's part):
the pieces it sends, receives and writes, each of its own pieces as strided views of its parameter
(megarl.sync.copies), and its bucket file's layout. An update resolves each parameter's current storage (an offload
may have moved it) and copies; it never consults the mapping, the holdings or the shards again.

Engine placement (megarl.rollout.replicas.EngineTopology): replica r spans trainer ranks [r*T, (r+1)*T) (T = engine
TP); worker w of the replica is hosted by rank r*T + w, and the replica's first rank owns the engine process.
"""
from __future__ import annotations

import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.distributed import all_gather_objects
from megarl.layout import EngineTopology
from megarl.sync.boxes import box_shape
from megarl.sync.copies import current_value, region_target
from megarl.sync.holdings import Holdings
from megarl.sync.moves import bucket_moves
from megarl.sync.plan import live_plan
from megarl.sync.shards import SyncTable, worker_needs
from megarl.sync.transports.common import BackgroundLoad, BucketLayouts, SlotFiles, delivery_metrics
from megarl.sync.transports.placed import PlacedWrites
from megarl.sync.wire import BucketFile, half_threads_during_sync


@dataclass
class _Bucket:
    """This rank's part of one bucket, compiled at plan time: pieces of its parameters it sends [(Move, Cut)], pieces
    for its worker from other ranks [(Move, dtype)], its own pieces for its worker [(Move, Cut, placed)], its bucket
    file (None where all is placed) and each piece's place in it {Move: Target}, and whether its replica's engine
    loads this bucket."""

    sends: list
    recvs: list
    own: list
    file: Optional[BucketFile]
    targets: dict
    loads: bool


class WeightSync:
    """The live weight sync of one trainer (every rank builds one, with the same arguments).

    holdings: the mapping and every rank's parameters (megarl.sync.holdings, built once per run); layouts: {hosting
    rank: what its engine worker reported (megarl_layout)}; engine: this rank's engine handle if it owns a replica.
    Building it is a collective (the workers say what they take in place) that compiles every bucket once."""

    def __init__(self, holdings: Holdings, layouts: dict, topology: EngineTopology, bucket_bytes: int, rank: int,
                 token: str, engine: Any, group=None):
        self.holdings, self.topology, self.rank, self.group = holdings, topology, rank, group
        self.shapes, self.dtypes = SyncTable.of(holdings.mapping).shapes, holdings.hf_dtypes
        self.worker_layouts = layouts
        self.needs = {host: worker_needs(holdings.mapping, lay) for host, lay in layouts.items()}
        self.sync_plan = live_plan(holdings.mapping, holdings.boxes, self.needs, holdings.element_sizes,
                                   dist.get_world_size() if dist.is_initialized() else 1, topology.engine_tp,
                                   topology.replicas)  # megarl plan's own plan object
        self.buckets = bucket_moves(self.sync_plan.moves, bucket_bytes)
        self.plan_sent, self.plan_received, self.plan_loaded = self.sync_plan.traffic()
        self.token = token  # the same on every rank: it names the bucket files a host writes and its worker reads
        self.syncs = 0
        self.device = holdings.device
        self.placed = PlacedWrites(rank, self.device)
        self._files = SlotFiles()
        self._replica_groups = [dist.new_group(topology.members(r), backend="gloo")
                                for r in range(topology.replicas)] if dist.is_initialized() else []
        self._cuts = holdings.cuts([mv for moves in self.buckets for mv in moves if mv.src == rank])
        self._place(engine)

    def _place(self, engine: Any) -> None:
        """Once, before the first sync (a collective): the workers that take their weights in place say which
        (megarl.sync.transports.placed); the buckets are compiled for what is left to the files."""
        self.placed.place(engine, self.topology, self._wire_needs(), self.token)
        if self.placed.pulling:  # what its worker loads with its loaders comes in device buckets, not files
            self._files = SlotFiles(self.device)
        self._compile()

    def _wire_needs(self) -> dict:
        return {host: {h: (self.dtypes[h], list(self.shapes[h]), [list(b) for b in box]) for h, box in need.items()}
                for host, need in self.needs.items()}

    def after_restart(self, engine: Any, replicas: set) -> None:
        """The engines of `replicas` were restarted (a collective of every rank; `engine`: this rank's handle if it
        owns a replica): the new workers say what they take in place and the buckets are compiled again for that.
        The plan, its moves and the other replicas' placement stay as compiled at start; the new workers must report
        the layouts the old ones did (the same engine settings)."""
        replica = self.topology.replica_of(self.rank)
        mine = engine if replica in replicas else None
        if mine is not None:
            first = self.topology.owner(replica)
            for w, layout in enumerate(mine.layouts):
                if layout != self.worker_layouts.get(first + w):
                    raise RuntimeError(f"the restarted engine replica {replica}'s worker {w} reports another parameter "
                                       f"layout than its predecessor's: the sync plan compiled at start no longer "
                                       f"fits; resume from the last checkpoint")
        self.placed.forget({h for r in replicas for h in self.topology.members(r)})
        self.placed.place(mine, self.topology, self._wire_needs(), self.token)
        if self.placed.pulling and self._files.device is None:
            self._files = SlotFiles(self.device)
        self._compile()

    def _compile(self) -> None:
        """Every bucket's part of this rank (_Bucket), for the placement as it stands."""
        self.layouts = BucketLayouts(self.token, [[mv for mv in moves if not self.placed.is_placed(mv)]
                                                  for moves in self.buckets], self.shapes, self.dtypes, self.needs)
        replica = self.topology.replica_of(self.rank)
        hosts = set(self.topology.members(replica)) if replica is not None else set()
        self._pull_hosts = [{mv.dst for mv in moves if mv.dst in self.placed.pull_hosts} for moves in self.buckets]
        self._leftovers = self.layouts.paths(sorted(hosts))  # what a failed sync may leave of the replica's slots
        self.plan = []
        for b, moves in enumerate(self.buckets):
            own = [mv for mv in moves if mv.dst == self.rank]
            f = self.layouts.file(b, self.rank) if self.rank in self.layouts.hosts[b] else None
            targets = {mv: region_target(*f.regions[mv.hf], mv.box) for mv in own  # f.regions: (offset, dtype, shape)
                       if f is not None and not self.placed.is_placed(mv)}
            self.plan.append(_Bucket(
                sends=[(mv, self._cuts[(mv.hf, mv.box)]) for mv in moves if mv.src == self.rank != mv.dst],
                recvs=[(mv, getattr(torch, self.dtypes[mv.hf])) for mv in own if mv.src != self.rank],
                own=[(mv, self._cuts[(mv.hf, mv.box)], self.placed.is_placed(mv)) for mv in own
                     if mv.src == self.rank],
                file=f, targets=targets, loads=bool((self.layouts.hosts[b] | self._pull_hosts[b]) & hosts)))

    partial = True  # run(replicas=...) delivers to some replicas only (a restarted engine's; megarl.steps)

    # -- one sync -----------------------------------------------------------------------------------------------------
    def run(self, engine: Any, verify: bool = False, replicas: Optional[set] = None) -> dict:
        """Deliver the current weights. `engine` is this rank's engine handle if it owns a replica, else None.
        `replicas`: deliver to these replicas' engines only (the others keep theirs); every rank still calls it, and
        the ranks of the other replicas only send their pieces."""
        self.syncs += 1
        t0 = time.perf_counter()
        stats = {"sent": 0, "received": 0, "loaded": 0, "placed": 0, "placed_tensors": set(), "exchange_s": 0.0,
                 "load_s": 0.0, "sums": {} if verify else None}
        to = None if replicas is None else {h for r in replicas for h in self.topology.members(r)}
        if to is not None and self.rank not in to:
            for b, bucket in enumerate(self.plan):
                self._deliver(b, bucket, stats, to)
            return self._metrics(stats, time.perf_counter() - t0)
        replica = self.topology.replica_of(self.rank)
        hosts = self.topology.members(replica) if replica is not None else []
        group = self._replica_groups[replica] if replica is not None and self.topology.engine_tp > 1 else None
        placing = any(h in self.placed.names for h in hosts)
        loads = any(bucket.loads for bucket in self.plan)
        loading = BackgroundLoad(engine) if engine is not None else None
        if engine is not None:
            engine.begin_update(verify=verify)
        try:
            if placing and group is not None:
                dist.barrier(group=group)  # the engine ended its rollout: its parameters may be written now
            # loads run beside the writes on the same cores; placed writes alone take every thread
            with half_threads_during_sync() if loads else contextlib.nullcontext():
                for b, bucket in enumerate(self.plan):
                    self._deliver(b, bucket, stats, to)  # bucket b-1 loads meanwhile, from the other slot
                    if not bucket.loads:
                        continue
                    if loading is not None:
                        # before the barrier: past it, the replica's other hosts write bucket b+1 into b-1's slot
                        loading.wait()
                    pulls = self._pull_metas(b, group)  # with the barrier below, where any worker pulls
                    if group is not None and pulls is None:
                        dist.barrier(group=group)  # the replica's files are all written
                    if loading is not None:
                        metas = self.metas(replica, b, pulls)
                        loading.start(metas)
                if loading is not None:
                    loading.wait()
            placed = self._placed_report(stats, group) if placing else None
        except BaseException:
            if engine is not None:
                try:
                    loading.wait()  # the engine takes one call at a time
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
                engine.abort_update()
                self._remove_leftovers()
            self._release_device_memory()
            raise
        if loading is not None:
            stats["load_s"] = loading.seconds
        result = {}
        if engine is not None:
            result = engine.end_update(placed=placed) if placed else engine.end_update()
            if getattr(engine, "lost_in_update", None):  # a supervised engine lost on the way: synced again later
                self._remove_leftovers()
        if any(h in self.placed.pull_hosts for h in hosts):
            if group is not None:
                dist.barrier(group=group)  # the workers closed the update: they hold nothing of the hosts' memory
            self._release_device_memory()
        seconds = time.perf_counter() - t0
        return {**result, **self._metrics(stats, seconds)}

    def _deliver(self, b: int, bucket: _Bucket, stats: dict, to: Optional[set] = None) -> None:
        """This rank's part of bucket b: its sends and receives posted, its own pieces written, the received ones
        written once they arrived. `to`: only pieces for these hosts (a partial sync); a rank outside them sends."""
        t0 = time.perf_counter()
        values: dict = {}  # each parameter's current value, resolved once per bucket
        ops, received = [], []
        receives = to is None or self.rank in to
        if receives:
            self.placed.begin_bucket(b)
        for mv, cut in bucket.sends:
            if to is not None and mv.dst not in to:
                continue
            piece = cut.piece(current_value(self.holdings.local, cut.param, values)).contiguous()
            ops.append(dist.P2POp(dist.isend, piece, mv.dst, self.group))
            stats["sent"] += mv.nbytes
        if not receives:
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
            stats["exchange_s"] += time.perf_counter() - t0
            return
        for mv, dtype in bucket.recvs:  # on GPU device to device (NCCL), on CPU over gloo
            buf = torch.empty(box_shape(mv.box), dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, mv.src, self.group))
            received.append((mv, buf))
            stats["received"] += mv.nbytes
        requests = dist.batch_isend_irecv(ops) if ops else []
        file = self._files.file(bucket.file.path, bucket.file.size) if bucket.file is not None else None
        for mv, cut, placed in bucket.own:
            value = current_value(self.holdings.local, cut.param, values)
            if not placed:
                cut.piece(value, out=bucket.targets[mv].of(file))
                continue
            row = mv.box[0][0]  # each row block of the piece where the worker's loader would put it
            for first, end, view in cut.blocks:
                self.placed.write(mv.hf, ((row + first, row + end),) + mv.box[1:], view.of(value), stats)
        for req in requests:
            req.wait()
        for mv, piece in received:
            if mv in bucket.targets:
                bucket.targets[mv].of(file).copy_(piece)
            else:
                self.placed.write(mv.hf, mv.box, piece, stats)
        stats["loaded"] += sum(mv.nbytes for mv, *_ in bucket.own) + sum(mv.nbytes for mv, _ in bucket.recvs)
        stats["exchange_s"] += time.perf_counter() - t0

    @staticmethod
    def _placed_report(stats: dict, group) -> list:
        """Per host of this rank's replica: what it wrote in place (for the workers' counts and verification); every
        host has finished writing when this returns."""
        mine = {"tensors": len(stats["placed_tensors"]), "bytes": stats["placed"], "sums": stats["sums"]}
        if group is None:
            return [mine]
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        return every

    def _release_device_memory(self) -> None:
        """After a sync: nothing of this rank's device memory stays held for its worker (the handles' sources, the
        device buckets), so an offload before rollout frees all it moves and the engine's KV cache gets it."""
        self.placed.release()
        if self._files.device is not None:
            self._files.drop()
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # blocks the worker has released are freed now, not at a later allocation

    def metas(self, replica: int, b: int, pulls: Optional[dict] = None) -> list:
        """What each worker of `replica` reads of bucket b (None where it has nothing in it): its bucket file's
        meta, with {"pull": ...} added where it copies pieces from its host's device memory (`pulls`: by host)."""
        out = []
        for host in self.topology.members(replica):
            meta = self.layouts.file(b, host).meta if host in self.layouts.hosts[b] else None
            pull = (pulls or {}).get(host)
            if pull is not None and meta is not None and "bucket" in pull:
                meta = dict(meta, device=pull["bucket"])
            if pull is not None and pull["pieces"]:
                meta = dict(meta or {}, pull=pull)
            out.append(meta)
        return out

    def _pull_metas(self, b: int, group) -> Optional[dict]:
        """{host: its worker's pull of bucket b} for the hosts of this rank's replica, or None where no worker of
        the replica pulls in bucket b. A collective of the replica's group (it stands in for the barrier: every
        host has written and synchronized its device when it returns)."""
        replica = self.topology.replica_of(self.rank)
        if self._pull_hosts[b].isdisjoint(self.topology.members(replica)):
            return None
        mine = None
        if self.rank in self._pull_hosts[b]:
            bucket = self.plan[b].file
            mine = self.placed.pull_meta(b, self._files.mapped[bucket.path] if bucket is not None else None)
        if group is None:
            return {self.rank: mine}
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        return dict(zip(self.topology.members(replica), every))

    def _remove_leftovers(self) -> None:
        """After a failed sync: the slot files of a replica that its workers never opened (a worker unlinks each
        file it maps, so a successful sync leaves none)."""
        self._files.drop(self._leftovers)

    def _metrics(self, stats: dict, seconds: float) -> dict:
        plan = {"sent": self.plan_sent, "received": self.plan_received, "loaded": self.plan_loaded}
        return delivery_metrics(stats, seconds, len(self.buckets), plan)


def plan_sync(holdings: Holdings, engine: Any, topology: EngineTopology, bucket_bytes: int) -> WeightSync:
    """Plan the live sync of a model from the trainer's holdings (a collective, once per run; megarl.sync.factory):
    every engine owner reports its workers' layouts. `engine`: this rank's engine handle if it owns a replica, else
    None."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {}
    if engine is not None:
        first = topology.owner(topology.replica_of(rank))
        mine = {first + w: layout for w, layout in enumerate(engine.layouts)}
    layouts, tokens = {}, []
    for part, token in all_gather_objects((mine, secrets.token_hex(4))):
        layouts.update(part)
        tokens.append(token)
    return WeightSync(holdings, layouts, topology, bucket_bytes, rank, tokens[0], engine)
