"""When each step's batch is generated, and with which weights (trainer.mode).

Versions count the trainer's steps: the actor is at version v after v steps, and a batch generated with the weights
of version e is v - e versions stale when step v + 1 trains on it. The engines' weights change only at a sync, and a
sync waits until no generation is in flight (async_training.partial_rollout=finish), so every sample of a batch
carries the one version its engine held when the batch started.

    sync                  ahead 0: step t generates its batch with version t-1, trains, syncs.
    one_step_off_policy   ahead 1, staleness <= 1: while step t trains, the engines generate the batch of step t+1
                          with version t-1; the sync to version t comes between the two generations.
    async                 ahead B = async_training.buffer_size batches, staleness <= S = max_staleness: the engines
                          run up to B batches ahead of the trainer; a batch starts only if it will be at most S
                          versions stale when trained on, and the engines sync whenever none is in flight.

The rule is the same in every mode (`RolloutSchedule.next_batch`):
  1. the batch of step t is taken from the buffer (started now if it is not there: the engines are idle);
  2. a batch more than S versions stale (possible after a resume with a smaller max_staleness) is dropped and
     generated again, with the same prompts and seeds, by the current weights; counted in async/dropped_samples;
  3. when no generation is in flight and the engines hold older weights than the actor, they sync;
  4. batches t+1, t+2, ... start while fewer than B are buffered and each will be at most S versions stale.
Every decision depends only on step counts, never on timing, so all ranks take the same ones (the generations and
syncs are collectives) and a run is reproducible: batch k is always loader batch k, sampled with rollout_seed(k).

Resume: a checkpoint holds the buffer and the versions. Before a save the in-flight generations are awaited
(`drain`), so the saved buffer is complete batches (their samples, logprobs and versions; the prompts are re-read from
the data position each was drawn at). Awaiting them changes no decision, and batches start only when the engines hold
the actor's current weights, so a resumed run (whose engines start with the checkpoint's weights) generates nothing
before the schedule's next sync, which gives its engines the same weights as the run that saved: the resume is exact,
and a run's batches do not depend on when it saves.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from megarl.types import FINISH_REASONS, RolloutBatch, pad_rows

log = logging.getLogger("megarl")


class Generation(Protocol):
    """What the schedule drives: the engines, seen from every rank (see megarl.steps for the real one)."""

    def start(self, records: list, seed: int) -> Any:
        """Start generating `records` (not collective); returns a handle for `finish`."""

    def finish(self, handle: Any) -> RolloutBatch:
        """Wait for a started generation (collective); every rank gets the whole batch."""

    def sync(self) -> dict:
        """Deliver the actor's current weights to the engines (collective; none may be generating); metrics."""

    def abort(self) -> None:
        """End the generation running on this rank's engine (not collective): it returns what it has, the samples
        it cut short with finish_reason "abort". Only async_training.partial_rollout=abort_resume calls it."""

    def resume(self, batch: RolloutBatch, rows: list, num_prompts: int, seed: int) -> Any:
        """Start continuing `rows` of `batch` (each its prompt + partial response, for the budget left) with the
        engines' current weights (not collective); `finish` returns the new tokens, one row per entry of `rows`."""


def schedule_shape(mode: str, max_staleness: int, buffer_size: Optional[int]) -> tuple[int, int]:
    """(batches generated ahead at most, largest staleness allowed) of trainer.mode."""
    if mode == "sync":
        return 0, 0
    if mode == "one_step_off_policy":
        return 1, 1
    if mode == "async":
        return (max_staleness if buffer_size is None else buffer_size), max_staleness
    raise ValueError(f"trainer.mode={mode!r}: expected sync, one_step_off_policy or async")


@dataclass
class Batch:
    """One step's batch in the buffer: its prompts, the version generating it, its handle or its rollout."""

    step: int
    records: list
    version: int
    loader_state: dict  # the data position its prompts were drawn at (to re-read them after a resume)
    handle: Any = None  # the generation in flight (the batch's own, or the continuation of its aborted rows)
    rollout: Optional[RolloutBatch] = None
    resumed_rows: Optional[list] = None  # rows the handle continues (abort_resume)
    resumed_version: int = 0
    # Started and not yet taken (or settled): what the schedule's decisions see. A save awaits the rollout but keeps
    # the batch pending, so that saving changes no decision (a run saving at other steps, or at a SIGTERM, and a run
    # resumed from any of its saves all generate the same batches with the same weights).
    pending: bool = True


@dataclass
class RolloutSchedule:
    """The buffer of batches generated ahead and the versions of actor and engines (identical on every rank).

        schedule = RolloutSchedule(generation, loader, batch_size, seed_of, *schedule_shape(...), total_steps)
        for step ...:
            records, rollout, metrics = schedule.next_batch(step)   # may sync the engines first
            ... train ...
            metrics.update(schedule.updated())                      # the actor moved on; syncs if nothing is in flight
    Before validating: `settle()` (the engines then hold the actor's weights). Checkpointed as a state (state_dict).
    """

    generation: Optional[Generation]  # set once the engines run (the schedule's state loads before they start)
    loader: Any  # PromptLoader: next_batch(n), state_dict(), load_state_dict()
    batch_size: int
    seed_of: Callable[[int], int]  # step -> rollout seed
    ahead: int
    max_staleness: int
    last_step: int  # trainer.total_steps: nothing is generated for later steps
    abort_resume: bool = False  # async_training.partial_rollout: abort in-flight generations at a sync, then resume
    response_length: int = 0  # rollout.response_length: a resumed sample's budget is what its partial leaves
    version: int = 0  # the actor's: steps trained
    engine_version: int = 0  # the version the engines hold
    buffer: list = field(default_factory=list)  # Batch, by step
    dropped_samples: int = 0

    # -- the step's batch ---------------------------------------------------------------------------------------------
    def next_batch(self, step: int) -> tuple[list, RolloutBatch, dict]:
        """(records, rollout, metrics) of `step` (collective). metrics: staleness, buffer, dropped and sync ones."""
        if step != self.version + 1:
            raise RuntimeError(f"the rollout schedule is at version {self.version} and was asked for step {step}: "
                               "steps must follow each other (call updated() after each)")
        metrics: dict = {}
        if not self.buffer:  # nothing generated ahead (sync mode, or the first step): the engines are idle
            metrics.update(self._sync_if_behind())
            self._start(step)
        batch = self.buffer.pop(0)
        assert batch.step == step, (batch.step, step)
        self._finish(batch)
        dropped = 0
        if self.version - batch.version > self.max_staleness:
            dropped = len(batch.rollout)
            log.warning("the batch of step %d is %d versions stale (async_training.max_staleness=%d): generating it "
                        "again with the current weights", step, self.version - batch.version, self.max_staleness)
            metrics.update(self.settle())
            batch = self._regenerate(batch)
        self.dropped_samples += dropped
        if self.abort_resume and self.engine_version != self.version and any(b.pending for b in self.buffer):
            metrics.update(self._abort_sync_resume())
        if not any(b.pending for b in self.buffer):
            metrics.update(self._sync_if_behind())
        self._top_up()
        metrics.update(self._staleness_metrics(batch, dropped))
        return batch.records, batch.rollout, metrics

    def updated(self) -> dict:
        """The actor took the step's update (collective). With nothing in flight (sync mode) the engines sync now."""
        self.version += 1
        if any(b.pending for b in self.buffer):
            return {}
        return self._sync_if_behind()

    def settle(self) -> dict:
        """Collective: await every generation in flight and sync, so the engines hold the actor's weights (before a
        validation). The buffered batches keep their versions."""
        self.drain()
        for b in self.buffer:
            b.pending = False
        return self._sync_if_behind()

    def drain(self) -> None:
        """Collective: await every generation in flight (they stay in the buffer, complete and pending)."""
        for b in self.buffer:
            self._finish(b)

    # -- internals ----------------------------------------------------------------------------------------------------
    def _sync_if_behind(self) -> dict:
        if self.engine_version == self.version:
            return {}
        if any(b.handle is not None for b in self.buffer):
            raise RuntimeError("the rollout schedule would sync the engines while they generate")
        metrics = self.generation.sync()
        self.engine_version = self.version
        return metrics

    def _start(self, step: int) -> None:
        state = self.loader.state_dict()
        records = self.loader.next_batch(self.batch_size)
        self.buffer.append(Batch(step, records, self.engine_version, state,
                                 handle=self.generation.start(records, self.seed_of(step))))

    def _finish(self, batch: Batch) -> None:
        if batch.handle is None:
            return
        got = self.generation.finish(batch.handle)
        batch.handle = None
        if batch.resumed_rows is None:
            batch.rollout = with_versions(got, batch.version)
        else:
            batch.rollout = merge_continuation(batch.rollout, batch.resumed_rows, got, batch.resumed_version)
            batch.resumed_rows = None

    def _abort_sync_resume(self) -> dict:
        """abort_resume: cut the generations in flight short, sync, and resume their unfinished samples with the new
        weights (batches queued behind the running one finish with the weights they started with)."""
        self.generation.abort()
        self.drain()
        for b in self.buffer:
            b.pending = False
        metrics = self._sync_if_behind()
        resumed = 0
        for b in self.buffer:
            rows = resumable_rows(b.rollout, self.response_length)
            if rows:
                b.handle = self.generation.resume(b.rollout, rows, len(b.records), self.seed_of(b.step) + 104_729 *
                                                  self.engine_version)
                b.resumed_rows, b.resumed_version, b.pending = rows, self.engine_version, True
                resumed += len(rows)
        return {**metrics, "async/resumed_samples": float(resumed)}

    def _regenerate(self, batch: Batch) -> Batch:
        again = Batch(batch.step, batch.records, self.engine_version, batch.loader_state,
                      handle=self.generation.start(batch.records, self.seed_of(batch.step)))
        self._finish(again)
        return again

    def _top_up(self) -> None:
        """When the engines hold the actor's weights: start the next batches while the buffer has room and each will
        be at most max_staleness stale (the batch of step k trains at version k-1). Never with older weights: after a
        resume the engines hold the checkpoint's, not the older ones the interrupted run would have used."""
        if self.engine_version != self.version:
            return
        nxt = self.version + 1 + len(self.buffer) + 1  # this step's batch is out of the buffer already
        while (len(self.buffer) < self.ahead and nxt <= self.last_step
               and (nxt - 1) - self.engine_version <= self.max_staleness):
            self._start(nxt)
            nxt += 1

    def _staleness_metrics(self, batch: Batch, dropped: int) -> dict:
        """Per sample, its oldest token's staleness (the batch's start version for an empty response)."""
        rollout = batch.rollout
        mask = rollout.response_mask()
        oldest = torch.where(mask, rollout.token_versions, self.version).amin(-1) if rollout.response_ids.numel() \
            else torch.full((len(rollout),), self.version)
        oldest = torch.where(mask.any(-1), oldest, batch.version)
        stale = (self.version - oldest).float()
        old_tokens = (rollout.token_versions < self.version) & mask
        return {"async/staleness_mean": float(stale.mean()) if len(stale) else 0.0,
                "async/staleness_max": float(stale.max()) if len(stale) else 0.0,
                "async/off_policy_token_frac": float(old_tokens.sum() / mask.sum()) if bool(mask.any()) else 0.0,
                "async/sample_version": float(batch.version), "async/engine_version": float(self.engine_version),
                "async/batches_ahead": float(len(self.buffer)), "async/dropped_samples": float(dropped),
                "async/dropped_samples_total": float(self.dropped_samples)}

    # -- checkpoint ---------------------------------------------------------------------------------------------------
    def before_save(self) -> None:
        """Collective, on every rank before a checkpoint is written: the saved buffer holds complete batches only."""
        self.drain()

    def resumed(self, step: int) -> None:
        """The run resumed after `step`, with the buffer of the checkpoint (or none: a fresh run, a sync mode one, or
        a checkpoint from before trainer.mode existed)."""
        if self.version != step:  # no schedule state in the checkpoint: the engines hold the actor's weights
            self.version = self.engine_version = step

    def state_dict(self) -> dict:
        return {"version": self.version, "engine_version": self.engine_version, "dropped_samples": self.dropped_samples,
                "buffer": [{"step": b.step, "version": b.version, "loader_state": b.loader_state, "pending": b.pending,
                            "rollout": rollout_to_dict(b.rollout)} for b in self.buffer]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the buffer (after the loader's own state: each batch re-reads its prompts from its position)."""
        # the engines' version as the schedule knows it (older than the weights the trainer gives them at start): no
        # batch is generated until the schedule's next sync, which hands over the same weights the saving run did
        self.version, self.engine_version = int(state["version"]), int(state["engine_version"])
        self.dropped_samples = int(state.get("dropped_samples", 0))
        self.buffer = []
        live = self.loader.state_dict()
        try:
            for b in state["buffer"]:
                self.loader.load_state_dict(b["loader_state"])
                self.buffer.append(Batch(int(b["step"]), self.loader.next_batch(self.batch_size), int(b["version"]),
                                         b["loader_state"], rollout=rollout_from_dict(b["rollout"]),
                                         pending=bool(b["pending"])))
        finally:
            self.loader.load_state_dict(live)


def with_versions(batch: RolloutBatch, version: int) -> RolloutBatch:
    """`batch` with token_versions [N, R]: `version` on every response token, 0 on padding."""
    batch.token_versions = torch.where(batch.response_mask(), version, 0).long()
    return batch


def resumable_rows(batch: RolloutBatch, response_length: int) -> list:
    """The rows an abort cut short with budget left (a row aborted at its last token is ended as truncated)."""
    rows = []
    for i, reason in enumerate(batch.finish_reasons):
        if reason == "abort":
            if int(batch.response_lengths[i]) < response_length:
                rows.append(i)
            else:
                batch.finish_reasons[i] = "length"
                batch.truncated[i] = True
    return rows


def merge_continuation(batch: RolloutBatch, rows: list, cont: RolloutBatch, version: int) -> RolloutBatch:
    """`batch` with row rows[k] extended by row k of `cont` (sampled by `version`): tokens, logprobs, versions and
    finish reason; generation seconds and tokens add up."""
    n = len(batch)
    responses = [batch.response(i) for i in range(n)]
    logprobs = None if batch.rollout_logprobs is None else [batch.logprobs(i) for i in range(n)]
    versions = [batch.token_versions[i, :len(responses[i])].tolist() for i in range(n)]
    reasons = list(batch.finish_reasons)
    for k, i in enumerate(rows):
        new = cont.response(k)
        responses[i] = responses[i] + new
        versions[i] = versions[i] + [version] * len(new)
        if logprobs is not None:
            logprobs[i] = logprobs[i] + cont.logprobs(k)
        reasons[i] = cont.finish_reasons[k]
    metrics = dict(batch.metrics)
    for key in ("rollout/generate_seconds", "rollout/response_tokens"):
        metrics[key] = metrics.get(key, 0.0) + cont.metrics.get(key, 0.0)
    metrics["rollout/num_aborted"] = float(sum(r == "abort" for r in reasons))
    return _assemble(batch.prompt_ids, responses, logprobs, versions, reasons, batch.prompt_index.tolist(),
                     batch.prompt_truncated.tolist(), batch.weight_version, batch.pad_token_id, metrics)


def _assemble(prompt_ids, responses, logprobs, versions, reasons, prompt_index, prompt_truncated, weight_version,
              pad, metrics) -> RolloutBatch:
    """A RolloutBatch from per-row lists (responses right-padded with `pad`)."""
    response = pad_rows(responses, int(pad), torch.long)
    width = response.shape[1]
    lps = None if logprobs is None else pad_rows(logprobs, 0.0, torch.float32, width)
    tv = pad_rows(versions, 0, torch.long, width)
    reasons = [r if r in FINISH_REASONS else "abort" for r in reasons]
    return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], response_ids=response,
                        response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.long),
                        rollout_logprobs=lps, finish_reasons=reasons,
                        truncated=torch.tensor([r == "length" for r in reasons], dtype=torch.bool),
                        prompt_index=torch.tensor(prompt_index, dtype=torch.long),
                        prompt_truncated=torch.tensor(prompt_truncated, dtype=torch.bool),
                        weight_version=int(weight_version), pad_token_id=int(pad), metrics=dict(metrics),
                        token_versions=tv)


def rollout_to_dict(batch: RolloutBatch) -> dict:
    """A RolloutBatch as JSON-ready lists (float32 logprobs round-trip exactly through Python floats)."""
    n = len(batch)
    if batch.token_versions is None:
        batch = with_versions(batch, batch.weight_version)
    return {"prompt_ids": batch.prompt_ids, "responses": [batch.response(i) for i in range(n)],
            "logprobs": None if batch.rollout_logprobs is None else [batch.logprobs(i) for i in range(n)],
            "versions": [batch.token_versions[i, :int(batch.response_lengths[i])].tolist() for i in range(n)],
            "finish_reasons": batch.finish_reasons, "prompt_index": batch.prompt_index.tolist(),
            "prompt_truncated": batch.prompt_truncated.tolist(), "weight_version": batch.weight_version,
            "pad_token_id": batch.pad_token_id, "metrics": batch.metrics}


def rollout_from_dict(d: dict) -> RolloutBatch:
    return _assemble(d["prompt_ids"], d["responses"], d["logprobs"], d["versions"], d["finish_reasons"],
                     d["prompt_index"], d["prompt_truncated"], d["weight_version"], d["pad_token_id"], d["metrics"])
