"""Process groups and megatron-core parallel state, on CPU (gloo) or GPU (NCCL).

`init_distributed()` works under torchrun (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT) and as a plain
single process (it becomes a world of one on a free local port). `init_model_parallel()` then sets up megatron's
TP/PP/CP/EP groups and the model-parallel RNG.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megarl.layout import Layout  # noqa: F401 - the layout type lives beside the config; re-exported for callers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(backend: Optional[str] = None, timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed once: NCCL when CUDA is available, gloo otherwise."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # a plain `python`/`megarl` run: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))


def init_model_parallel(layout: Layout, seed: int = 1234) -> None:
    """Set up megatron's parallel groups for `layout` (after init_distributed) and seed every rank."""
    from megarl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    layout.data_parallel_size(dist.get_world_size())  # raises a readable error for a bad layout
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    global _LAYOUT
    _LAYOUT = layout


_LAYOUT: Optional[Layout] = None  # the layout of the last init_model_parallel (its uneven stages feed model building)


def uneven_stages() -> dict:
    """The uneven pipeline-stage settings of the current layout, as megatron TransformerConfig fields."""
    if _LAYOUT is None:
        return {}
    return {k: v for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
            if (v := getattr(_LAYOUT, k)) is not None}


def destroy() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
