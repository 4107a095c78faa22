"""Entropy from logits: exactness, stability, and vocab-parallel shards combined through reduction hooks."""
import functools
import math
import threading

import pytest
import torch

from megarl.algo import entropy_from_logits


def _entropy_loop(row):
    """-sum p log p for one list of logits, in plain Python (shifted by the max to avoid overflow)."""
    m = max(row)
    exps = [math.exp(z - m) for z in row]
    total = sum(exps)
    return -sum((e / total) * math.log(e / total) for e in exps if e > 0)


def test_matches_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 3
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            assert out[b, t].item() == pytest.approx(_entropy_loop(logits[b, t].tolist()), rel=1e-12)


def test_hand_values():
    assert entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7))  # uniform
    # two logits 0 and log 3: p = (1/4, 3/4)
    two = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    assert entropy_from_logits(two).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_stable_for_huge_and_shifted_logits():
    peaked = torch.tensor([[1e4, 0.0, -1e4]])  # naive exp overflows
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    shifted = torch.randn(4, 50) + 1e6
    out = entropy_from_logits(shifted)
    assert torch.isfinite(out).all() and (out >= 0).all()
    with_neg_inf = torch.tensor([[0.0, 0.0, -float("inf")]])  # e.g. masked-out vocab entries
    assert entropy_from_logits(with_neg_inf).item() == pytest.approx(math.log(2))


def test_half_precision_computed_in_float32():
    logits = torch.randn(3, 17).to(torch.bfloat16)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    expected = [_entropy_loop(row) for row in logits.float().tolist()]
    assert out.tolist() == pytest.approx(expected, rel=1e-5)


def test_gradient_matches_reference():
    logits = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(ref, -1)
    (-(p * torch.log(p)).sum(-1)).sum().backward()
    assert torch.allclose(logits.grad, ref.grad, rtol=1e-10, atol=1e-12)


class _ThreadGroup:
    """A stand-in for a tensor-parallel group: every rank is a thread, all_reduce meets at a barrier."""

    def __init__(self, world_size):
        self.slots = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=20)

    def all_reduce(self, rank, op):
        def reduce(local):
            self.slots[rank] = local
            self.barrier.wait()
            combined = functools.reduce(op, self.slots)
            self.barrier.wait()  # nobody overwrites a slot before every rank has read all of them
            return combined
        return reduce


def test_vocab_parallel_shards_give_full_vocab_entropy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 12, generator=g, dtype=torch.float64) * 4
    logits[0, 0, 7] = 30.0  # the max lives on the second shard for this position
    shards = torch.chunk(logits, 2, dim=-1)
    group = _ThreadGroup(2)
    results = [None, None]

    def rank_main(rank):
        results[rank] = entropy_from_logits(shards[rank], all_reduce_max=group.all_reduce(rank, torch.maximum),
                                            all_reduce_sum=group.all_reduce(rank, torch.add))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    full = [[_entropy_loop(logits[b, t].tolist()) for t in range(5)] for b in range(2)]
    for rank in range(2):
        for b in range(2):
            assert results[rank][b].tolist() == pytest.approx(full[b], rel=1e-12)
    # a single shard alone is a different (wrong) distribution: the hooks matter
    assert not torch.allclose(entropy_from_logits(shards[0]), results[0])


def test_hooks_must_come_together_and_bad_input():
    with pytest.raises(ValueError, match="pass both all_reduce_max and all_reduce_sum"):
        entropy_from_logits(torch.zeros(2, 3), all_reduce_max=lambda x: x)
    with pytest.raises(ValueError, match="logits must be a floating-point tensor; got dtype torch.int64"):
        entropy_from_logits(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits must be \[..., V\] with V > 0"):
        entropy_from_logits(torch.zeros(2, 0))
