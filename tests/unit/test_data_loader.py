"""PromptLoader: deterministic order, exact resume, epoch reshuffle, drop_last; DP sharding; validation batches."""
import pytest

from megarl.data import PromptLoader, epoch_order, shard, val_batches

ITEMS = list(range(10))


def _take(loader, n, bs=3):
    return [loader.next_batch(bs) for _ in range(n)]


def test_same_seed_same_order_different_seed_differs():
    assert _take(PromptLoader(ITEMS, seed=7), 6) == _take(PromptLoader(ITEMS, seed=7), 6)
    assert _take(PromptLoader(ITEMS, seed=7), 3) != _take(PromptLoader(ITEMS, seed=8), 3)
    assert _take(PromptLoader(ITEMS, seed=7, shuffle=False), 2) == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("k", [0, 1, 3, 4, 7])
def test_resume_after_k_batches_matches_uninterrupted(k):
    reference = _take(PromptLoader(ITEMS, seed=3), k + 6)
    first = PromptLoader(ITEMS, seed=3)
    _take(first, k)
    state = first.state_dict()
    resumed = PromptLoader(ITEMS, seed=3)  # a fresh process: nothing but the state dict carries over
    resumed.load_state_dict(state)
    assert _take(resumed, 6) == reference[k:]
    assert resumed.batches_returned == k + 6


def test_epoch_boundary_reshuffles_deterministically_and_drop_last():
    loader = PromptLoader(ITEMS, seed=5)  # 10 items, batches of 3: 3 full batches, the 10th item skipped
    epoch0 = _take(loader, 3)
    assert loader.epoch == 0
    epoch1 = _take(loader, 3)
    assert loader.epoch == 1
    assert [x for b in epoch0 for x in b] == epoch_order(10, 5, 0)[:9]
    assert [x for b in epoch1 for x in b] == epoch_order(10, 5, 1)[:9]
    assert epoch_order(10, 5, 0) != epoch_order(10, 5, 1)
    assert sorted(epoch_order(10, 5, 1)) == ITEMS
    assert loader.batches_per_epoch(3) == 3


def test_no_drop_last_returns_short_final_batch():
    loader = PromptLoader(ITEMS, seed=5, shuffle=False, drop_last=False)
    assert _take(loader, 5) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], [0, 1, 2]]
    assert loader.batches_per_epoch(3) == 4


def test_variable_batch_sizes_resume():
    # DAPO dynamic sampling draws extra prompts mid-step: the position is in items, not batches
    a = PromptLoader(ITEMS, seed=1)
    a.next_batch(4)
    a.next_batch(2)
    b = PromptLoader(ITEMS, seed=1)
    b.load_state_dict(a.state_dict())
    assert a.next_batch(3) == b.next_batch(3)


def test_load_state_dict_refuses_a_different_dataset_or_seed():
    state = PromptLoader(ITEMS, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"num_items=10 but this run has num_items=9"):
        PromptLoader(ITEMS[:9], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed=1 but this run has seed=2"):
        PromptLoader(ITEMS, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="only 10"):
        PromptLoader(ITEMS, seed=1).next_batch(11)


def test_two_dp_shards_partition_the_batch():
    batch = PromptLoader(ITEMS, seed=2).next_batch(8)
    parts = [shard(batch, r, 2) for r in range(2)]
    assert parts[0] + parts[1] == batch
    assert parts[0] == batch[:4] and not set(parts[0]) & set(parts[1])
    with pytest.raises(ValueError, match="batch of 8 cannot be split evenly over 3"):
        shard(batch, 0, 3)
    with pytest.raises(ValueError, match="dp_rank"):
        shard(batch, 2, 2)


def test_val_batches_in_order_with_short_last_batch():
    assert list(val_batches(ITEMS, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(val_batches(ITEMS)) == [ITEMS]
