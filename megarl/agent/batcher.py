"""An async generate interface over a synchronous batch generate: requests made while a batch runs go together into
the next one, so every trajectory waiting for the model shares one engine call (continuous at the turn level).

    batcher = TurnBatcher(generate_many)    # generate_many(list of Request) -> list of list of Completion
    completions = await batcher.agenerate(prompt_ids, sampling, n=1, seed=None)

The engine call runs in a worker thread, so tools (threads, HTTP) keep running on the loop while the model generates.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class Completion:
    """One sampled continuation: token_ids, logprobs (None when not requested), finish_reason ("stop" | "length" |
    "abort"), token_versions (the engine weight version of each token)."""

    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: str
    token_versions: list[int] = field(default_factory=list)


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: dict
    n: int
    seed: Optional[int]


class TurnBatcher:
    """Collects agenerate calls and runs them as batches through `generate_many` (one batch at a time)."""

    def __init__(self, generate_many: Callable[[list[Request]], list[list[Completion]]], settle_rounds: int = 4):
        self._generate_many = generate_many
        self._settle = settle_rounds
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._task: Optional[asyncio.Task] = None
        self.batches = 0  # engine calls made (a measure of how well requests were batched)

    async def agenerate(self, prompt_ids, sampling: dict, n: int = 1, seed: Optional[int] = None) -> list[Completion]:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((Request(list(prompt_ids), dict(sampling), int(n), seed), future))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            for _ in range(self._settle):  # let trajectories that just got an answer reach their next request
                await asyncio.sleep(0)
            batch, self._pending = self._pending, []
            try:
                results = await loop.run_in_executor(None, self._generate_many, [r for r, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - every waiting trajectory sees the engine's error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.batches += 1
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
