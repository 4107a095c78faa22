"""The engine's CPU thread plan: cores split among engine workers, the environment vLLM reads, applied in a child."""
import multiprocessing as mp
import os

import pytest

from megarl.rollout.threads import EngineThreads, apply_engine_threads, available_cores, engine_thread_plan


def test_one_worker_takes_every_core():
    plan = engine_thread_plan([1, 0])
    assert plan.cores == ((0, 1),)
    assert plan.threads == 2
    assert plan.env() == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def test_workers_get_equal_contiguous_shares():
    # engine TP2 on 2 cores: the "0|1" binding vLLM's multi-process executor needs
    assert engine_thread_plan([0, 1], workers=2).omp_bind == "0|1"
    plan = engine_thread_plan([8, 9, 10, 11, 12, 13, 14, 15], workers=2)
    assert plan.cores == ((8, 9, 10, 11), (12, 13, 14, 15))
    assert plan.omp_bind == "8-11|12-15"
    assert plan.env()["OMP_NUM_THREADS"] == "4"


def test_uneven_cores_leave_the_remainder_out_and_gaps_become_lists():
    plan = engine_thread_plan([0, 2, 3, 4, 7], workers=2)  # 5 cores, 2 workers: 2 each, core 7 unused
    assert plan.cores == ((0, 2), (3, 4))
    assert plan.omp_bind == "0,2|3-4"
    assert EngineThreads(((0, 1, 2, 5, 7, 8),)).omp_bind == "0-2,5,7-8"


@pytest.mark.parametrize("cores,workers,words", [
    ([0], 2, "1 core(s) for 2 engine workers"),
    ([0, 0, 1], 1, "listed twice"),
    ([-1, 0], 1, ">= 0"),
    ([0, 1], 0, "at least 1"),
])
def test_refusals_name_the_problem(cores, workers, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        engine_thread_plan(cores, workers)


def _child(queue):
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"  # what a trainer rank's engine child inherits
    torch.set_num_threads(1)
    cores = available_cores()
    apply_engine_threads(cores)
    queue.put((torch.get_num_threads(), sorted(os.sched_getaffinity(0)), os.environ["OMP_NUM_THREADS"], cores))


def test_apply_in_a_child_process_sets_threads_and_affinity():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    threads, affinity, omp, cores = queue.get(timeout=120)
    proc.join(timeout=30)
    assert threads == len(cores) and affinity == cores and omp == str(len(cores))
    assert cores == sorted(os.sched_getaffinity(0))


def test_engine_and_trainer_cores_split_only_when_they_overlap():
    from megarl.rollout.threads import split_cores

    assert split_cores([0, 1, 2, 3], None, overlap=False) == ([0, 1, 2, 3], [0, 1, 2, 3])  # they take turns
    assert split_cores([0, 1, 2, 3], None, overlap=True) == ([2, 3], [0, 1])  # half each, the engine the last ones
    assert split_cores([0, 1], None, overlap=True) == ([1], [0])
    assert split_cores([0, 1, 2, 3, 4], 1, overlap=False) == ([4], [0, 1, 2, 3])  # asked for: also in sync mode
    with pytest.raises(ValueError, match="trainer needs at least one of its own"):
        split_cores([0, 1], 2, overlap=True)
