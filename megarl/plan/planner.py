"""The plan's steps in the order plan_recipe takes them: place the model (model.py), memory per role (memory.py),
the engine (engine.py), the sync, the phases and their peak (phases.py), host memory (host.py), and the reasons it
does not fit; the text (text.py) renders what they found. Apart from the command (megarl.plan) so the search and the
measurement plan each layout without importing the command that imports them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.plan.engine import engine_memory, kv_cache_reason
from megarl.plan.host import host_phases, r2_gather_bytes
from megarl.plan.memory import Lengths, memory_per_role
from megarl.plan.model import GIB, Cluster, gpu_count_reason, model_weights, place, read_model_config
from megarl.plan.phases import (engine_gpu_reason, memory_reason, offload_per_stage, peak_phase, peak_terms,
                                sync_cost)
from megarl.plan.text import Steps, render

DEFAULT_GPU_MEM_GIB = 80.0
DEFAULT_HOST_MEM_GIB = 2048.0  # per node: an 8-GPU H100 node's 2 TiB
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
    phases: Optional[dict] = None  # phase -> bytes on the most loaded GPU
    host_peak_bytes: int = 0  # the busiest node's host memory in its busiest phase
    host_phases: Optional[dict] = None  # phase -> named line -> bytes on that node


def plan_recipe(cfg, nodes: int, gpus_per_node: int, gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB,
                link_gbps: float = DEFAULT_LINK_GBPS, host_mem_gib: float = DEFAULT_HOST_MEM_GIB,
                weights_fn=model_weights, lengths: Optional[Lengths] = None) -> PlanReport:
    """The memory/time plan of a validated MegarlConfig on nodes x gpus_per_node GPUs of gpu_mem_gib each (and
    host_mem_gib of host memory per node). weights_fn(hf, placement): who holds which bytes (the sync plan; the
    layout search passes a faster count of the same mapping, megarl.plan.counts). lengths: the measured response
    lengths the micro-batches are counted from (None: every row at full length; megarl.plan.memory.Lengths)."""
    cluster = Cluster(nodes, gpus_per_node, gpu_mem_gib, link_gbps)
    steps = plan_steps(cfg, cluster, read_model_config(cfg), host_mem_gib, weights_fn, lengths)
    sync, peak, host = steps.sync, steps.peak, steps.host
    return PlanReport(render(cfg, steps), not steps.reasons, peak.bytes, peak.bytes, steps.reasons, steps.terms,
                      steps.engine.weights if sync.adapter_bytes is None else sync.adapter_bytes, sync.seconds,
                      steps.offloaded[peak.stage], peak.phases, max(sum(v.values()) for v in host.values()), host)


def plan_steps(cfg, cluster: Cluster, hf: dict, host_mem_gib: float = DEFAULT_HOST_MEM_GIB,
               weights_fn=model_weights, lengths: Optional[Lengths] = None) -> Steps:
    """Every step of the plan (no text): the search calls this once per layout."""
    pl = place(cfg, cluster)
    weights = weights_fn(hf, pl)
    roles = memory_per_role(cfg, pl, weights, lengths)
    engine = engine_memory(cfg.rollout, cluster, pl, weights, cfg.routes_from_engine,
                           cfg.data.train_batch_size * cfg.rollout.n)
    sync = sync_cost(cfg.rollout, cluster, pl, weights, roles.lora)
    offloaded = offload_per_stage(cfg, roles.models, pl.pp)
    distributed = cfg.parallelism.use_distributed_optimizer
    peak = peak_phase(roles, engine, sync, pl, offloaded, distributed, r2_gather_bytes(cfg, weights.spec))
    terms = peak_terms(peak)
    host = host_phases(cfg, weights.spec, pl, cluster, roles.models, peak.stage, max(offloaded), engine.weights,
                       sync.adapter_bytes, sync.sent)
    host_totals = {k: sum(v.values()) for k, v in host.items()}
    reasons = [x for x in (memory_reason(cfg, roles.models, peak, terms, engine, pl, cluster),
                           host_reason(host, host_totals, host_mem_gib),
                           gpu_count_reason(pl, cluster), kv_cache_reason(engine, cfg.rollout, cluster),
                           engine_gpu_reason(cfg.rollout, engine, pl, cluster)) if x]
    return Steps(cluster, pl, weights, roles, engine, sync, offloaded, peak, terms, reasons, host, host_mem_gib)


def host_reason(host: dict, totals: dict, host_mem_gib: float) -> Optional[str]:
    phase = max(totals, key=totals.get)
    if totals[phase] <= host_mem_gib * GIB:
        return None
    top = sorted(((v, k) for k, v in host[phase].items()), reverse=True)[:3]
    return (f"host memory: the {phase} phase needs {totals[phase] / GIB:.1f} GiB on a node but a node has "
            f"{host_mem_gib:g} GiB (--host-mem); largest lines: " + ", ".join(f"{k} {v / GIB:.1f} GiB" for v, k in top)
            + ". Fix: less offload (actor/critic/ref.offload), a smaller rollout.update_weights_bucket_megabytes, or "
            "more nodes")
