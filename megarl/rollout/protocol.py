"""The engine interface the trainer drives, as a typing.Protocol: `VLLMEngine` (in this process), `EngineProcess` (a
child process) and `RayEngine` (Ray actors) implement it, so megarl.steps never asks which one it holds. Engines in
processes of their own receive weights over a transfer group instead of the shared-memory calls (`EngineHosts`:
`EngineProcess` and `RayEngine`; RayEngine has no begin_update / load_bucket, since its actors are never fed from a
trainer rank's memory)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from megarl.types import RolloutBatch


class Deferred:
    """The handle of a call started elsewhere (an engine-process call, a Ray task): `result()` waits once and keeps
    the value. `Deferred.ready(value)` is the handle of a call that already ran (where nothing can overlap)."""

    def __init__(self, wait: Callable[[], Any]):
        self._wait, self._done, self._value = wait, False, None

    @classmethod
    def ready(cls, value: Any) -> "Deferred":
        handle = cls(lambda: value)
        handle._value, handle._done = value, True
        return handle

    def result(self) -> Any:
        if not self._done:
            self._value, self._done = self._wait(), True
        return self._value


@runtime_checkable
class RolloutEngine(Protocol):
    # generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None, validate: bool = False,
                 prompt_index: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 greedy: bool = False) -> RolloutBatch: ...

    def start_generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs) -> Any:
        """As generate, returning a handle whose result() is the RolloutBatch; the engine process generates while
        the caller goes on (the in-process and Ray engines finish before returning)."""

    def rollout_agents(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None,
                       validate: bool = False, prompt_index: Optional[Sequence[int]] = None,
                       seed: Optional[int] = None, extra_infos: Optional[Sequence[Optional[dict]]] = None
                       ) -> RolloutBatch:
        """Multi-turn rollouts with tool calls (rollout.multi_turn): the batch carries loss_mask and tool_rewards."""

    def abort(self) -> None:
        """End the requests in flight; a running generate returns what it has, finish_reason 'abort'."""

    # weights: a stream of full tensors, or the per-worker delivery (begin, one load per bucket, end / abort)
    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False) -> dict: ...

    def begin_update(self, verify: bool = False) -> None: ...

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> None: ...

    def end_update(self, placed: Optional[Sequence[Optional[dict]]] = None) -> dict: ...

    def place_weights(self, needs: Sequence[dict], prefix: str) -> list:
        """Per worker: its parameters moved into a shared-memory file its host writes directly, and where each HF
        tensor lands there ({"why": ...} where it cannot; megarl.rollout.placement)."""

    def abort_update(self) -> None: ...

    @property
    def layouts(self) -> list:
        """Every engine worker's parameter shards (megarl.rollout.worker_ext.megarl_layout), by worker rank."""

    @property
    def weight_version(self) -> int: ...

    def checksums(self) -> dict: ...

    def expected_checksums(self, hf_checksums: Mapping[str, Any]) -> dict: ...

    def verify_weights(self, expected: Mapping[str, Any], rtol: float = 1e-9) -> dict: ...

    # memory
    @property
    def sleeps(self) -> bool: ...

    def sleep(self) -> None: ...

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class EngineHosts(Protocol):
    """The weight delivery of engines in processes of their own (megarl.rollout.remote): `EngineProcess` (one host)
    and `RayEngine` (one host per replica). Each `start_*` returns at once; its `result()` waits (a list per host)."""

    def transfer_layouts(self) -> list:
        """Per host, every engine worker's layout (as `layouts`)."""

    def start_join_transfer(self, spec: Any, first_rank: int) -> Any: ...

    def set_receive_plans(self, plans: list) -> None: ...

    def start_receive_weights(self, sync: int, verify: bool = False) -> Any: ...


def missing_members(cls: type, protocol: type = RolloutEngine) -> list[str]:
    """The members of `protocol` that `cls` lacks (a class-level check: no engine is started; an attribute set in
    __init__ counts when the class annotates it)."""
    wanted = [m for m in vars(protocol) if not m.startswith("_")]
    annotated = {k for c in cls.__mro__ for k in getattr(c, "__annotations__", {})}
    return [m for m in wanted if not hasattr(cls, m) and m not in annotated]
