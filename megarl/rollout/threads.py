"""CPU threads of a vLLM engine: which cores each engine worker computes on, and how many torch threads it runs.

During rollout the trainer's ranks wait for the engine, so the engine may use every core the trainer would use. Left
alone it does not: the trainer's ranks run with OMP_NUM_THREADS = cores / ranks (torchrun's default is 1), the
engine process inherits that, and vLLM's CPU worker freezes `torch.set_num_threads` once it has started. So the
thread count is decided here, before vLLM starts, from the cores given to this engine:

    plan = engine_thread_plan([0, 1, 2, 3], workers=1)   # pure: EngineThreads(cores=((0, 1, 2, 3),), ...)
    apply_engine_threads(plan)                            # in the engine's own process, before vllm.LLM(...)

`workers` is the number of engine worker processes sharing these cores (engine TP with vLLM's multi-process
executor); each gets a contiguous, equal share, passed to vLLM as VLLM_CPU_OMP_THREADS_BIND ("0-1|2-3"), which its
CPU executor turns into each worker's OMP_NUM_THREADS and OpenMP places. Several engine replicas on one machine each
get their own list of cores.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class EngineThreads:
    """Cores per engine worker (worker i computes on cores[i] with len(cores[i]) torch threads)."""

    cores: tuple  # tuple of tuples of core ids, one per worker

    @property
    def threads(self) -> int:
        """torch threads of one worker (every worker gets the same number)."""
        return len(self.cores[0])

    @property
    def omp_bind(self) -> str:
        """VLLM_CPU_OMP_THREADS_BIND: each worker's cores as ranges, workers separated by '|' (e.g. "0-3|4-7")."""
        return "|".join(_ranges(c) for c in self.cores)

    def env(self) -> dict:
        """Environment variables for the engine process (read by vLLM's CPU executor and its runtime thread check)."""
        return {"OMP_NUM_THREADS": str(self.threads), "VLLM_CPU_OMP_THREADS_BIND": self.omp_bind}


def engine_thread_plan(cores: Sequence[int], workers: int = 1) -> EngineThreads:
    """Split `cores` (core ids available to this engine) into `workers` equal contiguous shares, in sorted order.

    Cores that do not divide evenly are left out (the last len(cores) % workers), since vLLM's workers run in
    lock-step and the slowest one sets the pace. Raises ValueError when there are fewer cores than workers."""
    ids = sorted(set(int(c) for c in cores))
    if len(ids) != len(cores):
        raise ValueError(f"engine cores {list(cores)}: a core is listed twice")
    if any(c < 0 for c in ids):
        raise ValueError(f"engine cores {list(cores)}: core ids are >= 0")
    if workers < 1:
        raise ValueError(f"engine workers={workers}: need at least 1")
    if len(ids) < workers:
        raise ValueError(f"engine cores {ids}: {len(ids)} core(s) for {workers} engine workers (rollout "
                         f"tensor_model_parallel_size); give the engine at least one core per worker")
    per = len(ids) // workers
    return EngineThreads(tuple(tuple(ids[i * per:(i + 1) * per]) for i in range(workers)))


def split_cores(cores: Sequence[int], engine_cores: Optional[int], overlap: bool) -> tuple[list, list]:
    """(the engines' cores, the trainer's cores) of one machine. While the engines generate and the trainer waits
    (no overlap) both may use every core; when they run at the same time each side needs cores of its own:
    `engine_cores` of them (default: half) go to the engines, the last ones; the trainer keeps the rest."""
    ids = sorted(cores)
    if engine_cores is None:
        if not overlap:
            return list(ids), list(ids)
        engine_cores = max(1, len(ids) // 2)
    if engine_cores >= len(ids):
        raise ValueError(f"rollout.engine_cpu_cores={engine_cores}: this machine gives the run {len(ids)} cores "
                         f"{ids}, and the trainer needs at least one of its own; use at most {len(ids) - 1}")
    return ids[len(ids) - engine_cores:], ids[:len(ids) - engine_cores]


def keep_trainer_on(cores: Sequence[int]) -> None:
    """Confine this trainer rank to `cores` (its torch threads included), leaving the rest to the engines."""
    import torch

    os.sched_setaffinity(0, list(cores))
    torch.set_num_threads(max(1, min(torch.get_num_threads(), len(cores))))


def available_cores() -> list:
    """The cores this process may run on (its CPU affinity, which respects taskset/cgroup cpusets)."""
    return sorted(os.sched_getaffinity(0))


def apply_engine_threads(cores: Sequence[int], workers: int = 1) -> EngineThreads:
    """Plan `cores` for `workers` engine workers and apply it to this process (which is about to start vLLM).

    One worker (the in-process engine) computes in this process: its affinity and torch threads are set here. Several
    workers are vLLM's own processes: the environment tells its executor how to bind them."""
    import torch

    plan = engine_thread_plan(cores, workers)
    os.environ.update(plan.env())
    if workers == 1:
        os.sched_setaffinity(0, plan.cores[0])
        torch.set_num_threads(plan.threads)
    return plan


def _ranges(ids: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, c in enumerate(ids):
        if start is None:
            start = c
        if i + 1 == len(ids) or ids[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)
