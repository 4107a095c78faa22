"""A deterministic, resumable prompt loader, DP sharding, and validation batches.

How it is used with data parallelism: every rank builds the same `PromptLoader` (same records, same seed), asks
it for the same global batch, and keeps its own contiguous slice with `shard(batch, dp_rank, dp_size)`. The loader
never sees a process group, so ranks cannot disagree about the order, and a checkpoint needs only one
`state_dict()` (from any rank).

Order: epoch e visits the items in a permutation drawn from (seed, e) alone, so a run's order is the same on every
machine and every restart, and the next epoch's order does not depend on how the previous one was consumed.

drop_last: when fewer than batch_size items remain in the epoch,
  drop_last=True  (default) the remainder is skipped and the batch is taken from the start of the next epoch,
                  so every batch is full (RL batch sizes must divide evenly over DP ranks and mini-batches);
  drop_last=False the remainder is returned as a short final batch of the epoch.
"""
from __future__ import annotations

import random
from typing import Any, Iterator, Optional, Sequence, TypeVar

T = TypeVar("T")


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The visiting order of one epoch: a permutation of range(num_items) fixed by (seed, epoch)."""
    order = list(range(num_items))
    if shuffle:
        # random.Random seeded with a str hashes it (sha512), which is stable across platforms and Python versions
        random.Random(f"megarl-data:{seed}:{epoch}").shuffle(order)
    return order


class PromptLoader:
    """Yields batches of `items` (usually PromptRecords) epoch after epoch, forever; the caller decides when to stop.

    state_dict() holds the epoch and the position inside it; load_state_dict() on a fresh loader over the same items
    continues with exactly the batch the saved loader would have returned next.
    """

    def __init__(self, items: Sequence[T], seed: int, shuffle: bool = True, drop_last: bool = True):
        if len(items) == 0:
            raise ValueError("PromptLoader needs at least one item (the dataset is empty)")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # index into the current epoch's order of the next item to return
        self.batches_returned = 0
        self._order: Optional[list[int]] = None

    def __len__(self) -> int:
        return len(self.items)

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_order(len(self.items), self.seed, self.epoch, self.shuffle)
        return self._order

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._order = None

    def batches_per_epoch(self, batch_size: int) -> int:
        full, rest = divmod(len(self.items), batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def next_batch(self, batch_size: int) -> list[T]:
        """The next batch_size items (fewer only at an epoch end with drop_last=False)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self.drop_last and batch_size > len(self.items):
            raise ValueError(f"batch of {batch_size} prompts requested but the dataset has only {len(self.items)}; "
                             f"lower data.train_batch_size or add prompts")
        remaining = len(self.items) - self.position
        if remaining == 0 or (self.drop_last and remaining < batch_size):
            self._next_epoch()
        order = self._epoch_order()
        picked = order[self.position:self.position + batch_size]
        self.position += len(picked)
        self.batches_returned += 1
        return [self.items[i] for i in picked]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "num_items": len(self.items), "batches_returned": self.batches_returned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A different seed or dataset size would silently change which prompts come next; refuse instead.
        for key, mine in (("seed", self.seed), ("num_items", len(self.items)), ("shuffle", self.shuffle),
                          ("drop_last", self.drop_last)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the data position: the checkpoint has {key}={state[key]!r} but this "
                                 f"run has {key}={mine!r}; use the same data files, data.shuffle and trainer.seed, or "
                                 f"start without resuming")
        if not 0 <= state["position"] <= len(self.items):
            raise ValueError(f"data position {state['position']} is outside the dataset of {len(self.items)} prompts")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.batches_returned = int(state.get("batches_returned", 0))
        self._order = None


def shard(batch: Sequence[T], dp_rank: int, dp_size: int) -> list[T]:
    """This DP rank's contiguous slice of a global batch: rank r gets items [r*k, (r+1)*k) with k = len/dp_size."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if len(batch) % dp_size:
        raise ValueError(f"a batch of {len(batch)} cannot be split evenly over {dp_size} data-parallel ranks; make "
                         f"data.train_batch_size a multiple of the DP size")
    k = len(batch) // dp_size
    return list(batch[dp_rank * k:(dp_rank + 1) * k])


def val_batches(items: Sequence[T], batch_size: Optional[int] = None) -> Iterator[list[T]]:
    """Validation batches in file order, every item exactly once; the last batch may be short.

    batch_size None (data.val_batch_size unset) yields the whole set as one batch.
    """
    size = batch_size or max(len(items), 1)
    for start in range(0, len(items), size):
        yield list(items[start:start + size])
