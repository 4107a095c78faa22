"""What both ends of a remote weight transfer agree on (megarl.sync.transports.remote sends, the engine host's
megarl.rollout.hosting.receiver receives): the transfer group and the part of the plan each engine host receives.

The transfer group holds the trainer's N ranks (transfer rank = trainer rank) and one rank per engine host (N, N+1,
...). It is formed once, when the sync is planned, over a TCPStore that trainer rank 0 serves, with `ProcessGroupGloo`
/ `ProcessGroupNCCL` built directly: the default group of a trainer rank spans the trainer only, and the one of an
engine host belongs to vLLM's in-process engine. Each host is given, once, the part of the plan it receives
(`ReceivePlan`), so only a sync number travels per update. After an engine host restarts, every member leaves the
group (`leave_group`) and a new one is formed under a new name with the same plan (RemoteSync.rejoin).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class TransferSpec:
    """Where the transfer group meets and what it runs on (small and picklable: it travels to the engine hosts)."""

    addr: str
    port: int
    prefix: str
    size: int
    backend: str = "gloo"  # "nccl" on GPU
    timeout_s: float = DEFAULT_TIMEOUT_S


def reachable_address() -> str:
    """An address of this machine the engine hosts can reach: the interface that routes to the trainer's master (or
    the Ray head), else loopback for a run on one machine."""
    for var in ("MASTER_ADDR", "RAY_ADDRESS"):
        peer = (os.environ.get(var) or "").split("://")[-1].rsplit(":", 1)[0]
        if peer and peer not in ("localhost", "auto", "local") and not peer.startswith("127."):
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((peer, 1))  # no packet is sent: this only picks the outgoing interface
                    return s.getsockname()[0]
            except OSError:
                continue
    return "127.0.0.1"


def serve_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple:
    """A TCPStore for the transfer group's rendezvous, served by this process on a free port: (store, addr, port)."""
    addr = reachable_address()
    store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store, addr, store.port


def join_group(spec: TransferSpec, rank: int, store: Optional[dist.Store] = None):
    """This process's end of the transfer group (blocks until all `spec.size` ranks have joined)."""
    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.addr, spec.port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(spec.prefix, store)
    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, spec.size, options)
    return dist.ProcessGroupGloo(store, rank, spec.size, timeout)


def leave_group(group) -> None:
    """Tear down this process's end of a transfer group (no collective: every member leaves its own end, and a peer
    that died has none). Its connections close; the group is not used again."""
    if group is None:
        return
    try:
        group.abort()  # does not wait on a peer that is gone, as shutdown() may
    except Exception:  # noqa: BLE001 - best effort: a group whose peers are gone may be closed already
        pass


@dataclass
class ReceivePlan:
    """What one engine host receives at every sync: for each bucket of the sync the moves to its workers (empty
    where it has none), and how to lay them out in each worker's bucket file."""

    token: str
    workers: list  # receiver ids of the host's workers, in engine rank order
    buckets: list  # [[Move]] per bucket of the sync
    shapes: dict  # {hf_name: full shape}
    dtypes: dict  # {hf_name: dtype name}
    needs: dict  # {receiver id: {hf_name: box}}
    device: str = "cpu"  # where pieces arrive first (NCCL: the GPU); on CPU straight into the files when contiguous
    delta: bool = False  # each bucket opens with a header per sender; pieces arrive in megarl.sync.delta's formats


def piece_key(b: int, mv) -> tuple:
    """A piece's name on both sides of a sync (bucket, tensor, receiver, box)."""
    return b, mv.hf, mv.dst, tuple(tuple(side) for side in mv.box)


def receive_plan(token: str, receivers: list, buckets: list, shapes: dict, dtypes: dict, needs: dict,
                 device: str, delta: bool = False) -> ReceivePlan:
    """The part of the sync plan one host receives: its workers' moves of every bucket, and their tensors' layout."""
    parts = [[mv for mv in bucket if mv.dst in receivers] for bucket in buckets]
    names = {mv.hf for part in parts for mv in part}
    return ReceivePlan(token, receivers, parts, {n: tuple(shapes[n]) for n in names}, {n: dtypes[n] for n in names},
                       {w: needs[w] for w in receivers}, device, delta)
