"""The engine hosts of a remote weight sync (megarl.sync.transports.remote) as the trainer ranks see them: their
transfer ranks and owners, the plan's bytes per host, what travels in which dtype, the metrics of one sync, and the
error every trainer rank raises when a host was lost during one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megarl.sync.holdings import Holdings
from megarl.sync.moves import traffic


@dataclass(frozen=True)
class EngineHosts:
    """The engine hosts of a run, in transfer-rank order: host h has transfer rank `world + h`, is driven by the
    trainer rank `owner[h]` (the rank holding its engine handle) and has `workers[h]` engine workers, whose receiver
    ids are consecutive from `world`."""

    world: int
    owner: tuple
    workers: tuple

    def rank(self, h: int) -> int:
        return self.world + h

    def receivers(self, h: int) -> list:
        first = self.world + sum(self.workers[:h])
        return list(range(first, first + self.workers[h]))

    def host_of(self) -> dict:
        """{receiver id: transfer rank of its host}."""
        return {w: self.rank(h) for h in range(len(self.owner)) for w in self.receivers(h)}

    def owned_by(self, rank: int) -> list:
        return [h for h, o in enumerate(self.owner) if o == rank]

    def ranks(self) -> list:
        return [self.rank(h) for h in range(len(self.owner))]


class EngineHostLost(RuntimeError):
    """Raised by RemoteSync.run on EVERY trainer rank, after all of them finished the sync's collective part, when one
    or more engine hosts failed during it (a send to it failed: the process died or closed its end; or its own receive
    raised). `hosts`: their transfer ranks; `owners`: the trainer ranks holding their engine handles (each restarts
    its engine, then every rank calls RemoteSync.rejoin); the other hosts received the whole update."""

    def __init__(self, hosts: Sequence[int], owners: Sequence[int], causes: Sequence[str], sync: int):
        self.hosts, self.owners, self.causes, self.sync = tuple(hosts), tuple(owners), tuple(causes), sync
        super().__init__(f"weight sync {sync}: engine host(s) {list(self.hosts)} (engine handles on trainer ranks "
                         f"{list(self.owners)}) lost during the transfer: {'; '.join(self.causes)[:800]}; restart "
                         "their engines and call RemoteSync.rejoin on every trainer rank")

    def __reduce__(self):  # picklable, as a rank's error travels to its launcher
        return type(self), (self.hosts, self.owners, self.causes, self.sync)


def host_traffic(moves: Sequence, hosts: EngineHosts) -> tuple:
    """The plan's ({rank: bytes sent}, {rank: bytes received}, {rank: bytes loaded}) with every receiver counted on
    the transfer rank of its host (trainer ranks send; hosts receive and load)."""
    sent, received, loaded = traffic(moves)
    host_of = hosts.host_of()

    def per_host(d: dict) -> dict:
        out: dict = {}
        for receiver, nbytes in d.items():
            out[host_of[receiver]] = out.get(host_of[receiver], 0) + nbytes
        return out

    return sent, per_host(received), per_host(loaded)


def process_rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def sync_metrics(every: list, hosts: EngineHosts, plan: dict, seconds: float, buckets: int) -> dict:
    """One sync's metrics from every trainer rank's (bytes sent, send seconds, its hosts' results, its resident
    memory) and the plan's {"sent"|"received"|"loaded": {rank: bytes}}."""
    measured = {"sent": {rank: e[0] for rank, e in enumerate(every)}, "received": {}, "loaded": {}}
    host_stats = [h for e in every for h in e[2]]
    for h, stats in enumerate(host_stats):
        measured["received"][hosts.rank(h)] = stats["received"]
        measured["loaded"][hosts.rank(h)] = stats["loaded"]
    out = dict(host_stats[0]["metrics"]) if host_stats else {}  # the engines' own figures, over every host
    if host_stats:
        out["weight_sync/version"] = min(h["metrics"]["weight_sync/version"] for h in host_stats)
    if "weight_sync/verified_tensors" in out:
        out["weight_sync/verified_tensors"] = float(sum(h["metrics"].get("weight_sync/verified_tensors", 0)
                                                        for h in host_stats))
    for kind in ("sent", "received", "loaded"):
        out[f"weight_sync/{kind}_bytes_max"] = float(max(measured[kind].values(), default=0))
        out[f"weight_sync/{kind}_bytes_rank0"] = float(measured[kind].get(0, 0))
        out[f"weight_sync/plan_{kind}_bytes_max"] = float(max(plan[kind].values(), default=0))
        out[f"weight_sync/plan_{kind}_bytes_rank0"] = float(plan[kind].get(0, 0))
    total = float(sum(measured["loaded"].values()))
    out.update({"weight_sync/seconds": seconds, "weight_sync/bytes": total,
                "weight_sync/gbps": total / seconds / 1e9 if seconds > 0 else 0.0,
                "weight_sync/num_buckets": float(buckets),
                "weight_sync/engine_replicas": float(len(hosts.owner)),
                "weight_sync/senders": float(sum(1 for e in every if e[0] > 0)),
                "weight_sync/send_seconds_max": max(e[1] for e in every),
                "weight_sync/trainer_rss_bytes_max": float(max(e[3] for e in every)),
                "weight_sync/exchange_seconds": max((h["receive_s"] for h in host_stats), default=0.0),
                "weight_sync/engine_load_seconds": max((h["load_s"] for h in host_stats), default=0.0)})
    return out


def transfer_backend(holdings: Holdings) -> str:
    """NCCL where the trainer's parameters are on a GPU, gloo otherwise."""
    return "nccl" if holdings.device.type == "cuda" else "gloo"


def wire_dtypes(holdings: Holdings, engine_dtype: Optional[str]) -> dict:
    """{hf name: dtype name} the pieces travel in: the engine's dtype for floating-point tensors (the engine casts to
    it anyway; sent in it, a float32 trainer sends half the bytes to a bfloat16 engine, and a delta update sees the
    elements that change in the engine), the trainer's own otherwise or without an engine dtype."""
    out = {}
    for name, dtype in holdings.hf_dtypes.items():
        floating = getattr(torch, dtype).is_floating_point
        out[name] = engine_dtype if engine_dtype and floating else dtype
    return out
