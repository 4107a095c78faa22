"""The local rank launcher returns each rank's result and fails fast, with the failing rank's traceback."""
import time

import pytest

from megarl.launch_local import RankFailure, run_ranks


def sum_of_ranks(offset: int):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def crash_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the launcher's fail-fast


def test_each_rank_returns_its_result():
    results = run_ranks(f"{__name__}:sum_of_ranks", 2, {"offset": 10}, timeout=120)
    assert results == [(0, 21.0), (1, 21.0)]  # (0 + 10) + (1 + 10)


def test_a_crashed_rank_fails_the_launch_quickly_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_ranks(f"{__name__}:crash_on_rank1", 2, timeout=300)
    assert time.monotonic() - start < 60  # not the 300 s timeout
    assert "ValueError: boom on rank 1" in str(err.value) and "rank 1 exited with 1" in str(err.value)
