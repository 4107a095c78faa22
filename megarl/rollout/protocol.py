"""The engine interface the trainer drives, as a typing.Protocol: `VLLMEngine` (in this process), `EngineProcess` (a
child process) and `RayEngine` (Ray actors) implement it, so megarl.steps never asks which one it holds. What the
weight sync needs of an engine is the narrower seam in megarl.sync.seam: `UpdateTarget` (part of this interface) and,
for engines in processes of their own, `TransferTarget` (`EngineProcess` and `RayEngine`; RayEngine has no
begin_update / load_bucket, since its actors are never fed from a trainer rank's memory)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from megarl import lifecycle
from megarl.sync.seam import UpdateTarget
from megarl.types import RolloutBatch


class EngineStartError(RuntimeError, lifecycle.Explained):
    """The engine could not start; the message names the cause and the config change that fixes it, and ends with its
    troubleshooting entry: error_id, or the link an explain_* message already holds."""

    def __init__(self, message: str, error_id: Optional[str] = None):
        super().__init__(message if error_id is None else f"{message} {lifecycle.see(error_id)}")
        self.error_id = error_id


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
class RolloutEngine(UpdateTarget, Protocol):
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

    # weights: a stream of full tensors; the per-worker delivery's calls come from megarl.sync.seam.UpdateTarget
    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False) -> dict: ...

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
