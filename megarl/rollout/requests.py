"""Request-level control of a vLLM engine: megarl steps the engine itself instead of calling `LLM.generate`.

Why: `LLM.generate` returns only when every request has finished, so an abort could never hand back what was already
generated, and many independent callers (multi-turn trajectories waiting on tools) could not share the engine. Here
every request streams its new tokens (vLLM's DELTA outputs) into a `Completion`, so at any step:

* `abort` ends the requests in flight and their completions keep the tokens and logprobs generated so far
  (finish_reason "abort");
* `await RequestDriver.run(...)` lets many coroutines wait on their own requests while one pump steps the engine;
* every token records the engine weight version that produced it (partial rollouts across weight updates).

Abort is signalled through a counter (`AbortSignal`) rather than a call: it can be raised from another thread or, as
a shared value, from another process (the trainer, while the engine process is busy generating). A request is aborted
when the counter moved after it was submitted, so an abort only ever hits the requests in flight at that moment.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from copy import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from megarl.types import FINISH_REASONS


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    token_ids: the R sampled tokens. logprobs: R floats (the engine's logprob of each sampled token) or None when
    logprobs were not requested. finish_reason: "stop", "length" or "abort" (also while still running).
    token_versions: R ints, the engine weight version that sampled each token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    finish_reason: str = "abort"
    token_versions: list[int] = field(default_factory=list)
    finished: bool = False
    engine_request_id: str = ""  # vLLM's internal id of the request that sampled it (a child's for n > 1)


class AbortSignal:
    """A counter that `raise_()` moves; requests submitted before the move are aborted at the next engine step.

    shared: a multiprocessing Value('q') to signal across processes (None: a thread-safe in-process counter)."""

    def __init__(self, shared: Any = None):
        self._shared = shared
        self._local = 0
        self._lock = threading.Lock()

    @property
    def shared(self) -> Any:
        """The shared value (to hand to another process), or None."""
        return self._shared

    @property
    def epoch(self) -> int:
        if self._shared is not None:
            return int(self._shared.value)
        return self._local

    def raise_(self) -> None:
        if self._shared is not None:
            with self._shared.get_lock():
                self._shared.value += 1
        else:
            with self._lock:
                self._local += 1


def open_rgb(ref):
    """An image prompt's image (encoded bytes or a path, megarl.data.images) as an RGB PIL image, as the trainer's
    megarl.data.vision opens it: both sides' image processors see the same pixels."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
        return im.convert("RGB")


class RequestDriver:
    """Adds requests to a vLLM LLMEngine and steps it, collecting each request's completions.

    Args:
        llm_engine: vllm's LLMEngine (the in-process engine core of `vllm.LLM`).
        version: returns the engine weight version (recorded per token).
        signal: the AbortSignal checked before every engine step.
        lora_request: returns the vllm LoRARequest every new request carries (None: the base model), read at each
            add: the adapter sync (megarl.sync.transports.adapter) replaces it between generations.
        progress: called before every engine step (the watchdog's sign of progress, megarl.rollout.health)."""

    def __init__(self, llm_engine, version: Callable[[], int], signal: Optional[AbortSignal] = None,
                 lora_request: Optional[Callable[[], Any]] = None, progress: Optional[Callable[[], None]] = None):
        self._engine = llm_engine
        self._progress = progress or (lambda: None)  # the watchdog's tick (megarl.rollout.health), once per step
        self._version = version
        self._lora_request = lora_request or (lambda: None)  # the engine's current LoRA adapter (None: the base)
        self.signal = signal or AbortSignal()
        self._ids = itertools.count()
        self._live: dict[str, list[Completion]] = {}  # request id -> its n completions
        self._epoch: dict[str, int] = {}  # request id -> abort epoch at submission
        self._waiters: dict[str, asyncio.Future] = {}
        self._pump: Optional[asyncio.Task] = None

    # -- synchronous use ----------------------------------------------------------------------------------------------
    def add(self, prompt_ids: Sequence[int], params, multi_modal_data: Optional[dict] = None) -> str:
        """Queue one request (params: vllm.SamplingParams; its `n` completions come back in index order).
        multi_modal_data: vLLM's per-request images ({"image": [PIL images]}), the prompt holding one placeholder
        token per image (vLLM's processor expands each to the image's tokens)."""
        from vllm.sampling_params import RequestOutputKind

        params = copy(params)
        params.output_kind = RequestOutputKind.DELTA
        rid = f"megarl-{next(self._ids)}"
        want_lp = params.logprobs is not None
        self._live[rid] = [Completion(logprobs=[] if want_lp else None) for _ in range(params.n)]
        self._epoch[rid] = self.signal.epoch
        prompt = {"prompt_token_ids": list(prompt_ids)}
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        internal = self._engine.add_request(rid, prompt, params, lora_request=self._lora_request())
        # vLLM makes the id unique ("<rid>-<8 random chars>") and fans n > 1 out into children "<j>_<that id>": the
        # ids its workers see (routed experts are kept under them)
        internal = internal if isinstance(internal, str) else rid
        for j, comp in enumerate(self._live[rid]):
            comp.engine_request_id = internal if params.n == 1 else f"{j}_{internal}"
        return rid

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def step(self) -> list[str]:
        """Abort what the signal says, then one engine step; returns the ids of the requests that ended (finished or
        aborted); their completions are `pop`ped by the caller."""
        # a tick also while every request waits on a tool (the multi-turn pump steps on): the engine is not hung
        self._progress()
        ended = self._abort_signalled()
        if not self._live:
            return ended
        version = self._version()
        for out in self._engine.step():
            comps = self._live.get(out.request_id)
            if comps is None:
                continue
            for c in out.outputs:
                _append(comps[c.index], c, version)
            if out.finished:
                ended.append(out.request_id)
        return ended

    def pop(self, rid: str) -> list[Completion]:
        self._epoch.pop(rid, None)
        return self._live.pop(rid)

    def abort(self, rids: Optional[Sequence[str]] = None) -> list[str]:
        """End the given requests (default: all in flight) now; their completions keep what they generated."""
        rids = list(self._live) if rids is None else [r for r in rids if r in self._live]
        if rids:
            self._engine.abort_request(rids, internal=False)
        return rids

    def run_to_end(self, rids: Sequence[str]) -> dict[str, list[Completion]]:
        """Step until every given request has ended (finished or aborted by the signal)."""
        waiting, done = set(rids), {}
        while waiting:
            for rid in self.step():
                if rid in waiting:
                    waiting.discard(rid)
                    done[rid] = self.pop(rid)
        return done

    def _abort_signalled(self) -> list[str]:
        now = self.signal.epoch
        stale = [rid for rid, e in self._epoch.items() if e != now]
        return self.abort(stale)

    # -- asynchronous use: many coroutines, one pump ------------------------------------------------------------------
    async def run(self, prompt_ids: Sequence[int], params) -> list[Completion]:
        """Generate one request while other coroutines of this event loop generate theirs."""
        rid = self.add(prompt_ids, params)
        future = asyncio.get_running_loop().create_future()
        self._waiters[rid] = future
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._pump_steps())
        return await future

    async def _pump_steps(self) -> None:
        # The step itself blocks the loop (it is the model's forward); between steps, tool calls and other
        # coroutines run, and new requests join the next step.
        try:
            while self._waiters:
                for rid in self.step():
                    comps = self.pop(rid)
                    waiter = self._waiters.pop(rid, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(comps)
                await asyncio.sleep(0)
        except BaseException as exc:  # an engine failure reaches every waiting coroutine
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(exc)
            self._waiters.clear()


def _append(comp: Completion, delta, version: int) -> None:
    toks = list(delta.token_ids)
    comp.token_ids.extend(toks)
    comp.token_versions.extend([version] * len(toks))
    if comp.logprobs is not None and toks:
        comp.logprobs.extend(step[t].logprob for step, t in zip(delta.logprobs, toks))
    if delta.finish_reason is not None:
        comp.finished = True
        comp.finish_reason = delta.finish_reason if delta.finish_reason in FINISH_REASONS else "abort"
