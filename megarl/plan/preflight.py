"""The planner's memory check at the start of `megarl train` on GPU: refuse a recipe the plan says cannot fit, with
the failing phase, the planned peak and the layout search's best suggestion (`--no-plan-check` overrides it).

The cluster is the recipe's: trainer.nnodes x n_gpus_per_node GPUs of the device's memory, plus the GPUs of engines
placed separately. On CPU (no device memory to plan against) nothing is checked.
"""
from __future__ import annotations

from typing import Optional

from megarl.plan.model import GIB


def device_memory_bytes() -> Optional[int]:
    """The first CUDA device's memory, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def plan_check(cfg, device_bytes: Optional[int], search_on_refusal: bool = True) -> Optional[str]:
    """None when the plan fits (or there is no device to plan for); else one line: the failing phase, the planned
    peak, the first reason and, when the search finds one, the overrides of a layout that fits."""
    from megarl.plan.model import PlanError
    from megarl.plan.planner import plan_recipe

    if device_bytes is None:
        return None
    gpn = cfg.trainer.n_gpus_per_node
    engine_gpus = cfg.engine_replicas * cfg.rollout.tensor_model_parallel_size if cfg.engine_placement == "separate" \
        else 0
    nodes = cfg.trainer.nnodes + -(-engine_gpus // gpn)
    mem_gib = device_bytes / GIB
    try:
        report = plan_recipe(cfg, nodes, gpn, mem_gib)
    except PlanError as exc:  # a plan that cannot be made does not stop a run; validate named what it could
        return None if "config.json" in str(exc) else f"megarl train: the memory plan refuses this layout: {exc}"
    if report.fits:
        return None
    phase = max(report.phases, key=report.phases.get)
    msg = (f"megarl train: the memory plan says this recipe does not fit: the {phase} phase needs "
           f"{report.peak_bytes / GIB:.1f} GiB per GPU of {mem_gib:.1f} GiB; {report.reasons[0]}")
    if search_on_refusal:
        msg += " " + suggestion(cfg, nodes, gpn, mem_gib)
    return msg + " To start anyway: megarl train ... --no-plan-check"


def suggestion(cfg, nodes: int, gpus_per_node: int, mem_gib: float) -> str:
    from megarl.plan.planner import DEFAULT_HOST_MEM_GIB, DEFAULT_LINK_GBPS
    from megarl.plan.search import overrides, search

    res = search(cfg, nodes, gpus_per_node, mem_gib, DEFAULT_LINK_GBPS, DEFAULT_HOST_MEM_GIB, top=1)
    if not res.best:
        return "The layout search found no layout that fits on these GPUs: more nodes or GPUs with more memory."
    return "A layout that fits (megarl plan --search): " + (" ".join(overrides(res.best[0].settings)) or
                                                            "the recipe's own") + "."
