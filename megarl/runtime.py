"""The process side of a run: distributed and megatron setup, each rank's role, and the collectives the loop uses.

Every rank runs the same loop (SPMD). Engine replicas run over the ranks (megarl.rollout.replicas: the first rank of
each group of rollout.tensor_model_parallel_size ranks owns one); each generates its share of the prompts and
broadcasts it as tensors, so every rank holds the whole step's batch. Global rank 0 scores rewards and writes metrics. Model forwards split the batch over DP
ranks; results come from the last pipeline stage and are gathered so every rank again holds the whole batch.

Devices: `compute_device()` is the one decision of where tensors meet the model and the collectives (the rank's CUDA
device under NCCL, else the CPU). The step's batch lives on the CPU; `to_device` moves a micro-batch just before the
model, and whole-batch results come back to the CPU. Tensor collectives go through the wrappers below, which check
their tensors against that device (`check_device`), so a CPU tensor headed for an NCCL-only collective fails on any
machine, CPU included, when a test declares another device (`declare_device`). Pickled Python objects travel over a
gloo group next to NCCL, never through GPU memory.
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megarl.config import MegarlConfig
from megarl.megatron import parallel
from megarl.console import setup_logging
from megarl.megatron.parallel import Layout, init_distributed, init_model_parallel
from megarl.rollout.replicas import EngineTopology

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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


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

    parallel.object_group()  # made now, at the same point on every rank

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


# ---------------------------------------------------------------------------------------------------------------------
# Devices and collectives
# ---------------------------------------------------------------------------------------------------------------------

_declared_device: Optional[torch.device] = None


class DeviceMismatch(RuntimeError):
    """A tensor given to the model or to a collective is not on the runtime's compute device."""


def declare_device(device: Optional[str | torch.device]) -> None:
    """Override compute_device() (None: back to the real decision). For tests: declaring a device the tensors cannot
    be on by accident ('meta') makes every missing move to the device fail check_device on a CPU machine."""
    global _declared_device
    _declared_device = None if device is None else torch.device(device)


def compute_device() -> torch.device:
    """Where this rank's model computes and its tensor collectives run."""
    return _declared_device if _declared_device is not None else parallel.device()


def check_device(where: str, tensors: Iterable[torch.Tensor]) -> None:
    want = compute_device()
    for t in tensors:
        if t.device.type != want.type or (want.index is not None and t.device.index not in (None, want.index)):
            raise DeviceMismatch(f"{where}: a {tuple(t.shape)} {t.dtype} tensor is on {t.device}, the runtime computes "
                                 f"on {want}; move it with megarl.runtime.to_device")


def to_device(batch: dict) -> dict:
    """A micro-batch (dict of tensors and other values) with every tensor on compute_device()."""
    device = compute_device()
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def call_model(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor):
    check_device("model input", (input_ids, position_ids, attention_mask))
    return model(input_ids, position_ids, attention_mask)


def all_reduce(t: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> None:
    check_device("all_reduce", (t,))
    dist.all_reduce(t, op=op, group=group)


def broadcast(t: torch.Tensor, src: int, group=None) -> None:
    check_device("broadcast", (t,))
    dist.broadcast(t, src=src, group=group)


def all_gather(parts: list, t: torch.Tensor, group=None) -> None:
    check_device("all_gather", [t, *parts])
    dist.all_gather(parts, t, group=group)


def broadcast_strings(strings: Optional[list[str]], src: int, group=None) -> list[str]:
    """`strings` from global rank src to every rank of `group` (src's value is used; others may pass None), as byte
    tensors on the compute device: no pickled object through an NCCL group."""
    device = compute_device()
    data = torch.tensor(list("\n".join(strings or []).encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    broadcast(size, src, group)
    if dist.get_rank(group=None) != src:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if int(size.item()):
        broadcast(data, src, group)
    text = bytes(data.cpu().tolist()).decode()
    return text.split("\n") if text else []


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """A picklable object from global rank src to every rank, over gloo (CPU memory) also when training on NCCL."""
    if dist.get_world_size() == 1:  # nobody to send it to: no pickling round trip
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=parallel.object_group())
    return holder[0]


def all_gather_objects(obj: Any) -> list:
    """Every rank's `obj` (small, picklable: plans, layouts, per-rank figures; never step data), over gloo (CPU
    memory) also when training on NCCL."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=parallel.object_group())
    return out


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
    shares it with its pipeline group, then DP ranks all-gather their shares in row order. The result is on the CPU,
    with the rest of the step's batch."""
    from megatron.core import parallel_state as ps

    device = compute_device()
    buf = (local.to(device=device, dtype=dtype).contiguous() if local is not None
           else torch.empty(shape_per_rank, dtype=dtype, device=device))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return buf.cpu()
    parts = [torch.empty_like(buf) for _ in range(dp)]
    all_gather(parts, buf, group=ps.get_data_parallel_group())
    return torch.cat(parts, dim=0).cpu()
