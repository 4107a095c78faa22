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
With delta updates (megarl.sync.transports.remote_delta) the choice of a whole update is made per host.

Engine hosts that fail (both calls are collectives of every trainer rank, made by all of them in the same order):

    try:
        metrics = sync.run(engine)
    except EngineHostLost as lost:             # raised on EVERY rank, after the sync's collective part
        restarted = rank in lost.owners        # this rank holds the engine handle of a lost host
        if restarted:
            engine = <restart this rank's engine>   # a fresh host: same model, same layout
        sync.rejoin(engine, restarted)         # the old group torn down everywhere, a new one with the same plan
        metrics = sync.run(engine)             # whole to the restarted host, delta to the others (mirrors kept)

A send to a lost host fails at once (gloo raises on a closed peer); the rank finishes its sends to every other host, so
those receive the whole update, and the ranks agree on the lost hosts before any raises (no rank is left waiting in
a collective). An engine restarted for another reason (a hang, a crash between syncs) is followed by the same
`rejoin(engine, restarted)`. Any other error is raised as it is (the run stops). On GPU the same code runs over NCCL
(the trainer's parameters and the host's receive buffers on the GPU, copied into the bucket files); only the gloo path
is exercised on CPU.
"""
from __future__ import annotations

import secrets
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.distributed import all_gather_objects
from megarl.sync.copies import current_value
from megarl.sync.holdings import Holdings
from megarl.sync.moves import bucket_moves
from megarl.sync.plan import live_plan
from megarl.sync.shards import EngineModule, engine_needs
from megarl.sync.transfer import (DEFAULT_TIMEOUT_S, TransferSpec, join_group, leave_group, receive_plan,
                                  serve_store)
from megarl.sync.transports.remote_delta import DeltaSender, DeltaSettings
from megarl.sync.transports.remote_hosts import (EngineHostLost, EngineHosts, host_traffic, process_rss_bytes,
                                                 sync_metrics, transfer_backend, wire_dtypes)

__all__ = ["EngineHostLost", "EngineHosts", "RemoteSync", "plan_remote_sync"]


class RemoteSync:
    """The weight sync of one trainer into engines hosted elsewhere (every trainer rank builds one, with the same
    plan). `run(engine)` is WeightSync.run's counterpart: the same call on every rank, the engine handle on the ranks
    that hold one; `rejoin(engine, restarted)` after an engine host restarted (see the module docstring)."""

    def __init__(self, holdings: Holdings, moves: list, buckets: list, hosts: EngineHosts, rank: int, meeting: tuple,
                 receiving: tuple, layouts: list, store=None, wire_dtypes: Optional[dict] = None,
                 delta: Optional[DeltaSettings] = None):
        """meeting: (addr, port, backend, timeout_s) of the transfer group's store; receiving: (shapes, needs, device)
        of the hosts' receive plans; layouts[h]: host h's workers' layouts as planned."""
        self.holdings = holdings
        self.moves, self.buckets, self.hosts = moves, buckets, hosts
        self.rank, self._store = rank, store  # rank 0 serves the store every transfer group meets on
        self._meeting, self._receiving, self._layouts = meeting, receiving, layouts
        self.group = None
        self._lost: set = set()  # hosts of the last EngineHostLost, until a rejoin
        self.host_rank = hosts.host_of()
        self.plan_sent, self.plan_received, self.plan_loaded = host_traffic(moves, hosts)
        self.syncs = 0
        self.wire_dtypes = wire_dtypes or holdings.hf_dtypes  # {hf name: dtype name} the pieces travel in
        self._torch_dtypes = {h: getattr(torch, dt) for h, dt in self.wire_dtypes.items()}
        self.delta = DeltaSender(delta, hosts.ranks(), sorted({mv.hf for mv in moves})) if delta else None
        self._cuts = holdings.cuts([mv for bucket in buckets for mv in bucket if mv.src == rank])  # compiled once

    def join(self, engine: Any, token: str) -> None:
        """Form the transfer group named by `token` with this rank's hosts and give them their receive plans (a
        collective of every trainer rank and host)."""
        addr, port, backend, timeout_s = self._meeting
        spec = TransferSpec(addr, port, f"megarl-transfer-{token}", self.hosts.world + len(self.hosts.owner), backend,
                            timeout_s)
        mine = self.hosts.owned_by(self.rank)
        joining = engine.start_join_transfer(spec, self.hosts.rank(mine[0])) if mine else None
        self.group = join_group(spec, self.rank, self._store)
        if joining is not None:
            joining.result()
            shapes, needs, device = self._receiving
            engine.set_receive_plans([receive_plan(token, self.hosts.receivers(h), self.buckets, shapes,
                                                   self.wire_dtypes, needs, device, delta=self.delta is not None)
                                      for h in mine])

    def after_restart(self, engine: Any, replicas: set) -> None:
        """The engines of `replicas` were restarted (WeightSync.after_restart's counterpart, a collective): `rejoin`,
        this rank's hosts fresh if one of them is a restarted replica's (host h is replica h: one host per owning
        rank, in rank order; a RayEngine holds every host and names the actors it restarted: `restarted_hosts`)."""
        restarted = any(h in replicas for h in self.hosts.owned_by(self.rank))
        self.rejoin(engine, restarted, getattr(engine, "restarted_hosts", None) if restarted else None)

    def rejoin(self, engine: Any, restarted: bool, fresh: Optional[Sequence[int]] = None) -> None:
        """After engine hosts restarted (a collective of every trainer rank; `restarted`: this rank's engine handle
        was restarted; `fresh`: which of its hosts (positions among them) are new, default all): the old transfer
        group is torn down on every member, a new one formed with the same plan, every host given its receive plan
        again; the next update goes whole to the fresh hosts and as before to the others, whose mirrors are kept. A
        restarted engine must report the layout it was planned with (the same model and engine parallelism)."""
        if restarted and engine is None:
            raise ValueError(f"rejoin(restarted=True) on trainer rank {self.rank}, which holds no engine handle")
        mine = self.hosts.owned_by(self.rank)
        new = [mine[i] for i in fresh] if restarted and fresh is not None else mine if restarted else []
        every = all_gather_objects((new, engine.transfer_layouts() if restarted else None))
        renewed = {h for hosts, _ in every for h in hosts}
        stale = sorted(h for h in self._lost if h - self.hosts.world not in renewed)
        if stale:  # every rank sees it: all raise here, none waits in the group below
            raise RuntimeError(f"rejoin after engine host(s) {stale} were lost, but the trainer ranks owning them "
                               f"({sorted({self.hosts.owner[h - self.hosts.world] for h in stale})}) did not restart "
                               "their engines: call rejoin(engine, restarted=True) there after the restart")
        for r, (_, layouts) in enumerate(every):
            if layouts is not None and layouts != [self._layouts[h] for h in self.hosts.owned_by(r)]:
                raise RuntimeError(f"the engine restarted on trainer rank {r} reports another worker layout than "
                                   "the one the weight sync was planned for; start it with the same model and "
                                   "rollout.tensor_model_parallel_size, or plan the sync again")
        if mine and len(new) < len(mine):
            engine.leave_transfer()  # the hosts that were not restarted keep their mirrors for the next delta update
        leave_group(self.group)
        self.group = None
        token = all_gather_objects(secrets.token_hex(4) if self.rank == 0 else None)[0]
        self.join(engine, token)
        self._lost = set()
        if self.delta is not None:
            self.delta.mark_fresh([self.hosts.rank(h) for h in sorted(renewed)])

    def run(self, engine: Any, verify: bool = False) -> dict:
        """Deliver the current weights (a collective of every trainer rank). Raises EngineHostLost on every rank
        when a host failed during it."""
        self.syncs += 1
        t0 = time.perf_counter()
        full = self.delta.full_hosts() if self.delta is not None else set(self.hosts.ranks())
        check = self.delta.worker_check(self.syncs, verify) if self.delta is not None else verify
        owned = self.hosts.owned_by(self.rank)
        pending = engine.start_receive_weights(self.syncs, check) if owned else None
        lost: dict = {}  # {host transfer rank: what failed}
        sent = changed = 0
        try:
            for b, moves in enumerate(self.buckets):
                bucket_sent, bucket_changed = self._send_bucket(b, moves, full, lost)
                sent, changed = sent + bucket_sent, changed + bucket_changed
        except BaseException:
            if self.delta is not None:
                self.delta.mark_fresh(self.hosts.ranks())  # what the hosts hold is unknown now
            if pending is not None:
                pending.result()  # the host's own error says more than a broken connection
            raise
        send_s = time.perf_counter() - t0
        results = []
        if pending is not None:
            try:
                results = pending.result()
            except Exception as exc:  # noqa: BLE001 - the host is lost; every rank learns it below
                # the host's own error first; a RayEngine names which of its actors were lost (RayReplicasLost.hosts)
                which = [owned[i] for i in exc.hosts] if hasattr(exc, "hosts") else owned
                lost.update({self.hosts.rank(h): _cause(exc) for h in which})
        seconds = time.perf_counter() - t0  # the delivery; the checks and their gather below are not counted
        # one gather of the trainer ranks for the losses, the metrics and the delta check
        mine = {"lost": lost, "sent": sent, "send_s": send_s, "results": results, "rss": process_rss_bytes(),
                "delta": self.delta.report(self.buckets, self.rank, changed) if self.delta is not None else None}
        every = all_gather_objects(mine)
        gone: dict = {}
        for r, e in enumerate(every):
            for h, cause in e["lost"].items():
                if h not in gone or r == self.hosts.owner[h - self.hosts.world]:  # the host's own error over a send's
                    gone[h] = cause
        if gone:
            if self.delta is not None:
                self.delta.mark_fresh(gone)
            self._lost.update(gone)
            owners = sorted({self.hosts.owner[h - self.hosts.world] for h in gone})
            raise EngineHostLost(sorted(gone), owners, [f"host {h}: {c}" for h, c in sorted(gone.items())], self.syncs)
        plan = {"sent": self.plan_sent, "received": self.plan_received, "loaded": self.plan_loaded}
        metrics = sync_metrics([(e["sent"], e["send_s"], e["results"], e["rss"]) for e in every], self.hosts, plan,
                               seconds, len(self.buckets))
        if self.delta is not None:
            metrics["weight_sync/full_update"] = float(len(full) == len(self.hosts.owner))
            metrics["weight_sync/full_hosts"] = float(len(full))
            metrics.update(self.delta.check(self.syncs, [e["delta"] for e in every], [e["results"] for e in every]))
        return metrics

    def _piece(self, mv, values: dict) -> torch.Tensor:
        """This rank's piece `mv` in its wire dtype, contiguous."""
        cut = self._cuts[(mv.hf, mv.box)]
        value = current_value(self.holdings.local, cut.param, values)
        dtype = self._torch_dtypes[mv.hf]
        if value.dtype == dtype:
            return cut.piece(value).contiguous()
        return cut.piece(value, out=torch.empty(cut.shape, dtype=dtype, device=value.device))

    def _send_bucket(self, b: int, moves: Sequence, full: set, lost: dict) -> tuple:
        """This rank's pieces of bucket b, host by host: with delta updates a header first (one megarl.sync.delta
        entry per piece, in bucket order), then each piece whole or its changes. A host whose send fails is added to
        `lost` and skipped from then on; the other hosts get theirs. Returns (bytes sent, elements changed)."""
        values: dict = {}  # each parameter's current value, resolved once per bucket
        posted, nbytes, changed = [], 0, 0
        mine = [(j, mv) for j, mv in enumerate(moves) if mv.src == self.rank]
        for host in sorted({self.host_rank[mv.dst] for _, mv in mine} - set(lost)):
            header, tensors = [], []
            for j, mv in mine:
                if self.host_rank[mv.dst] != host:
                    continue
                piece = self._piece(mv, values)
                if self.delta is None:
                    tensors.append(piece)
                    continue
                entry, encoded = self.delta.encode((b, j), piece, host in full, host)
                changed += entry[1] if host not in full else 0
                header.append(entry)
                tensors += encoded
            nbytes += sum(t.numel() * t.element_size() for t in tensors)
            if self.delta is not None:
                tensors.insert(0, torch.tensor(header, dtype=torch.int64, device=self.holdings.device))
            try:
                posted.append((host, [self.group.send([t], host, b) for t in tensors], tensors))  # kept until sent
            except RuntimeError as exc:  # gloo raises at once on a closed peer
                lost[host] = _cause(exc)
        for host, works, _ in posted:
            try:
                for work in works:
                    work.wait()
            except RuntimeError as exc:
                lost.setdefault(host, _cause(exc))
        return nbytes, changed


def _cause(exc: BaseException) -> str:
    """An error's first line (gloo's run to many), for EngineHostLost."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def plan_remote_sync(holdings: Holdings, engine: Any, bucket_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                     engine_dtype: Optional[str] = None, delta: Optional[DeltaSettings] = None) -> RemoteSync:
    """Plan the sync into engines hosted elsewhere from the trainer's holdings and form the transfer group (a
    collective of the trainer ranks, once per run; megarl.sync.factory). `engine`: this rank's engine handle if it
    holds one (its hosts join the group), else None. `engine_dtype` (a dtype name): what floating-point pieces travel
    in. `delta`: delta updates (megarl.sync.delta) with these settings; None: every update whole."""
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
    receiving = (mapping.hf_shapes(), needs, "cuda" if backend == "nccl" else "cpu")
    sync = RemoteSync(holdings, moves, buckets, hosts, rank, (addr, port, backend, timeout_s), receiving,
                      [lay for _, lay in per_host], store, dtypes, delta)
    sync.join(engine, token)
    return sync
