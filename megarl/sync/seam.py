"""The seam between the weight sync and the engines: all the sync needs from an engine, and nothing else.

Engines (megarl.rollout) implement these; the sync (this package) calls only these, so either side can be read,
tested and changed without the other.

* `UpdateTarget`: an engine whose workers the trainer ranks feed from their own memory (in-process or a child
  process of a trainer rank): each worker's layout, where its parameters can be written in place, and an update
  opened, fed bucket by bucket and closed (or aborted).
* `TransferTarget`: engines in processes of their own (Ray actors, rollout.placement=separate) that receive over a
  transfer group of the trainer ranks and the engine hosts (megarl.sync.transports.remote).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class UpdateTarget(Protocol):
    @property
    def layouts(self) -> list:
        """Every engine worker's parameter shards (megarl.rollout.vllm.worker_ext.megarl_layout), by worker rank."""

    def place_weights(self, needs: Sequence[dict], prefix: str) -> list:
        """Per worker: its parameters moved into a shared-memory file its host writes directly, and where each HF
        tensor lands there ({"why": ...} where it cannot; megarl.sync.placement)."""

    def begin_update(self, verify: bool = False) -> None:
        """Open an update: the workers expect buckets (and placed writes) until end_update or abort_update."""

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> None:
        """Each worker loads its bucket file (metas by worker rank; None: nothing for that worker)."""

    def end_update(self, placed: Optional[Sequence[Optional[dict]]] = None) -> dict:
        """Close the update (bump the weight version; `placed`: the checksums of what was written in place)."""

    def abort_update(self) -> None: ...


@runtime_checkable
class TransferTarget(Protocol):
    """Each `start_*` returns at once; its `result()` waits (a list per engine host)."""

    def transfer_layouts(self) -> list:
        """Per host, every engine worker's layout (as `UpdateTarget.layouts`)."""

    def start_join_transfer(self, spec: Any, first_rank: int) -> Any: ...

    def set_receive_plans(self, plans: list) -> None: ...

    def start_receive_weights(self, sync: int, verify=False) -> Any:
        """verify: what the workers check after loading (begin_update's: True, False or a list of HF names)."""

    def leave_transfer(self) -> None:
        """Leave the transfer group, keeping what was received (another host restarted; RemoteSync.rejoin)."""


def missing_members(cls: type, protocol: type) -> list[str]:
    """The members of `protocol` (and the protocols it extends) that `cls` lacks: a class-level check, no engine is
    started; an attribute set in __init__ counts when the class annotates it."""
    wanted = {m for p in protocol.__mro__ if getattr(p, "_is_protocol", False) and p is not Protocol
              for m in vars(p) if not m.startswith("_")}
    annotated = {k for c in cls.__mro__ for k in getattr(c, "__annotations__", {})}
    return sorted(m for m in wanted if not hasattr(cls, m) and m not in annotated)
