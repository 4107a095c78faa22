"""Per-rank weight delivery: every engine worker receives only its own shard, from the trainer ranks that hold it.

    trainer rank k ──(its HF chunks, cut to the pieces each worker needs)──► rank hosting the worker (p2p, gloo)
    hosting rank ──(pieces written into a sparse shared-memory bucket file)──► its engine worker (megarl_load)

The plan (megarl.sync.shards) is computed once from the bridge mapping, the trainer's parameters and the layout
each engine worker reports; every rank derives the same moves and buckets from it, so no metadata travels per step.
A rank sends only pieces of its own parameters and receives only pieces its worker loads; nothing gathers whole
tensors, nothing is broadcast to the world.

Bucket files are reused: each receiving rank writes its buckets alternately into two shared-memory slot files, sized
once from the plan, which it and its worker keep mapped for the whole run (the worker unlinks each file when it first
maps it, so nothing is left in /dev/shm). A fresh file per bucket cost a page fault per 4 KiB written and a page free
per 4 KiB released, several times the copy itself; a reused slot costs the copy alone. The worker copies out whatever
vLLM still buffers from a slot (a layer whose tensors straddle buckets) before the slot is written again.

Where a CPU engine worker takes its weights in place, its host writes straight into the worker's parameters instead
(megarl.sync.placement: the worker moved them into a shared-memory file at plan time and reported where each
tensor lands): one copy per piece, no bucket file, no load call.

Engine placement (megarl.rollout.replicas.EngineTopology): replica r spans trainer ranks [r*T, (r+1)*T) (T = engine
TP); worker w of the replica is hosted by rank r*T + w, and the replica's first rank owns the engine process.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.distributed import all_gather_objects
from megarl.layout import EngineTopology
from megarl.sync.boxes import box_shape, full_box, intersect, relative_slices
from megarl.sync.holdings import Holdings
from megarl.sync.moves import Move, bucket_moves, plan_moves, traffic
from megarl.sync.placement import region_viewer, write_placed
from megarl.sync.pull import PullSources
from megarl.sync.shards import SyncTable, worker_needs
from megarl.sync.transports.common import BackgroundLoad, SlotFiles
from megarl.sync.weights import add_checksums, tensor_checksum
from megarl.sync.wire import ALIGN, BucketFile, half_threads_during_sync, layout_bucket, region, shm_dir

log = logging.getLogger(__name__)


class WeightSync:
    """The live weight sync of one trainer (every rank builds one, with the same arguments).

    holdings: the mapping and every rank's parameters (megarl.sync.holdings, built once per run); layouts: {hosting
    rank: what its engine worker reported (megarl_layout)}."""

    def __init__(self, holdings: Holdings, layouts: dict, topology: EngineTopology, bucket_bytes: int, rank: int,
                 token: str, group=None):
        self.holdings, self.topology, self.rank, self.group = holdings, topology, rank, group
        self.mapping = holdings.mapping
        self.shapes = SyncTable.of(self.mapping).shapes
        self.dtypes = holdings.hf_dtypes
        self.needs = {host: worker_needs(self.mapping, lay) for host, lay in layouts.items()}
        self.moves = plan_moves(SyncTable.of(self.mapping).order, self.needs, holdings.boxes, holdings.element_sizes)
        self.buckets = bucket_moves(self.moves, bucket_bytes)
        self.plan_sent, self.plan_received, self.plan_loaded = traffic(self.moves)
        self.token = token  # the same on every rank: it names the bucket files a host writes and its worker reads
        self.syncs = 0
        self._layouts: dict = {}  # (bucket, host) -> BucketFile
        self._slot_size: dict = {}  # (host, slot) -> bytes: the largest of the host's buckets that use the slot
        self._files = SlotFiles()
        self._replica_groups = [dist.new_group(topology.members(r), backend="gloo")
                                for r in range(topology.replicas)] if dist.is_initialized() else []
        # placed writes (megarl.sync.placement): {host: hf names its worker takes in place}, this rank's records
        self.placed_names: dict = {}
        self.placed: dict = {}
        # hosts whose workers pull their pieces from the host's device memory (GPU: megarl.sync.pull)
        self.pull_hosts: set = set()
        self._bucket = 0
        self._pulls: list = []  # this rank's pieces for its pulling worker in the bucket being delivered
        self._sources = [PullSources(), PullSources()]  # by bucket parity: a bucket's sources live until b+2
        self.device = holdings.device
        self.not_placed: dict = {}  # {host: why its worker (or which of its tensors) takes the bucket files}
        self._arena_views: Optional[Callable] = None
        self._index_file_hosts()

    # -- placed writes ------------------------------------------------------------------------------------------------
    def place(self, engine: Any) -> None:
        """Once, before the first sync (a collective): every engine worker that takes its weights in place moves them
        into a shared-memory file and reports where each tensor lands; its host maps the file and from then on
        writes its pieces there (megarl.sync.placement). Workers and tensors that cannot keep the bucket files."""

        mine = {}
        replica = self.topology.replica_of(self.rank)
        if engine is not None:
            hosts = self.topology.members(replica)
            needs = [{h: (self.dtypes[h], list(self.shapes[h]), [list(b) for b in box])
                      for h, box in self.needs.get(host, {}).items()} for host in hosts]
            prefix = os.path.join(shm_dir(), f"megarl-{self.token}-replica{replica}")  # + worker rank
            mine = dict(zip(hosts, engine.place_weights(needs, prefix)))
        reports = {}
        for part in all_gather_objects(mine):
            reports.update(part)
        for host, rep in reports.items():
            if "arena" not in rep and not rep.get("pull"):
                self.not_placed[host] = rep.get("why", "not reported")
                continue
            self.placed_names[host] = set(rep["placed"])
            if rep["refused"]:
                self.not_placed[host] = "; ".join(f"{k}: {v}" for k, v in sorted(rep["refused"].items())[:4])
            if rep.get("pull"):  # the worker keeps its records and copies from this rank's memory itself
                self.pull_hosts.add(host)
                if host == self.rank:  # what it loads with its loaders comes in device buckets, not files
                    self._files = SlotFiles(self.device)
                continue
            if host == self.rank:
                self.placed = {h: [(tuple(tuple(b) for b in rec[0]),) + tuple(rec[1:]) for rec in recs]
                               for h, recs in rep["placed"].items()}
                arena = torch.from_file(rep["arena"], shared=True, size=int(rep["size"]), dtype=torch.uint8)
                os.unlink(rep["arena"])  # mapped by the worker and here: nothing is left in /dev/shm
                self._arena_views = region_viewer([arena])
        self._index_file_hosts()
        if self.rank == 0 and reports:
            log.debug("weight sync: the workers hosted by ranks %s are written in place; %s",
                      sorted(self.placed_names), "; ".join(f"rank {h}'s worker takes bucket files ({why})" for h, why
                                                           in sorted(self.not_placed.items())) or "nothing else")
            fallen = [h for h, rep in sorted(reports.items()) if rep.get("failed") or rep.get("refused")]
            if fallen:  # the fast path was open to these workers: say why they (or some tensors) do without it
                log.warning("weight sync: bucket files instead of writes into the engine's parameters for %s",
                            "; ".join(f"rank {h}'s worker: {self.not_placed[h]}" for h in fallen))

    def is_placed(self, mv: Move) -> bool:
        return mv.hf in self.placed_names.get(mv.dst, ())

    # -- one sync -----------------------------------------------------------------------------------------------------
    def run(self, engine: Any, verify: bool = False) -> dict:
        """Deliver the current weights. `engine` is this rank's engine handle if it owns a replica, else None."""
        self.syncs += 1
        t0 = time.perf_counter()
        stats = {"sent": 0, "received": 0, "loaded": 0, "placed": 0, "placed_tensors": set(), "exchange_s": 0.0,
                 "load_s": 0.0, "sums": {} if verify else None}
        replica = self.topology.replica_of(self.rank)
        hosts = self.topology.members(replica) if replica is not None else []
        group = self._replica_groups[replica] if replica is not None and self.topology.engine_tp > 1 else None
        placing = any(h in self.placed_names for h in hosts)
        loads = {b for b in range(len(self.buckets)) if self._loads_for(b, hosts)}
        loading = BackgroundLoad(engine) if engine is not None else None
        if engine is not None:
            engine.begin_update(verify=verify)
        try:
            if placing and group is not None:
                dist.barrier(group=group)  # the engine ended its rollout: its parameters may be written now
            # loads run beside the writes on the same cores; placed writes alone take every thread
            with half_threads_during_sync() if loads else contextlib.nullcontext():
                for b, moves in enumerate(self.buckets):
                    self._deliver_bucket(b, moves, stats)  # bucket b-1 loads meanwhile, from the other slot
                    if b not in loads:
                        continue
                    if loading is not None:
                        # before the barrier: past it, the replica's other hosts write bucket b+1 into b-1's slot
                        loading.wait()
                    pulls = self._pull_metas(b, group)  # with the barrier below, where any worker pulls
                    if group is not None and pulls is None:
                        dist.barrier(group=group)  # the replica's files are all written
                    if loading is not None:
                        loading.start(self.metas(replica, b, pulls))
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
                self._remove_leftovers(self.topology.members(replica))
            self._release_device_memory()
            raise
        if loading is not None:
            stats["load_s"] = loading.seconds
        result = {}
        if engine is not None:
            result = engine.end_update(placed=placed) if placed else engine.end_update()
            if getattr(engine, "lost_in_update", None):  # a supervised engine lost on the way: synced again later
                self._remove_leftovers(hosts)
        if any(h in self.pull_hosts for h in hosts):
            if group is not None:
                dist.barrier(group=group)  # the workers closed the update: they hold nothing of the hosts' memory
            self._release_device_memory()
        seconds = time.perf_counter() - t0
        return {**result, **self._metrics(stats, seconds)}

    def _release_device_memory(self) -> None:
        """After a sync: nothing of this rank's device memory stays held for its worker (the handles' sources, the
        device buckets), so an offload before rollout frees all it moves and the engine's KV cache gets it."""
        for sources in self._sources:
            sources.release()
        if self._files.device is not None:
            self._files.drop()
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # blocks the worker has released are freed now, not at a later allocation

    def _files_for(self, b: int, hosts: Sequence[int]) -> bool:
        """Whether bucket b has anything for the bucket files of `hosts` (all else is written in place)."""
        return not self._file_hosts[b].isdisjoint(hosts)

    def _loads_for(self, b: int, hosts: Sequence[int]) -> bool:
        """Whether bucket b needs a load call on the engine of `hosts`: bucket files, or pieces a worker pulls."""
        return self._files_for(b, hosts) or not self._pull_hosts[b].isdisjoint(hosts)

    def _index_file_hosts(self) -> None:
        """Which hosts receive bucket files of each bucket, and their file layouts, for the placement as it stands
        (computed once, not per sync)."""
        self._file_hosts = [{mv.dst for mv in self._file_moves(b)} for b in range(len(self.buckets))]
        self._pull_hosts = [{mv.dst for mv in moves if mv.dst in self.pull_hosts} for moves in self.buckets]
        self._layouts.clear()
        self._slot_size.clear()

    def _placed_report(self, stats: dict, group) -> list:
        """Per host of this rank's replica: what it wrote in place (for the workers' counts and verification); every
        host has finished writing when this returns."""
        mine = {"tensors": len(stats["placed_tensors"]), "bytes": stats["placed"], "sums": stats["sums"]}
        if group is None:
            return [mine]
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        return every

    def _deliver_bucket(self, b: int, moves: Sequence[Move], stats: dict) -> None:
        t0 = time.perf_counter()
        self._bucket = b
        if self.rank in self.pull_hosts:
            self._sources[b % 2].release()  # bucket b-2's pieces: its load has ended (the replica passed b-1's)
            self._pulls = []
        chunks: dict = {}
        ops, received = [], []
        for mv in moves:
            if mv.src == self.rank and mv.dst != self.rank:
                piece = self._piece(mv, chunks).contiguous()
                ops.append(dist.P2POp(dist.isend, piece, mv.dst, self.group))
                stats["sent"] += mv.nbytes
            elif mv.dst == self.rank and mv.src != self.rank:  # on GPU device to device (NCCL), on CPU over gloo
                buf = torch.empty(box_shape(mv.box), dtype=getattr(torch, self.dtypes[mv.hf]), device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, mv.src, self.group))
                received.append((mv, buf))
                stats["received"] += mv.nbytes
        requests = dist.batch_isend_irecv(ops) if ops else []
        mine = [mv for mv in moves if mv.dst == self.rank]
        f = buf = None
        if any(not self.is_placed(mv) for mv in mine):
            f = self.bucket_file(b, self.rank)
            buf = self._files.file(f.path, f.size)
        blocks: dict = {}
        for mv in mine:
            if mv.src == self.rank and self.is_placed(mv):
                self._place_own(mv, blocks, stats)
            elif mv.src == self.rank:
                self._write(buf, f, mv, self._piece(mv, chunks), stats)
        for req in requests:
            req.wait()
        for mv, piece in received:
            self._write(buf, f, mv, piece, stats)
        stats["loaded"] += sum(mv.nbytes for mv in mine)
        stats["exchange_s"] += time.perf_counter() - t0

    def _piece(self, mv: Move, chunks: dict) -> torch.Tensor:
        return self.holdings.piece(mv, chunks)

    def _write(self, buf: Optional[torch.Tensor], f: Optional[BucketFile], mv: Move, piece: torch.Tensor,
               stats: dict) -> None:
        """One piece for this rank's worker: into its parameters where placed, else into the bucket file."""
        if self.is_placed(mv):
            self._write_placed(mv.hf, mv.box, piece, stats)
            return
        offset, dtype, shape = f.regions[mv.hf]
        region(buf, dtype, shape, offset)[relative_slices(mv.box, full_box(shape))].copy_(piece)

    def _place_own(self, mv: Move, blocks: dict, stats: dict) -> None:
        """A piece of this rank's own parameter, placed from the row blocks it lies in (views: no conversion copy)."""
        if mv.hf not in blocks:
            blocks.update(self.holdings.hf_blocks(mv))
        (first, _), rest = mv.holding[0], tuple(mv.holding[1:])
        for start, stop, view in blocks[mv.hf]:
            block = ((first + start, first + stop),) + rest
            common = intersect(mv.box, block)
            if common is not None:
                self._write_placed(mv.hf, common, view[relative_slices(common, block)], stats)

    def _write_placed(self, hf: str, box, piece: torch.Tensor, stats: dict) -> None:
        if self.rank in self.pull_hosts:  # the worker copies it from here (its host keeps `piece` until then)
            self._pulls.append((hf, box, self._sources[self._bucket % 2].spec(piece)))
        else:
            write_placed(self._arena_views, self.placed[hf], box, piece)
        stats["placed"] += piece.numel() * piece.element_size()
        stats["placed_tensors"].add(hf)
        if stats["sums"] is not None:  # the checksum's sums add up over the pieces of a tensor
            c = tensor_checksum(piece)
            stats["sums"][hf] = add_checksums(stats["sums"][hf], c) if hf in stats["sums"] else c

    # -- files --------------------------------------------------------------------------------------------------------
    def _path(self, slot: int, dst: int) -> str:
        return os.path.join(shm_dir(), f"megarl-{self.token}-r{dst}-slot{slot}")

    def bucket_file(self, b: int, dst: int) -> BucketFile:
        """Bucket b's layout in the file of host `dst`: buckets alternate between the host's two slot files, each
        sized for the largest bucket it carries, so every rank derives the same names and sizes from the plan."""
        key = (b, dst)
        if key not in self._layouts:
            slot = b % 2
            if (dst, slot) not in self._slot_size:
                self._slot_size[(dst, slot)] = max(
                    (layout_bucket(self._file_moves(i), dst, "", self.shapes, self.dtypes, self.needs.get(dst, {})).size
                     for i in range(slot, len(self.buckets), 2)), default=ALIGN)
            f = layout_bucket(self._file_moves(b), dst, self._path(slot, dst), self.shapes, self.dtypes,
                              self.needs.get(dst, {}))
            f.size = self._slot_size[(dst, slot)]
            f.meta.update(size=f.size, slot=f.path)
            self._layouts[key] = f
        return self._layouts[key]

    def _file_moves(self, b: int) -> list:
        return [mv for mv in self.buckets[b] if not self.is_placed(mv)]

    def metas(self, replica: int, b: int, pulls: Optional[dict] = None) -> list:
        """What each worker of `replica` reads of bucket b (None where it has nothing in it): its bucket file's
        meta, with {"pull": ...} added where it copies pieces from its host's device memory (`pulls`: by host)."""
        out = []
        for host in self.topology.members(replica):
            meta = self.bucket_file(b, host).meta if self._files_for(b, [host]) else None
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
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the pieces are final before the worker reads them
            mine = self._sources[b % 2].meta(self._pulls)
            if self._files_for(b, [self.rank]):  # the device bucket of what its loaders read
                mine["bucket"] = self._sources[b % 2].handle(self._files.mapped[self.bucket_file(b, self.rank).path])
        if group is None:
            return {self.rank: mine}
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        return dict(zip(self.topology.members(replica), every))

    def _remove_leftovers(self, hosts: Sequence[int]) -> None:
        """After a failed sync: the slot files of a replica that its workers never opened (a worker unlinks each
        file it maps, so a successful sync leaves none)."""
        self._files.drop([self._path(slot, host) for slot in (0, 1) for host in hosts])

    # -- metrics ------------------------------------------------------------------------------------------------------
    def _metrics(self, stats: dict, seconds: float) -> dict:

        # four numbers per rank: host objects over gloo (an NCCL group takes device tensors only)
        mine = [float(stats[k]) for k in ("sent", "received", "loaded", "placed")]
        every = torch.tensor(all_gather_objects(mine), dtype=torch.float64)
        out = {"weight_sync/seconds": seconds, "weight_sync/exchange_seconds": stats["exchange_s"],
               "weight_sync/engine_load_seconds": stats["load_s"], "weight_sync/num_buckets": float(len(self.buckets))}
        for i, kind in enumerate(("sent", "received", "loaded")):
            plan = {"sent": self.plan_sent, "received": self.plan_received, "loaded": self.plan_loaded}[kind]
            out[f"weight_sync/{kind}_bytes_max"] = float(every[:, i].max())
            out[f"weight_sync/{kind}_bytes_rank0"] = float(every[0, i])
            out[f"weight_sync/plan_{kind}_bytes_max"] = float(max(plan.values(), default=0))
            out[f"weight_sync/plan_{kind}_bytes_rank0"] = float(plan.get(0, 0))
        out["weight_sync/bytes"] = float(every[:, 2].sum())
        out["weight_sync/placed_bytes"] = float(every[:, 3].sum())  # of those, written into engine parameters directly
        out["weight_sync/gbps"] = out["weight_sync/bytes"] / seconds / 1e9 if seconds > 0 else 0.0
        return out


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
    sync = WeightSync(holdings, layouts, topology, bucket_bytes, rank, tokens[0])
    sync.place(engine)
    return sync
