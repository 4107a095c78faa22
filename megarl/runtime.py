"""The start of a run's processes: distributed and megatron setup and each rank's role. The collectives the loop uses,
and the device they meet on, are megarl.distributed's.

Every rank runs the same loop (SPMD). Engine replicas run over the ranks (megarl.rollout.replicas: the first rank of
each group of rollout.tensor_model_parallel_size ranks owns one); each generates its share of the prompts and
broadcasts it as tensors, so every rank holds the whole step's batch. Global rank 0 scores rewards and writes
metrics. Model forwards split the batch over DP ranks; results come from the last pipeline stage and are gathered so
every rank again holds the whole batch.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import MegarlConfig
from megarl.console import setup_logging
from megarl.distributed import init_distributed, object_group
from megarl.megatron import parallel
from megarl.megatron.parallel import Layout, init_model_parallel
from megarl.layout import EngineTopology

log = logging.getLogger("megarl")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    run_dir: Path
    engines: EngineTopology = EngineTopology(1, 1, 1)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def layout_of(cfg: MegarlConfig) -> Layout:
    return Layout.of(cfg.parallelism)


def use_device(setting: str) -> None:
    """trainer.device: cpu hides CUDA from this process and its children (before anything initialises CUDA); cuda
    stops the run where no CUDA device is visible."""
    if setting == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible to this process; run on a GPU machine "
                           "or set trainer.device=auto (or cpu)")


def start(cfg: MegarlConfig) -> Runtime:
    """Initialise torch.distributed and megatron's parallel state for the recipe's layout."""
    use_device(cfg.trainer.device)
    from megarl.megatron.precision import apply_precision

    apply_precision(cfg.model.allow_tf32)  # before CUDA starts: the libraries read their TF32 override then
    init_distributed()
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"the recipe plans for trainer.nnodes * trainer.n_gpus_per_node = {cfg.world_size} ranks but "
                           f"{world} were launched; launch {cfg.world_size} ranks or override "
                           f"trainer.n_gpus_per_node={world} (with trainer.nnodes=1)")
    init_model_parallel(layout_of(cfg), seed=cfg.trainer.seed)
    from megatron.core import parallel_state as ps

    object_group()  # made now, at the same point on every rank

    setup_logging(cfg.logging.level, dist.get_rank() == 0)
    r = cfg.rollout
    if cfg.engine_placement == "colocated":
        engines = EngineTopology(world, r.tensor_model_parallel_size, cfg.engine_replicas)
    else:  # Ray: rank 0 holds the handle on every actor; separate processes: trainer rank r starts replica r
        engines = EngineTopology(world, 1, 1 if r.mode == "ray" else cfg.engine_replicas)
    return Runtime(rank=dist.get_rank(), world_size=world, dp_rank=ps.get_data_parallel_rank(),
                   dp_size=ps.get_data_parallel_world_size(), run_dir=Path(cfg.trainer.run_dir), engines=engines)


def stop() -> None:
    """Tear down megatron's and torch.distributed's groups (no collective: after a failure the peers may be gone)."""
    parallel.destroy()
