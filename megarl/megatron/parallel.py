"""megatron-core's parallel state over the process groups of megarl.distributed: `init_model_parallel()` sets up
megatron's TP/PP/CP/EP groups and the model-parallel RNG after `init_distributed()`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megarl.distributed import destroy_process_groups
from megarl.layout import Layout  # noqa: F401 - the layout type lives beside the config; re-exported for callers


def init_model_parallel(layout: Layout, seed: int = 1234) -> None:
    """Set up megatron's parallel groups for `layout` (after init_distributed) and seed every rank."""
    from megarl.megatron import cpu_compat

    cpu_compat.apply()
    from megarl.megatron import host_sync

    host_sync.install()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    layout.data_parallel_size(dist.get_world_size())  # raises a readable error for a bad layout
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        # one virtual stage per PP rank is the plain 1F1B schedule: megatron would switch to the interleaved one
        virtual_pipeline_model_parallel_size=(layout.virtual_pipeline_model_parallel_size
                                              if (layout.virtual_pipeline_model_parallel_size or 1) > 1 else None),
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
    destroy_process_groups()


def schedule_args(chunks: list, items: list) -> dict:
    """The `model` and `data_iterator` arguments of megatron's get_forward_backward_func for this rank's model chunks
    and the micro-batches `items`: one module and one iterator without virtual pipeline stages; with them the list
    of chunks and one iterator per chunk (megatron's interleaved 1F1B runs every micro-batch through each chunk and
    each chunk's forward step reads its own copy of the stream).

    The interleaved schedule runs micro-batches in groups of PP (config.microbatch_group_size_per_vp_stage, megatron's
    default): it refuses a count below PP or not a multiple of it, and so does this function, with the numbers."""
    from megatron.core import parallel_state as ps

    if len(chunks) == 1:
        return {"model": chunks[0], "data_iterator": iter(items)}
    pp = ps.get_pipeline_model_parallel_world_size()
    if len(items) % pp:
        raise ValueError(f"virtual pipeline stages (interleaved 1F1B) need the number of micro-batches per step to be "
                         f"a multiple of pipeline_model_parallel_size = {pp}, got {len(items)}: change the mini-batch "
                         "or micro-batch size (see `megarl validate`)")
    return {"model": list(chunks), "data_iterator": [iter(items) for _ in chunks]}
