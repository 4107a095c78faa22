"""The process side of a run: distributed and megatron setup, each rank's role, and the collectives the loop uses.

Every rank runs the same loop (SPMD). Global rank 0 hosts the rollout engine, scores rewards and writes metrics; it
broadcasts rollouts and scores so every rank holds the whole step's batch. Model forwards split the batch over DP
ranks; results come from the last pipeline stage and are gathered so every rank again holds the whole batch.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.config import MegarlConfig
from megarl.console import setup_logging
from megarl.megatron.parallel import Layout, init_distributed, init_model_parallel

log = logging.getLogger("megarl")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    run_dir: Path

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def layout_of(cfg: MegarlConfig) -> Layout:
    p = cfg.parallelism
    return Layout(tensor_model_parallel_size=p.tensor_model_parallel_size,
                  pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                  virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
                  context_parallel_size=p.context_parallel_size,
                  expert_model_parallel_size=p.expert_model_parallel_size,
                  expert_tensor_parallel_size=p.expert_tensor_parallel_size)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def start(cfg: MegarlConfig) -> Runtime:
    """Initialise torch.distributed and megatron's parallel state for the recipe's layout."""
    init_distributed()
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"the recipe plans for trainer.nnodes * trainer.n_gpus_per_node = {cfg.world_size} ranks but "
                           f"{world} were launched; launch {cfg.world_size} ranks or override "
                           f"trainer.n_gpus_per_node={world} (with trainer.nnodes=1)")
    init_model_parallel(layout_of(cfg), seed=cfg.trainer.seed)
    from megatron.core import parallel_state as ps

    setup_logging(cfg.logging.level, dist.get_rank() == 0)
    return Runtime(rank=dist.get_rank(), world_size=world, dp_rank=ps.get_data_parallel_rank(),
                   dp_size=ps.get_data_parallel_world_size(), run_dir=Path(cfg.trainer.run_dir))


def broadcast_object(obj: Any, src: int = 0) -> Any:
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def barrier() -> None:
    dist.barrier()


def dp_row_range(n: int, rt: Runtime) -> slice:
    """This DP rank's contiguous share of n rows (n must divide by DP)."""
    if n % rt.dp_size:
        raise ValueError(f"{n} samples do not split over {rt.dp_size} data-parallel ranks")
    per = n // rt.dp_size
    return slice(rt.dp_rank * per, (rt.dp_rank + 1) * per)


def gather_model_output(local: Optional[torch.Tensor], shape_per_rank: tuple, dtype=torch.float32) -> torch.Tensor:
    """Assemble a per-row model output computed on DP shards into the whole batch, on every rank.

    `local` is this rank's [n/DP, ...] result on the last pipeline stage (None on other stages). The last stage
    shares it with its pipeline group, then DP ranks all-gather their shares in row order."""
    from megatron.core import parallel_state as ps

    buf = local.to(dtype).contiguous() if local is not None else torch.empty(shape_per_rank, dtype=dtype)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return buf
    parts = [torch.empty_like(buf) for _ in range(dp)]
    dist.all_gather(parts, buf, group=ps.get_data_parallel_group())
    return torch.cat(parts, dim=0)
