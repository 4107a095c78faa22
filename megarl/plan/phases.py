"""The sync, the time and the phases: bytes and time per weight sync, the offload around rollout, and every phase's
memory, line by line, on each pipeline stage's most loaded GPU and on its node's host.

Weight sync: each engine worker loads its own shard; the GPU hosting it receives from other GPUs only the pieces of
that shard it does not hold itself. At a link bandwidth B the sync takes at least max(received) / B. Engines placed
separately receive their whole shard from the trainer GPUs. Buckets (megarl.plan.terms): one send bucket on a sending
GPU, two receive slots on a GPU hosting an engine worker.
Offload (actor.offload, critic.offload, ref.offload): the selected states (parameters, gradients, optimizer) are in
pinned host memory from the weight sync to the next forward, so the generate phase holds only the rest, and a
colocated engine's KV cache can grow by what was freed. Its cost is a round trip of those bytes over the host link,
estimated at HOST_LINK_GBPS.
Phases, as the trainer runs them (the peak is their maximum), device lines of a stage's most loaded GPU:
  generate           states - offloaded + engine (gpu_memory_utilization, when it is hosted here)
  old/ref log-probs  states + forward logits (last stage) [+ R2's int32 route gather] [+ the forward's CP attention
                     transient] [+ engine if it does not sleep]
  update             states + activations (with the update's logits on the last stage) [+ the update's CP attention
                     transient, megarl.plan.terms.cp_attention_bytes] [+ engine]
  weight sync        states + engine weights (woken) or the whole engine share + send bucket + receive slots
                     [+ the merged LoRA weights of the buckets in flight, megarl.plan.terms.lora_merged_sync_bytes]
  checkpoint save    states [+ engine]
each + the CUDA context + the allocator's reserve over the trainer's bytes. "States" are the parameters, gradients,
fp32 master copies and Adam moments of actor and critic, and the parameters of reference and reward model, always
resident. The trainer GPUs of separately placed engines have no engine line. Host lines per node: megarl.plan.host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.plan.engine import EngineMemory
from megarl.plan.memory import LoraPlan, ModelMemory, Roles
from megarl.plan.model import GIB, Cluster, Placement, Weights
from megarl.plan.terms import (allocator_reserve_bytes, cuda_context_bytes, delta_kept_bytes, delta_kept_where,
                               lora_merged_sync_bytes, receive_bucket_bytes, send_bucket_bytes)

ACTIVATIONS = "activations (update, with its logits)"
FORWARD_LOGITS = "logits (old/ref log-probs, fp32)"
CP_ATTENTION = "context-parallel attention K/V (one layer)"
LORA_MERGED = "LoRA merged weights (sync)"
DELTA_KEPT = "delta updates: last sent pieces (rollout.delta_kept_on=device)"
MOE_DISPATCH = "MoE allgather dispatcher: gathered tokens, probs, routing map (one layer)"
MOE_GATHER_BUFFER = "MoE dispatcher's gather buffer (megatron's global buffer, kept)"
BACKWARD = "update backward: one MLP's gradients (transient)"
OPTIMIZER_STEP = "optimizer step temporaries"
TOKEN_LINES = (ACTIVATIONS, FORWARD_LOGITS, CP_ATTENTION, MOE_DISPATCH, BACKWARD, MOE_GATHER_BUFFER)  # the lines whose bytes follow the tokens per rank
HOST_LINK_GBPS = 25.0  # GB/s: pinned host <-> H100 copies over PCIe Gen5 x16, per direction, as measured in practice


@dataclass(frozen=True)
class SyncCost:
    """One weight sync on its busiest GPU (engine dtype)."""

    received: int  # from other GPUs
    sent: float
    buffers: int  # bucket buffers on the busiest GPU: send bucket + receive slots
    adapter_bytes: Optional[int]  # actor.lora.sync=adapter: the adapters one replica receives, instead of weights
    seconds: float  # lower bound at the link bandwidth
    send_bucket: int = 0  # on a sending GPU
    receive_slots: int = 0  # on a GPU hosting an engine worker
    # per pipeline stage: the merged LoRA weights alive during the sync (megarl.plan.terms.lora_merged_sync_bytes)
    lora_merged: tuple = ()
    # delta updates with rollout.delta_kept_on=device: what a trainer GPU last sent, kept on it for the run
    delta_kept_device: int = 0


@dataclass(frozen=True)
class Peak:
    """The most loaded GPU: its pipeline stage, its busiest phase and every phase's bytes there, line by line."""

    stage: int
    phase: str
    bytes: int
    phases: dict[str, int]
    lines: dict[str, dict[str, int]]  # phase -> named line -> bytes, on this stage's GPU
    engine_here: bool  # a colocated engine worker shares this GPU

    @property
    def train_activations(self) -> int:
        return self.lines["update"].get(ACTIVATIONS, 0)

    @property
    def forward_logits(self) -> int:
        return self.lines["old/ref log-probs"].get(FORWARD_LOGITS, 0)


def optimizer_line(kind: str) -> str:
    """The update phase's line of the optimizer step's temporaries, naming the optimizer (terms.OPTIMIZER_*)."""
    return f"{OPTIMIZER_STEP} ({kind.split(':')[0]}; over the freed activations)"


def host_round_trip_seconds(nbytes: int) -> float:
    return 2 * nbytes / (HOST_LINK_GBPS * 1e9)


def sync_cost(r, cluster: Cluster, pl: Placement, weights: Weights, lora: Optional[LoraPlan]) -> SyncCost:
    """r: the recipe's rollout section."""
    adapter = lora.adapter_sync_bytes if lora else None
    bucket = r.update_weights_bucket_megabytes << 20
    sent = max(weights.sent.values(), default=0) * pl.engine_ratio
    shard = int(max(weights.loaded.values(), default=0) * pl.engine_ratio)
    send, recv = send_bucket_bytes(bucket, int(sent)), 0 if pl.separate else receive_bucket_bytes(bucket, shard)
    if adapter is not None and r.load_format != "dummy":
        send = recv = 0  # the adapters travel in a host shared-memory file; no bucket is ever filled on the GPU
    received = int(max(weights.received.values(), default=0) * pl.engine_ratio)
    if adapter is not None:  # each engine owner gathers the whole adapters, nothing else
        received = adapter
    merged = ()
    if lora is not None and adapter is None:  # on GPU the engine pulls from a bucket while the next is filled
        merged = tuple(lora_merged_sync_bytes(m, big, bucket, 2, pl.engine_tp // pl.tp)
                       for m, big in zip(lora.merged, lora.merged_largest))
    kept = delta_kept_bytes(sent) if delta_kept_where(r, pl, adapter) == "device" else 0
    return SyncCost(received, sent, send + recv, adapter, received / (cluster.link_gbps * 1e9), send, recv, merged,
                    kept)


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


def state_lines(models: list[ModelMemory], s: int, distributed: bool) -> dict[str, int]:
    """Every model's resident states on stage s, one line each (the optimizer as fp32 master copy and Adam moments)."""
    out, dist = {}, " (distributed)" if distributed else ""
    for m in models:
        out[f"{m.name} parameters"] = m.params[s]
        if m.trains:
            out[f"{m.name} gradients (fp32)"] = m.grads[s]
            if m.master and m.master[s]:
                out[f"{m.name} fp32 master copy{dist}"] = m.master[s]
            out[f"{m.name} Adam moments{dist}"] = m.optim[s] - (m.master[s] if m.master else 0)
    return out


def with_overhead(lines: dict[str, int], engine_lines: tuple = ()) -> dict[str, int]:
    """The phase's lines plus the CUDA context and the allocator's reserve over the trainer's own bytes."""
    trainer = sum(v for k, v in lines.items() if k not in engine_lines)
    return {**lines, "CUDA context, cuBLAS, NCCL": cuda_context_bytes(),
            "allocator reserve (fragmentation)": allocator_reserve_bytes(trainer)}


def stage_phases(roles: Roles, e: EngineMemory, sync: SyncCost, offloaded: int, s: int, last: bool,
                 engine_here: bool, distributed: bool = True, r2_gather: int = 0) -> dict[str, dict[str, int]]:
    """Named device lines of each phase on stage s's most loaded GPU, as the trainer runs them: generate -> the
    engine sleeps (KV cache and weights freed) -> old/ref log-probs -> update -> it wakes its weights -> weight sync
    -> it wakes its KV cache; checkpoint saves come between steps."""
    states = state_lines(roles.models, s, distributed)
    if sync.delta_kept_device:  # allocated at the first sync and kept: every phase holds it
        states = {**states, DELTA_KEPT: sync.delta_kept_device}
    if roles.moe_gather_buffer:  # allocated at the first forward and kept: every phase after it holds it
        states = {**states, MOE_GATHER_BUFFER: roles.moe_gather_buffer}
    eng = e.line
    idle = {} if e.sleeps or not engine_here else {eng: e.idle}
    gen = dict(states)
    if offloaded:
        gen["offloaded to host (generate)"] = -offloaded
    if engine_here:
        gen[eng] = e.reserve
    fwd = {**states, **({FORWARD_LOGITS: roles.forward_logits} if last else {}),
           **({"R2 route gather (int32)": r2_gather} if r2_gather else {}),
           **({CP_ATTENTION: roles.cp_attention_forward} if roles.cp_attention_forward else {}), **idle}
    fwd.update({MOE_DISPATCH: roles.moe_dispatch_forward} if roles.moe_dispatch_forward else {})
    # a layer's attention backward and its MLP's backward run one after the other: their transients never coexist,
    # so the phase holds the larger (the CP attention line is what it adds beyond the MLP's)
    mlp = roles.backward_transient[s] if roles.backward_transient else 0
    attention = max(0, roles.cp_attention_update - mlp)
    upd = {**states, ACTIVATIONS: max(m.activations[s] for m in roles.models if m.activations),
           **({CP_ATTENTION: attention} if attention else {}),
           **({MOE_DISPATCH: roles.moe_dispatch_update} if roles.moe_dispatch_update else {}),
           **({BACKWARD: roles.backward_transient[s]} if roles.backward_transient and roles.backward_transient[s]
              else {}), **idle}
    if roles.optimizer_step:
        # the step runs after the backward has freed the activations: the phase holds the larger of the two
        freed = sum(upd.get(k, 0) for k in (ACTIVATIONS, CP_ATTENTION, MOE_DISPATCH, BACKWARD))
        upd[optimizer_line(roles.optimizer)] = max(0, roles.optimizer_step[s] - freed)
    woken = idle or ({"engine weights (woken for the sync)": e.weights} if engine_here else {})
    syn = {**states, **woken, "sync send bucket": sync.send_bucket}
    if s < len(sync.lora_merged) and sync.lora_merged[s]:
        syn[LORA_MERGED] = sync.lora_merged[s]
    if engine_here and sync.receive_slots:
        syn["sync receive slots (2 buckets)"] = sync.receive_slots
    ckpt = {**states, **idle}
    engine_lines = (eng, "engine weights (woken for the sync)")
    return {name: with_overhead(lines, engine_lines) for name, lines in
            (("generate", gen), ("old/ref log-probs", fwd), ("update", upd), ("weight sync", syn),
             ("checkpoint save", ckpt))}


def peak_phase(roles: Roles, e: EngineMemory, sync: SyncCost, pl: Placement, offloaded: list[int],
               distributed: bool = True, r2_gather: int = 0) -> Peak:
    best: Optional[Peak] = None
    for s in range(pl.pp):
        # colocated replicas cover the first replicas * engine TP ranks (by default all of them; stage 0 first)
        here = not pl.separate and (pl.generating == pl.world or s == 0)
        lines = stage_phases(roles, e, sync, offloaded[s], s, s == pl.pp - 1, here, distributed, r2_gather)
        phases = {k: sum(v.values()) for k, v in lines.items()}
        phase = max(phases, key=phases.get)
        if best is None or phases[phase] > best.bytes:
            best = Peak(s, phase, phases[phase], phases, lines, here)
    return best


def peak_terms(peak: Peak) -> dict[str, float]:
    """The most loaded GPU's bytes in its busiest phase, line by line (GiB)."""
    return {k: v / GIB for k, v in peak.lines[peak.phase].items()}


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
    if peak.phase == "update" and cfg.model.recompute != "full":
        hint.append("model.recompute=full or a smaller micro-batch shrinks the activations")
    if peak.phase == "update" and p.context_parallel_size < 8:
        hint.append(f"parallelism.context_parallel_size={2 * p.context_parallel_size} splits each sequence's "
                    "activations over twice the ranks")
    if peak.engine_here and peak.phase != "generate" and not e.sleeps and not pl.separate:
        hint.append("rollout.enable_sleep_mode=true frees the engine's share outside rollouts")
    hint.append("more nodes, or larger TP/PP/EP, shrink the per-GPU states")
    return (f"memory: the {peak.phase} phase needs {peak.bytes / GIB:.1f} GiB on a GPU of pipeline stage {s} "
            f"but a GPU has {cluster.gpu_mem_gib:g} GiB (over by {(peak.bytes - cluster.gpu_bytes) / GIB:.1f} GiB); "
            "largest terms: " + ", ".join(f"{k} {v:.1f} GiB" for v, k in top) + ". Fix: " + "; ".join(hint))


def engine_gpu_reason(r, e: EngineMemory, pl: Placement, cluster: Cluster) -> Optional[str]:
    if not pl.separate or e.reserve <= cluster.gpu_bytes:
        return None
    return (f"engine GPU: gpu_memory_utilization {r.gpu_memory_utilization} of {cluster.gpu_mem_gib:g} GiB exceeds "
            "the GPU")
