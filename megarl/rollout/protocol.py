"""The engine interface the trainer drives, as a typing.Protocol: `VLLMEngine` (in this process), `EngineProcess` (a
child process) and `RayEngine` (Ray actors) implement it, so megarl.steps never asks which one it holds."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from megarl.types import RolloutBatch


@runtime_checkable
class RolloutEngine(Protocol):
    # generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None, validate: bool = False,
                 prompt_index: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 greedy: bool = False) -> RolloutBatch: ...

    def abort(self) -> None:
        """End the requests in flight; a running generate returns what it has, finish_reason 'abort'."""

    # weights: a stream of full tensors, or the per-worker delivery (begin, one load per bucket, end / abort)
    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False) -> dict: ...

    def begin_update(self, verify: bool = False) -> None: ...

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> None: ...

    def end_update(self) -> dict: ...

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


def missing_members(cls: type) -> list[str]:
    """The members of RolloutEngine that `cls` lacks (a class-level check: no engine is started; an attribute set in
    __init__ counts when the class annotates it)."""
    wanted = [m for m in vars(RolloutEngine) if not m.startswith("_")]
    annotated = {k for c in cls.__mro__ for k in getattr(c, "__annotations__", {})}
    return [m for m in wanted if not hasattr(cls, m) and m not in annotated]
