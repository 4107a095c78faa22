"""Ranks started by the local launcher for a job write their output to <log dir>/rank<N>.log; a failing rank's
traceback still reaches the launcher's failure report."""
import pytest

from megarl.console import LOG_DIR_ENV, VERBOSE_ENV
from megarl.launch_local import RankFailure, run_ranks


def print_then_maybe_fail(fail_rank: int):
    import torch.distributed as dist

    print(f"library output of rank {dist.get_rank()}", flush=True)
    if dist.get_rank() == fail_rank:
        raise ValueError(f"boom on rank {fail_rank}")
    dist.barrier()


def test_each_rank_logs_to_its_own_file(tmp_path):
    env = {LOG_DIR_ENV: str(tmp_path), VERBOSE_ENV: "0"}
    run_ranks(f"{__name__}:print_then_maybe_fail", 2, {"fail_rank": -1}, timeout=300, env=env, log_dir=tmp_path / "l")
    for rank in (0, 1):
        assert f"library output of rank {rank}" in (tmp_path / f"rank{rank}.log").read_text()
        assert "library output" not in (tmp_path / "l" / f"rank{rank}.log").read_text()  # the launcher's copy


def test_a_failing_rank_still_reports_its_traceback(tmp_path):
    env = {LOG_DIR_ENV: str(tmp_path), VERBOSE_ENV: "0"}
    with pytest.raises(RankFailure) as err:
        run_ranks(f"{__name__}:print_then_maybe_fail", 2, {"fail_rank": 1}, timeout=300, env=env)
    assert "ValueError: boom on rank 1" in str(err.value)
    assert "library output of rank 1" in (tmp_path / "rank1.log").read_text()
