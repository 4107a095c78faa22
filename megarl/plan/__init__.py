"""`megarl plan`: will a recipe fit on a cluster? Per-GPU memory of every term, weight-sync bytes and time, a verdict.

Pure arithmetic on the recipe and the model's config.json (no GPU, no weights), in the steps plan_recipe names:
the model and where it runs (model.py), memory per role (memory.py), the engine (engine.py), the sync, the time and
the phases (phases.py), the text (text.py). Each module's docstring holds its part of the memory model.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional

from megarl.plan.engine import engine_memory, kv_cache_reason
from megarl.plan.memory import in_flight_layers, memory_per_role
from megarl.plan.model import Cluster, PlanError, gpu_count_reason, model_weights, place, read_model_config
from megarl.plan.phases import (engine_gpu_reason, memory_reason, offload_per_stage, peak_phase, peak_terms,
                                sync_cost)
from megarl.plan.text import Steps, render

__all__ = ["PlanError", "PlanReport", "add_arguments", "in_flight_layers", "main", "plan_recipe", "run"]

DEFAULT_GPU_MEM_GIB = 80.0
DEFAULT_LINK_GBPS = 50.0  # GB/s: one 400 Gb/s NIC per GPU


@dataclass
class PlanReport:
    text: str
    fits: bool
    peak_bytes: int
    per_gpu_bytes: int  # the peak over phases on the most loaded GPU
    reasons: list[str]
    terms: dict[str, float]  # GiB, the most loaded GPU's terms
    sync_bytes_per_engine_rank: int
    sync_seconds_lower_bound: float
    offloaded_bytes: int = 0  # trainer states in host memory during rollout on the most loaded GPU


def plan_recipe(cfg, nodes: int, gpus_per_node: int, gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB,
                link_gbps: float = DEFAULT_LINK_GBPS) -> PlanReport:
    """The memory/time plan of a validated MegarlConfig on nodes x gpus_per_node GPUs of gpu_mem_gib each."""
    cluster = Cluster(nodes, gpus_per_node, gpu_mem_gib, link_gbps)
    hf = read_model_config(cfg)
    pl = place(cfg, cluster)
    weights = model_weights(hf, pl)
    roles = memory_per_role(cfg, pl, weights)
    engine = engine_memory(cfg.rollout, cluster, pl, weights)
    sync = sync_cost(cfg.rollout, cluster, pl, weights, roles.lora)
    offloaded = offload_per_stage(cfg, roles.models, pl.pp)
    peak = peak_phase(roles, engine, sync, pl, offloaded)
    terms = peak_terms(roles.models, peak, engine, sync, offloaded[peak.stage],
                       cfg.parallelism.use_distributed_optimizer)
    reasons = [x for x in (memory_reason(cfg, roles.models, peak, terms, engine, pl, cluster),
                           gpu_count_reason(pl, cluster), kv_cache_reason(engine, cfg.rollout, cluster),
                           engine_gpu_reason(cfg.rollout, engine, pl, cluster)) if x]
    steps = Steps(cluster, pl, weights, roles, engine, sync, offloaded, peak, terms, reasons)
    return PlanReport(render(cfg, steps), not reasons, peak.bytes, peak.bytes, reasons, terms,
                      engine.weights if sync.adapter_bytes is None else sync.adapter_bytes, sync.seconds,
                      offloaded[peak.stage])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="megarl plan", description="Per-GPU memory, weight-sync bytes and time for a "
                                 "recipe on a cluster, and a verdict (exit 1 when it does not fit).")
    add_arguments(ap)
    return run(ap.parse_intermixed_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as parallelism.tensor_model_"
                    "parallel_size=8")
    ap.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    ap.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    ap.add_argument("--gpu-mem", type=float, default=DEFAULT_GPU_MEM_GIB, help="GiB per GPU (default 80)")
    ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS, help="link bandwidth for the weight-sync "
                    "bound, GB/s (default 50: one 400 Gb/s NIC)")


def run(args: argparse.Namespace) -> int:
    from megarl.config import ConfigError
    from megarl.validate import load_config

    overrides = list(args.overrides)
    try:
        probe = load_config(args.recipe, overrides)
        if probe.engine_placement == "colocated":  # the trainer takes the whole cluster; else engines add GPUs
            overrides += [f"trainer.nnodes={args.nodes}", f"trainer.n_gpus_per_node={args.gpus_per_node}"]
        cfg = load_config(args.recipe, overrides)
        report = plan_recipe(cfg, args.nodes, args.gpus_per_node, args.gpu_mem, args.link_gbps)
    except (ConfigError, PlanError) as exc:
        print(f"megarl plan: {exc}", file=sys.stderr)
        return 1
    print(f"# {args.recipe}")
    print(report.text)
    return 0 if report.fits else 1
