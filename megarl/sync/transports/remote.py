"""Weight delivery to engines that run in processes of their own: Ray actors (rollout.mode=ray) and
rollout.placement=separate. The trainer's end; the engine host's end is megarl.rollout.hosting.receiver, and what both
agree on (the transfer group, each host's ReceivePlan) is megarl.sync.transfer.

    trainer rank k ──(pieces of its own parameters the plan assigns to a replica's workers)──► engine host
                     over a transfer group (gloo on CPU, NCCL on GPU) formed beside the trainer's process group
    engine host ──(each worker's pieces in its sparse shared-memory bucket file)──► its workers (megarl_load)

The engine host runs one replica's VLLMEngine (a Ray actor, or the engine process a trainer rank starts for
rollout.placement=separate), its workers on the same machine. Neither one rank nor Ray's object store carries weights.

The plan is the colocated sync's (megarl.sync.shards): every engine worker is a receiver of its own, numbered from
N upward so that it is never a trainer rank; its needs come from the layout the live worker reports, and plan_moves
takes each piece from the least-loaded trainer rank that holds it, so data-parallel copies share the sending and no
rank sends what it does not hold. Every trainer rank derives the same moves and buckets, and compiles where its
pieces lie in its parameters (megarl.sync.copies); each host is given, once, the part of the plan it receives
(`ReceivePlan`), so only a sync number travels per step. A host receives bucket b+1 while its workers load bucket b.

On GPU the same code runs over NCCL (the trainer's parameters and the host's receive buffers on the GPU, copied into
the bucket files); only the gloo path is exercised on CPU.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.distributed import all_gather_objects
from megarl.sync.copies import current_value
from megarl.sync.delta import DENSE, checksum, encode
from megarl.sync.holdings import Holdings
from megarl.sync.moves import bucket_moves, traffic
from megarl.sync.plan import live_plan
from megarl.sync.shards import EngineModule, engine_needs
from megarl.sync.transfer import DEFAULT_TIMEOUT_S, TransferSpec, join_group, piece_key, receive_plan, serve_store


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


class RemoteSync:
    """The weight sync of one trainer into engines hosted elsewhere (every trainer rank builds one, with the same
    plan). `run(engine)` is WeightSync.run's counterpart: the same call on every rank, the engine handle on the ranks
    that hold one."""

    def __init__(self, holdings: Holdings, moves: list, buckets: list, hosts: EngineHosts, group, rank: int,
                 store=None, wire_dtypes: Optional[dict] = None, delta_full_every: int = 0):
        self.holdings = holdings
        self.moves, self.buckets, self.hosts = moves, buckets, hosts
        self.group, self.rank, self._store = group, rank, store  # rank 0 serves the store the group met on
        self.host_rank = hosts.host_of()
        self.plan_sent, self.plan_received, self.plan_loaded = host_traffic(moves, hosts)
        self.syncs = 0
        self.wire_dtypes = wire_dtypes or holdings.hf_dtypes  # {hf name: dtype name} the pieces travel in
        self._torch_dtypes = {h: getattr(torch, dt) for h, dt in self.wire_dtypes.items()}
        # delta updates (megarl.sync.delta): 0 = off; else a full update first and every `delta_full_every` updates
        self.delta_full_every = delta_full_every
        self.last: dict = {}  # delta: {(bucket, index in bucket): the piece as last sent}
        self.full_next = True  # the next update is a full one (the first; after an engine restart: force_full)
        self.since_full = 0
        self._cuts = holdings.cuts([mv for bucket in buckets for mv in bucket if mv.src == rank])  # compiled once

    def force_full(self) -> None:
        """Make the next update a full one (an engine restarted and lost what it had received)."""
        self.full_next = True

    def run(self, engine: Any, verify: bool = False) -> dict:
        self.syncs += 1
        t0 = time.perf_counter()
        full = self._full_update()
        pending = engine.start_receive_weights(self.syncs, verify) if self.hosts.owned_by(self.rank) else None
        sent = changed = 0
        try:
            for b, moves in enumerate(self.buckets):
                if self.delta_full_every:
                    bucket_sent, bucket_changed = self._send_bucket_delta(b, moves, full)
                    sent, changed = sent + bucket_sent, changed + bucket_changed
                else:
                    sent += self._send_bucket(b, moves)
        except BaseException:
            self.full_next = True  # what the hosts hold is unknown now
            if pending is not None:
                pending.result()  # the host's own error says more than a broken connection
            raise
        send_s = time.perf_counter() - t0
        results = pending.result() if pending is not None else []
        metrics = self._metrics(sent, send_s, results, time.perf_counter() - t0)
        if self.delta_full_every:
            metrics["weight_sync/full_update"] = float(full)
            metrics.update(self._check_delta(changed, results))
        return metrics

    def _check_delta(self, changed: int, results: list) -> dict:
        """Every piece's checksum as the trainer last sent it against the host's copy that its workers loaded (a
        collective): a delta update must leave the engine exactly as a full one would."""
        sent = {piece_key(b, mv): checksum(self.last[(b, j)]) for b, moves in enumerate(self.buckets)
                for j, mv in enumerate(moves) if mv.src == self.rank}
        every = all_gather_objects((changed, sent, [r["sums"] for r in results]))
        expected = {k: v for _, mine, _ in every for k, v in mine.items()}
        held = {k: v for _, _, hosts in every for sums in hosts for k, v in sums.items()}
        wrong = sorted({k[1] for k, v in expected.items() if held.get(k) != v})
        if wrong:
            raise RuntimeError(f"delta weight update {self.syncs}: the engine's copy of {len(wrong)} tensors differs "
                               f"from what the trainer sent (e.g. {wrong[:3]}); set rollout.delta_updates=false and "
                               f"resume from the last checkpoint")
        return {"weight_sync/changed_elements": float(sum(c for c, _, _ in every)),
                "weight_sync/checked_pieces": float(len(expected))}

    def _full_update(self) -> bool:
        if not self.delta_full_every:
            return True
        full = self.full_next or self.since_full + 1 >= self.delta_full_every
        self.full_next, self.since_full = False, 0 if full else self.since_full + 1
        return full

    def _piece(self, mv, values: dict) -> torch.Tensor:
        """This rank's piece `mv` in its wire dtype, contiguous."""
        cut = self._cuts[(mv.hf, mv.box)]
        value = current_value(self.holdings.local, cut.param, values)
        dtype = self._torch_dtypes[mv.hf]
        if value.dtype == dtype:
            return cut.piece(value).contiguous()
        return cut.piece(value, out=torch.empty(cut.shape, dtype=dtype, device=value.device))

    def _send_bucket(self, b: int, moves: Sequence) -> int:
        values: dict = {}  # each parameter's current value, resolved once per bucket
        works, pieces, nbytes = [], [], 0
        for mv in moves:
            if mv.src == self.rank:
                piece = self._piece(mv, values)
                pieces.append(piece)  # alive until its send completes
                works.append(self.group.send([piece], self.host_rank[mv.dst], b))
                nbytes += piece.numel() * piece.element_size()
        for work in works:
            work.wait()
        return nbytes

    def _send_bucket_delta(self, b: int, moves: Sequence, full: bool) -> tuple:
        """Per host: a header (one entry per piece this rank sends it, in bucket order), then each piece whole or its
        changes since the last update (megarl.sync.delta). Returns (bytes sent, elements changed)."""
        values: dict = {}  # each parameter's current value, resolved once per bucket
        works, keep, nbytes, changed = [], [], 0, 0
        mine = [(j, mv) for j, mv in enumerate(moves) if mv.src == self.rank]
        for host in sorted({self.host_rank[mv.dst] for _, mv in mine}):
            header, payloads = [], []
            for j, mv in mine:
                if self.host_rank[mv.dst] != host:
                    continue
                piece = self._piece(mv, values)
                # compared and kept in host memory (a copy: on CPU a piece can be a view of the parameter, which the
                # next optimizer step changes in place)
                kept = piece.to("cpu", copy=True)
                entry, tensors = encode(kept, None if full else self.last.get((b, j)))
                if entry != DENSE:
                    changed += entry
                elif not full:
                    changed += piece.numel()
                self.last[(b, j)] = kept
                header.append(entry)
                payloads += [t.to(piece.device) for t in tensors]  # NCCL sends from the device
            header_t = torch.tensor(header, dtype=torch.int64, device=self.holdings.device)
            keep += [header_t, *payloads]  # alive until their sends complete
            works.append(self.group.send([header_t], host, b))
            works += [self.group.send([t], host, b) for t in payloads]
            nbytes += sum(t.numel() * t.element_size() for t in payloads)
        for work in works:
            work.wait()
        return nbytes, changed

    def _metrics(self, sent: int, send_s: float, results: list, seconds: float) -> dict:

        every = all_gather_objects((sent, send_s, results))
        measured = {"sent": {rank: s for rank, (s, _, _) in enumerate(every)}, "received": {}, "loaded": {}}
        host_stats = [h for _, _, hs in every for h in hs]
        for h, stats in enumerate(host_stats):
            measured["received"][self.hosts.rank(h)] = stats["received"]
            measured["loaded"][self.hosts.rank(h)] = stats["loaded"]
        plan = {"sent": self.plan_sent, "received": self.plan_received, "loaded": self.plan_loaded}
        out = dict(host_stats[0]["metrics"]) if host_stats else {}  # the engines' own figures, over every host
        if host_stats:
            out["weight_sync/version"] = min(h["metrics"]["weight_sync/version"] for h in host_stats)
        if "weight_sync/verified_tensors" in out:
            out["weight_sync/verified_tensors"] = float(sum(h["metrics"]["weight_sync/verified_tensors"]
                                                            for h in host_stats))
        for kind in ("sent", "received", "loaded"):
            out[f"weight_sync/{kind}_bytes_max"] = float(max(measured[kind].values(), default=0))
            out[f"weight_sync/{kind}_bytes_rank0"] = float(measured[kind].get(0, 0))
            out[f"weight_sync/plan_{kind}_bytes_max"] = float(max(plan[kind].values(), default=0))
            out[f"weight_sync/plan_{kind}_bytes_rank0"] = float(plan[kind].get(0, 0))
        total = float(sum(measured["loaded"].values()))
        out.update({"weight_sync/seconds": seconds, "weight_sync/bytes": total,
                    "weight_sync/gbps": total / seconds / 1e9 if seconds > 0 else 0.0,
                    "weight_sync/num_buckets": float(len(self.buckets)),
                    "weight_sync/engine_replicas": float(len(self.hosts.owner)),
                    "weight_sync/senders": float(sum(1 for s, _, _ in every if s > 0)),
                    "weight_sync/send_seconds_max": max(t for _, t, _ in every),
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


def plan_remote_sync(holdings: Holdings, engine: Any, bucket_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                     engine_dtype: Optional[str] = None, delta_full_every: int = 0) -> RemoteSync:
    """Plan the sync into engines hosted elsewhere from the trainer's holdings and form the transfer group (a
    collective of the trainer ranks, once per run; megarl.sync.factory). `engine`: this rank's engine handle if it
    holds one (its hosts join the group), else None. `engine_dtype` (a dtype name): what floating-point pieces travel
    in. `delta_full_every` > 0: delta updates (megarl.sync.delta), a full one every that many."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mapping = holdings.mapping
    store, meeting = None, None
    if rank == 0:
        store, addr, port = serve_store(timeout_s)
        meeting = (addr, port, secrets.token_hex(4))
    layouts = engine.transfer_layouts() if engine is not None else []
    every = all_gather_objects((layouts, meeting))
    addr, port, token = every[0][1]
    per_host = [(r, lay) for r, (host_layouts, _) in enumerate(every) for lay in host_layouts]
    if not per_host:
        raise RuntimeError("no engine host to deliver weights to (no trainer rank holds an engine handle)")
    hosts = EngineHosts(world, tuple(r for r, _ in per_host), tuple(len(lay) for _, lay in per_host))
    needs: dict = {}
    for h, (_, lay) in enumerate(per_host):
        for receiver, worker in zip(hosts.receivers(h), lay):
            modules = {k: EngineModule.from_dict(v) for k, v in worker["modules"].items()}
            needs[receiver] = engine_needs(mapping, modules, worker.get("packed"))
    dtypes = wire_dtypes(holdings, engine_dtype)
    sizes = {h: torch.empty((), dtype=getattr(torch, dt)).element_size() for h, dt in dtypes.items()}
    plan = live_plan(mapping, holdings.boxes, needs, sizes, world, max(hosts.workers), len(per_host), separate=True)
    moves, buckets = plan.moves, bucket_moves(plan.moves, bucket_bytes)
    backend = transfer_backend(holdings)
    tspec = TransferSpec(addr, port, f"megarl-transfer-{token}", world + len(per_host), backend, timeout_s)
    mine = hosts.owned_by(rank)
    joining = engine.start_join_transfer(tspec, hosts.rank(mine[0])) if mine else None
    group = join_group(tspec, rank, store)
    if joining is not None:
        joining.result()
        device = "cuda" if backend == "nccl" else "cpu"
        engine.set_receive_plans([receive_plan(token, hosts.receivers(h), buckets, mapping.hf_shapes(), dtypes, needs,
                                               device, delta=delta_full_every > 0) for h in mine])
    return RemoteSync(holdings, moves, buckets, hosts, group, rank, store, dtypes, delta_full_every)
