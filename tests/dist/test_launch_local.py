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


def rank_facts(marker_dir: str):
    import atexit
    import os

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    # the interpreter's exit work must run in a forked rank too (the reward workers' shutdown is registered so)
    atexit.register(lambda: open(os.path.join(marker_dir, f"atexit{rank}"), "w").close())
    return {"pid": os.getpid(), "rank_env": os.environ["RANK"], "threads": torch.get_num_threads(),
            "session_leader": os.getsid(0) == os.getpid()}


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_ranks_forked_from_the_preloaded_server_start_as_fresh_ones_would(tmp_path, monkeypatch, fresh):
    """The suite forks ranks from a server that imported torch and megatron-core once (tests/conftest.py); a rank
    started so has its own environment, one torch thread (OMP_NUM_THREADS=1, a rank's default), a session of its own,
    and runs its exit handlers, as a fresh interpreter (`env` given: the launcher starts fresh ones) does."""
    from megarl import launch_local

    if not fresh and launch_local._fork_preload is None:  # the suite run with MEGARL_TEST_FRESH_RANKS=1
        monkeypatch.setattr(launch_local, "_fork_preload", ["torch"])
    facts = run_ranks(f"{__name__}:rank_facts", 2, {"marker_dir": str(tmp_path)}, timeout=120,
                      env={"MEGARL_TEST_FRESH": "1"} if fresh else None)
    assert [f["rank_env"] for f in facts] == ["0", "1"]
    assert [f["threads"] for f in facts] == [1, 1]
    assert all(f["session_leader"] for f in facts) and facts[0]["pid"] != facts[1]["pid"]
    assert sorted(p.name for p in tmp_path.glob("atexit*")) == ["atexit0", "atexit1"]
