"""The plan as text: the layout, per-model states per stage, the most loaded GPU's terms, the sync, the verdict."""
from __future__ import annotations

from dataclasses import dataclass

from megarl.plan.engine import EngineMemory
from megarl.plan.memory import LoraPlan, ModelMemory, Roles
from megarl.plan.model import GIB, Cluster, Placement, Weights
from megarl.plan.phases import HOST_LINK_GBPS, Peak, SyncCost, host_round_trip_seconds
from megarl.plan.terms import delta_kept_bytes, delta_kept_where, delta_update_bytes
from megarl.sync.plan import DTYPE_BYTES


@dataclass(frozen=True)
class Steps:
    """What each step of plan_recipe found."""

    cluster: Cluster
    place: Placement
    weights: Weights
    roles: Roles
    engine: EngineMemory
    sync: SyncCost
    offloaded: list[int]  # per stage
    peak: Peak
    terms: dict[str, float]
    reasons: list[str]
    host: dict  # phase -> named line -> bytes on the busiest node
    host_mem_gib: float


def render(cfg, st: Steps) -> str:
    return "\n".join(_summary(cfg, st) + _states(st.roles.models, cfg.model.recompute) + _peak(st) + _host(st)
                     + _sync(cfg.rollout, st) + _offload(cfg.rollout, st) + _verdict(st))


def _summary(cfg, st: Steps) -> list[str]:
    c, pl, w, e, r, p = st.cluster, st.place, st.weights, st.engine, cfg.rollout, cfg.parallelism
    spec = w.spec
    hosts = "Ray actors" if r.mode == "ray" else "engine processes"
    if pl.separate:
        where = f"separate ({hosts}), {pl.replicas} replica(s) on {pl.generating} GPUs of their own"
    else:
        where = f"colocated, {pl.replicas} replica(s) x TP{pl.engine_tp}: {pl.generating} of {pl.world} GPUs generate"
    lines = [
        f"megarl plan: {c.nodes} node(s) x {c.gpus_per_node} GPU(s) of {c.gpu_mem_gib:g} GiB = {c.gpus} GPUs",
        f"model: {spec.architecture}, {w.n_params / 1e9:.2f} B parameters"
        + (f" ({w.n_expert / 1e9:.2f} B in {spec.num_experts} experts, top-{spec.moe_topk})" if spec.is_moe
           else " (dense)")
        + f", {spec.num_layers} layers, hidden {spec.hidden_size}; trainer dtype {pl.dtype}, engine dtype "
        f"{pl.engine_dtype}",
        f"trainer: {pl.world} GPUs, TP{pl.tp} PP{pl.pp}" + (f" x VPP{pl.vpp} (interleaved 1F1B)" if pl.vpp > 1 else "")
        + f" CP{pl.cp} EP{pl.ep} DP{pl.dp}" + (f" (expert DP {pl.edp})" if spec.is_moe else "")
        + f", sequence parallel {p.sequence_parallel}, recompute {cfg.model.recompute}, distributed optimizer "
        f"{p.use_distributed_optimizer}",
        f"  actor micro-batch: {_micro_tokens(st.roles, pl)}, {st.roles.actor_micro_batches} micro-batch(es) per "
        "mini-batch per rank; models: " + ", ".join(m.name for m in st.roles.models),
    ]
    if st.roles.token_basis:
        lines.append(f"  micro-batch tokens: {st.roles.token_basis}")
    if r.name == "hf":
        lines += [f"engine: hf (transformers), {where}, TP1, no gpu_memory_utilization: its memory grows with the batch "
                  f"and the length; sleeps between rollouts {e.sleeps}",
                  f"  weights {e.weights / GIB:.2f} GiB/GPU, KV cache {e.kv_bytes / GIB:.2f} GiB for {e.batch} row(s) "
                  f"of {r.prompt_length + r.response_length} tokens decoded together (min(max_num_seqs "
                  f"{r.max_num_seqs}, rows per replica)), prefill working set ~{e.activations / GIB:.2f} GiB: "
                  f"{e.reserve / GIB:.2f} GiB in all"]
    else:
        lines += [
            f"engine: {where}, TP{pl.engine_tp} EP{pl.engine_ep}, gpu_memory_utilization {r.gpu_memory_utilization}, "
            f"sleeps between rollouts {e.sleeps}",
            f"  weights {e.weights / GIB:.2f} GiB/GPU, activations ~{e.activations / GIB:.2f} GiB, KV cache "
            f"{max(0, e.kv_budget) / GIB:.2f} GiB = {e.kv_tokens:,} tokens = {e.kv_tokens / e.max_len:.1f} sequences of "
            f"{e.max_len} (max_num_seqs {r.max_num_seqs})"]
    if st.roles.lora:
        lines.append(_lora(cfg.actor.lora, st.roles.lora, pl, w))
    return lines


def _micro_tokens(roles: Roles, pl: Placement) -> str:
    if pl.cp == 1:
        return f"{roles.actor_tokens} tokens"
    return (f"{roles.actor_micro_tokens} tokens, {roles.actor_tokens} on each of CP{pl.cp} ranks (each row padded to "
            f"a multiple of {2 * pl.cp}; attention: {'Transformer Engine ring' if pl.te else 'K/V all-gathered'})")


def _lora(settings, lora: LoraPlan, pl: Placement, w: Weights) -> str:
    synced = ("the engine receives merged weights, the shards below" if lora.adapter_sync_bytes is None else
              f"the engine keeps its base and each replica receives the whole adapters, "
              f"{lora.adapter_sync_bytes / 2**20:.2f} MiB in {pl.engine_dtype} (vLLM slices them per worker)")
    return (f"LoRA rank {settings.rank} on {lora.projections}: {lora.total / 1e6:.1f} M adapter parameters "
            f"({lora.total * pl.pbytes / GIB:.2f} GiB), at most {lora.per_gpu_max / 1e6:.1f} M per GPU; the base "
            f"({w.n_params / 1e9:.2f} B) is frozen: no gradients, no optimizer states; the reference policy is the "
            f"actor with adapters disabled (no memory); sync {settings.sync}: {synced}")


def _row(label: str, values: list[int], note: str = "") -> str:
    return label + " ".join(f"{b / GIB:7.2f}" for b in values) + note


def _states(models: list[ModelMemory], recompute: str) -> list[str]:
    lines = ["", "per-model states per GPU (GiB), by pipeline stage:"]
    for m in models:
        lines.append(_row(f"  {m.name:7s} params ", m.params))
        if m.grads:
            lines += [_row("          grads  ", m.grads),
                      _row("          optim  ", m.optim_distributed, "  (distributed optimizer)"),
                      _row("          optim  ", m.optim_replicated, "  (without it)"),
                      _row("          activ. ", m.activations, f"  (recompute {recompute})")]
    return lines


def _peak(st: Steps) -> list[str]:
    peak, gib = st.peak, st.cluster.gpu_mem_gib
    lines = ["", f"most loaded GPU: pipeline stage {peak.stage}" + (" (hosts the engine)" if peak.engine_here else "")
             + f", peak in the {peak.phase} phase:"]
    lines += [f"  {k:46s} {v:8.2f} GiB" for k, v in st.terms.items()]
    lines.append(f"  {'total':46s} {peak.bytes / GIB:8.2f} GiB of {gib:g}")
    lines.append("  phases: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in peak.phases.items()) + " GiB")
    if peak.phase != "update":  # the update's own lines (activations, MoE dispatcher, backward, optimizer step)
        upd, states = peak.lines["update"], peak.lines["checkpoint save"]
        own = {k: v for k, v in upd.items() if k not in states and not k.startswith(("CUDA", "allocator"))}
        lines.append("  update phase's own lines here: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in own.items())
                     + " GiB")
    return lines


def _host(st: Steps) -> list[str]:
    totals = {k: sum(v.values()) for k, v in st.host.items()}
    phase = max(totals, key=totals.get)
    lines = ["", f"host memory of the busiest node, peak in the {phase} phase:"]
    lines += [f"  {k:46s} {v / GIB:8.2f} GiB" for k, v in st.host[phase].items()]
    lines.append(f"  {'total':46s} {totals[phase] / GIB:8.2f} GiB of {st.host_mem_gib:g}")
    lines.append("  phases: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in totals.items()) + " GiB")
    return lines


def _sync(r, st: Steps) -> list[str]:
    sync, link, dtype = st.sync, st.cluster.link_gbps, st.place.engine_dtype
    if sync.adapter_bytes is None:
        lines = [f"weight sync ({dtype}), per sync: each engine worker loads its shard, at most "
                 f"{st.engine.weights / GIB:.2f} GiB; a GPU receives at most {sync.received / GIB:.2f} GiB from other "
                 f"GPUs (>= {sync.seconds:.2f} s at {link:g} GB/s) and sends at most {sync.sent / GIB:.2f} GiB; no "
                 "GPU gathers the model",
                 f"sync buckets ({r.update_weights_bucket_megabytes} MiB): {sync.send_bucket / 2**20:.0f} MiB to send "
                 f"on the busiest sender, {sync.receive_slots / 2**20:.0f} MiB of receive slots on a GPU hosting an "
                 "engine worker"]
    else:
        lines = [f"weight sync ({dtype}), per sync (actor.lora.sync=adapter): {sync.adapter_bytes:,} bytes of adapters "
                 f"({sync.adapter_bytes / 2**20:.2f} MiB) per engine replica, gathered on its owner GPU (>= "
                 f"{sync.seconds * 1e3:.2f} ms at {link:g} GB/s) and loaded by every worker of it through vLLM's LoRA "
                 "support; no base weight moves",
                 "sync buffers: one shared-memory file of the adapters"]
    if st.place.separate:
        lines[0] += (" (engines placed separately: each engine GPU receives its whole shard from the trainer GPUs "
                     "over the transfer group; the engines do not sleep, and the trainer GPUs hold no engine)")
        if delta_kept_where(r, st.place, sync.adapter_bytes):
            lines.append(_delta(r, st))
    return [""] + lines


def _delta(r, st: Steps) -> str:
    """The delta updates' kept copies, where they live, and their expected bytes at the share of elements an RL step
    changes in bf16 (1-3% measured on dense models by verl; 0-2.5% on megarl's tiny recipe at lr 1e-6)."""
    sync, size = st.sync, DTYPE_BYTES[st.place.engine_dtype]
    low, high = (delta_update_bytes(int(sync.sent), size, share) for share in (0.01, 0.03))
    kept = delta_kept_bytes(sync.sent) / GIB
    where = (f"{kept:.2f} GiB of GPU memory, counted in every phase above (rollout.delta_kept_on=device: the diff runs "
             "on the GPU)" if r.delta_kept_on == "device" else
             f"{kept:.2f} GiB of pinned host memory (rollout.delta_kept_on=host: the diff runs on the CPU; device "
             "would keep it on the GPU)")
    return (f"delta updates (rollout.delta_updates, a full one every {r.delta_full_every}): each trainer GPU keeps "
            f"what it last sent, {where}; each engine host its replica's share ({st.engine.weights / GIB:.2f} GiB a "
            f"GPU) in host memory; with 1-3% of the elements changed an update sends {low / GIB:.2f}-"
            f"{high / GIB:.2f} GiB from the busiest GPU instead of {sync.sent / GIB:.2f} GiB")


def _offload(r, st: Steps) -> list[str]:
    if not any(st.offloaded):
        return []
    here, least = st.offloaded[st.peak.stage], min(st.offloaded)
    grown = min(0.95, r.gpu_memory_utilization + least / st.cluster.gpu_bytes)
    return ["", f"offload around rollout: {here / GIB:.2f} GiB of trainer states per GPU (at least "
            f"{least / GIB:.2f} on every stage) in pinned host memory while the engine generates; round trip >= "
            f"{host_round_trip_seconds(here):.2f} s at {HOST_LINK_GBPS:g} GB/s",
            f"  the engine's KV cache can grow by {least / GIB:.2f} GiB = {least // st.engine.kv_per_token:,} tokens: "
            f"rollout.gpu_memory_utilization up to {grown:.2f}"
            + ("" if not st.place.separate else " (engines placed separately: no gain)")]


def _verdict(st: Steps) -> list[str]:
    verdict = "FITS" if not st.reasons else "DOES NOT FIT"
    return (["", f"verdict: {verdict} (peak {st.peak.bytes / GIB:.1f} of {st.cluster.gpu_mem_gib:g} GiB per GPU)"]
            + [f"  - {x}" for x in st.reasons])
