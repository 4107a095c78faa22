"""The sync, the time and the phases: bytes and time per weight sync, the offload around rollout, and the busiest
phase of the most loaded GPU.

Weight sync: each engine worker loads its own shard; the GPU hosting it receives from other GPUs only the pieces of
that shard it does not hold itself. At a link bandwidth B the sync takes at least max(received) / B. Engines placed
separately receive their whole shard from the trainer GPUs. Sync buffers: two buckets
(rollout.update_weights_bucket_megabytes), the one being gathered and the one being loaded.
Reserve: CUDA context, NCCL and allocator fragmentation, a fixed RESERVE_GIB.
Offload (actor.offload, critic.offload, ref.offload): the selected states (parameters, gradients, optimizer) are in
pinned host memory from the weight sync to the next forward, so the rollout phase holds only the rest, and a colocated
engine's KV cache can grow by what was freed. Its cost is a round trip of those bytes over the host link, estimated at
HOST_LINK_GBPS.
Phases (the peak is their maximum): rollout (states [- offloaded] + engine), logprob forwards (states + forward logits
[+ engine if it does not sleep]), training (states + activations [+ engine]), weight sync (states + engine weights +
buffers). "States" are the parameters, gradients and optimizer states of actor, critic and reference, always resident.
The trainer GPUs of separately placed engines have no engine term.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.plan.engine import EngineMemory
from megarl.plan.memory import LoraPlan, ModelMemory, Roles
from megarl.plan.model import GIB, Cluster, Placement, Weights

RESERVE_GIB = 2.0  # CUDA context, NCCL buffers, allocator fragmentation
HOST_LINK_GBPS = 25.0  # GB/s: pinned host <-> H100 copies over PCIe Gen5 x16, per direction, as measured in practice


@dataclass(frozen=True)
class SyncCost:
    """One weight sync on its busiest GPU (engine dtype)."""

    received: int  # from other GPUs
    sent: float
    buffers: int  # bucket buffers on the GPU
    adapter_bytes: Optional[int]  # actor.lora.sync=adapter: the adapters one replica receives, instead of weights
    seconds: float  # lower bound at the link bandwidth


@dataclass(frozen=True)
class Peak:
    """The most loaded GPU: its pipeline stage, its busiest phase and every phase's bytes there."""

    stage: int
    phase: str
    bytes: int
    phases: dict[str, int]
    train_activations: int
    forward_logits: int
    engine_here: bool  # a colocated engine worker shares this GPU
    engine_in_phase: bool  # and holds its whole share in the busiest phase


def reserve_bytes() -> int:
    return int(RESERVE_GIB * GIB)


def host_round_trip_seconds(nbytes: int) -> float:
    return 2 * nbytes / (HOST_LINK_GBPS * 1e9)


def sync_cost(r, cluster: Cluster, pl: Placement, weights: Weights, lora: Optional[LoraPlan]) -> SyncCost:
    """r: the recipe's rollout section."""
    adapter = lora.adapter_sync_bytes if lora else None
    buffers = 2 * (r.update_weights_bucket_megabytes << 20)
    if adapter is not None and r.load_format != "dummy":
        buffers = 0  # the adapters travel in a host shared-memory file; no bucket is ever filled on the GPU
    received = int(max(weights.received.values(), default=0) * pl.engine_ratio)
    if adapter is not None:  # each engine owner gathers the whole adapters, nothing else
        received = adapter
    sent = max(weights.sent.values(), default=0) * pl.engine_ratio
    return SyncCost(received, sent, buffers, adapter, received / (cluster.link_gbps * 1e9))


def offloaded_bytes(cfg, m: ModelMemory, s: int) -> int:
    """What actor/critic/ref.offload moves of model m's stage-s states to host memory during rollout."""
    if m.name == "ref":
        return m.params[s] if cfg.ref.offload else 0
    sel = {"actor": cfg.actor.offload, "critic": cfg.critic.offload}.get(m.name)
    if sel is None:
        return 0
    return (m.params[s] if sel.params else 0) + (m.grads[s] if sel.grads else 0) + (m.optim[s] if sel.optimizer else 0)


def offload_per_stage(cfg, models: list[ModelMemory], pp: int) -> list[int]:
    return [sum(offloaded_bytes(cfg, m, s) for m in models) for s in range(pp)]


def stage_phases(roles: Roles, e: EngineMemory, sync: SyncCost, offloaded: int, s: int, last: bool,
                 engine_here: bool) -> dict[str, int]:
    """Bytes of each phase on stage s's most loaded GPU, as the trainer runs them: rollout -> the engine sleeps
    (KV cache and weights freed) -> logprob forwards -> training -> it wakes its weights -> sync -> it wakes its KV
    cache."""
    states = sum(m.state(s) for m in roles.models)
    busy = e.reserve if engine_here else 0
    idle = 0 if e.sleeps or not engine_here else e.reserve
    reserve = reserve_bytes()
    return {
        "rollout": states - offloaded + busy + reserve,
        "logprob forward": states + (roles.forward_logits if last else 0) + idle + reserve,
        "train": states + max(m.activations[s] for m in roles.models if m.activations) + idle + reserve,
        # a sleeping engine wakes its weights (not its KV cache) to receive the sync
        "weight sync": states + (idle or (e.weights if engine_here else 0)) + sync.buffers + reserve,
    }


def peak_phase(roles: Roles, e: EngineMemory, sync: SyncCost, pl: Placement, offloaded: list[int]) -> Peak:
    best: Optional[Peak] = None
    for s in range(pl.pp):
        # colocated replicas cover the first replicas * engine TP ranks (by default all of them; stage 0 first)
        here = not pl.separate and (pl.generating == pl.world or s == 0)
        phases = stage_phases(roles, e, sync, offloaded[s], s, s == pl.pp - 1, here)
        phase = max(phases, key=phases.get)
        if best is None or phases[phase] > best.bytes:
            best = Peak(s, phase, phases[phase], phases,
                        max(m.activations[s] for m in roles.models if m.activations),
                        roles.forward_logits if s == pl.pp - 1 else 0, here,
                        here and (phase == "rollout" or not e.sleeps))
    return best


def peak_terms(models: list[ModelMemory], peak: Peak, e: EngineMemory, sync: SyncCost, offloaded: int,
               distributed: bool) -> dict[str, float]:
    """The most loaded GPU's bytes in its busiest phase, term by term (GiB)."""
    s, terms = peak.stage, {}
    for m in models:
        terms[f"{m.name} parameters"] = m.params[s] / GIB
        if m.grads:
            terms[f"{m.name} gradients (fp32)"] = m.grads[s] / GIB
            terms[f"{m.name} optimizer" + (" (distributed)" if distributed else "")] = m.optim[s] / GIB
    if peak.phase == "train":
        terms["activations (train)"] = peak.train_activations / GIB
    if peak.phase == "logprob forward":
        terms["logits (logprob forward)"] = peak.forward_logits / GIB
    if peak.engine_in_phase:
        terms["engine (gpu_memory_utilization)"] = e.reserve / GIB
    elif peak.phase == "weight sync" and peak.engine_here:
        terms["engine weights"] = e.weights / GIB
    if peak.phase == "weight sync":
        terms["sync buffers"] = sync.buffers / GIB
    if peak.phase == "rollout" and offloaded:
        terms["offloaded to host (rollout)"] = -offloaded / GIB
    terms["reserve (CUDA context, NCCL, fragmentation)"] = reserve_bytes() / GIB
    return terms


def memory_reason(cfg, models: list[ModelMemory], peak: Peak, terms: dict[str, float], e: EngineMemory,
                  pl: Placement, cluster: Cluster) -> Optional[str]:
    """Why the busiest phase does not fit, with its largest terms and what would shrink them."""
    if peak.bytes <= cluster.gpu_bytes:
        return None
    p, s = cfg.parallelism, peak.stage
    top = sorted(((v, k) for k, v in terms.items()), reverse=True)[:3]
    hint = []
    if not p.use_distributed_optimizer and models[0].optim_replicated[s] > models[0].optim_distributed[s]:
        saved = sum(m.optim_replicated[s] - m.optim_distributed[s] for m in models if m.optim)
        hint.append(f"parallelism.use_distributed_optimizer=true saves {saved / GIB:.1f} GiB")
    if peak.phase == "train" and cfg.model.recompute != "full":
        hint.append("model.recompute=full or a smaller micro-batch shrinks the activations")
    if peak.engine_in_phase and not e.sleeps and not pl.separate:
        hint.append("rollout.enable_sleep_mode=true frees the engine's share outside rollouts")
    hint.append("more nodes, or larger TP/PP/EP, shrink the per-GPU states")
    return (f"memory: the {peak.phase} phase needs {peak.bytes / GIB:.1f} GiB on a GPU of pipeline stage {s} "
            f"but a GPU has {cluster.gpu_mem_gib:g} GiB (over by {(peak.bytes - cluster.gpu_bytes) / GIB:.1f} GiB); "
            "largest terms: " + ", ".join(f"{k} {v:.1f} GiB" for v, k in top) + ". Fix: " + "; ".join(hint))


def engine_gpu_reason(r, e: EngineMemory, pl: Placement, cluster: Cluster) -> Optional[str]:
    if not pl.separate or e.reserve + reserve_bytes() <= cluster.gpu_bytes:
        return None
    return (f"engine GPU: gpu_memory_utilization {r.gpu_memory_utilization} plus the reserve exceeds "
            f"{cluster.gpu_mem_gib:g} GiB")
