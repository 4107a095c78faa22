"""The colocated transport's writes straight into engine parameters, for the workers that take them (each worker
says so at plan time, and which tensors):

* in place (CPU, megarl.sync.placement): the worker moved its parameters into a shared-memory arena and reported
  where vLLM's loader puts every tensor; its host rank writes each piece there, one copy, no load call;
* pulled (GPU, megarl.sync.pull): the worker keeps those records and copies each piece from its host rank's device
  memory itself; the host hands it the pieces' view specs per bucket and keeps the pieces alive until then.

Every other tensor (and every tensor of a worker that takes none) keeps the bucket files.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from megarl.distributed import all_gather_objects
from megarl.layout import EngineTopology
from megarl.sync.moves import Move
from megarl.sync.placement import region_viewer, write_placed
from megarl.sync.pull import PullSources
from megarl.sync.weights import add_checksums, tensor_checksum
from megarl.sync.wire import shm_dir

log = logging.getLogger(__name__)


class PlacedWrites:
    """This rank's placed writes and pulls, and which hosts' workers take them (every rank builds one)."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.names: dict = {}  # {host: hf names its worker takes in place}
        self.records: dict = {}  # this rank's worker: {hf name: [placement record]}
        self.pull_hosts: set = set()  # hosts whose workers pull their pieces from the host's device memory
        self.not_placed: dict = {}  # {host: why its worker (or which of its tensors) takes the bucket files}
        self._views = None  # the arena's region viewer (megarl.sync.placement)
        self._pulls: list = []  # this rank's pieces for its pulling worker in the bucket being delivered
        self._sources = [PullSources(), PullSources()]  # by bucket parity: a bucket's sources live until b+2
        self._bucket = 0

    def place(self, engine: Any, topology: EngineTopology, needs: dict, token: str) -> None:
        """Once, before the first sync (a collective): every engine worker that takes its weights in place moves them
        into a shared-memory file and reports where each tensor lands; needs: {host: {hf: (dtype, shape, box)}}."""
        mine = {}
        replica = topology.replica_of(self.rank)
        if engine is not None:
            hosts = topology.members(replica)
            prefix = os.path.join(shm_dir(), f"megarl-{token}-replica{replica}")  # + worker rank
            mine = dict(zip(hosts, engine.place_weights([needs.get(h, {}) for h in hosts], prefix)))
        reports = {}
        for part in all_gather_objects(mine):
            reports.update(part)
        for host, rep in reports.items():
            if "arena" not in rep and not rep.get("pull"):
                self.not_placed[host] = rep.get("why", "not reported")
                continue
            self.names[host] = set(rep["placed"])
            if rep["refused"]:
                self.not_placed[host] = "; ".join(f"{k}: {v}" for k, v in sorted(rep["refused"].items())[:4])
            if rep.get("pull"):  # the worker keeps its records and copies from this rank's memory itself
                self.pull_hosts.add(host)
            elif host == self.rank:
                self.records = {h: [(tuple(tuple(b) for b in rec[0]),) + tuple(rec[1:]) for rec in recs]
                                for h, recs in rep["placed"].items()}
                arena = torch.from_file(rep["arena"], shared=True, size=int(rep["size"]), dtype=torch.uint8)
                os.unlink(rep["arena"])  # mapped by the worker and here: nothing is left in /dev/shm
                self._views = region_viewer([arena])
        if self.rank == 0 and reports:
            self._say(reports)

    def forget(self, hosts: set) -> None:
        """What the workers of `hosts` said at placement (their engine was restarted: the new ones say it again)."""
        for host in hosts:
            self.names.pop(host, None)
            self.not_placed.pop(host, None)
            self.pull_hosts.discard(host)
        if self.rank in hosts:
            self.records, self._views = {}, None

    def _say(self, reports: dict) -> None:
        log.debug("weight sync: the workers hosted by ranks %s are written in place; %s",
                  sorted(self.names), "; ".join(f"rank {h}'s worker takes bucket files ({why})" for h, why
                                                in sorted(self.not_placed.items())) or "nothing else")
        fallen = [h for h, rep in sorted(reports.items()) if rep.get("failed") or rep.get("refused")]
        if fallen:  # the fast path was open to these workers: say why they (or some tensors) do without it
            log.warning("weight sync: bucket files instead of writes into the engine's parameters for %s",
                        "; ".join(f"rank {h}'s worker: {self.not_placed[h]}" for h in fallen))

    @property
    def pulling(self) -> bool:
        """Whether this rank's own worker pulls (its bucket files are then device buffers)."""
        return self.rank in self.pull_hosts

    def is_placed(self, mv: Move) -> bool:
        return mv.hf in self.names.get(mv.dst, ())

    def begin_bucket(self, b: int) -> None:
        self._bucket = b
        if self.pulling:
            self._sources[b % 2].release()  # bucket b-2's pieces: its load has ended (the replica passed b-1's)
            self._pulls = []

    def write(self, hf: str, box, piece: torch.Tensor, stats: dict) -> None:
        """One piece (the part `box` of HF tensor `hf`) for this rank's worker, where its loader would put it."""
        if self.pulling:  # the worker copies it from here (this rank keeps `piece` until then)
            self._pulls.append((hf, box, self._sources[self._bucket % 2].spec(piece)))
        else:
            write_placed(self._views, self.records[hf], box, piece)
        stats["placed"] += piece.numel() * piece.element_size()
        stats["placed_tensors"].add(hf)
        if stats["sums"] is not None:  # the checksum's sums add up over the pieces of a tensor
            c = tensor_checksum(piece)
            stats["sums"][hf] = add_checksums(stats["sums"][hf], c) if hf in stats["sums"] else c

    def pull_meta(self, b: int, bucket: Optional[torch.Tensor]) -> dict:
        """This rank's worker's pull of bucket b (the pieces' specs; `bucket`: the device bucket of what its loaders
        read, if any). The pieces are final on the device when it returns."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        meta = self._sources[b % 2].meta(self._pulls)
        if bucket is not None:
            meta["bucket"] = self._sources[b % 2].handle(bucket)
        return meta

    def release(self) -> None:
        """Nothing of this rank's device memory stays held for its worker after a sync."""
        for sources in self._sources:
            sources.release()
