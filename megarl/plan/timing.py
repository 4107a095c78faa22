"""The time model of one RL step: what the layout search ranks by. Every assumption is a named constant here, printed
with the search's result; none is measured by this module. The GPU (`megarl plan --gpu NAME`, GPUS: H100, H200,
B200, A100) gives the FLOP/s, the HBM and NVLink bandwidths (and the memory, where --gpu-mem does not say).

  generate   per engine replica, rows R = ceil(N / replicas) sequences of S = prompt + response tokens, at most
             c = min(max_num_seqs, KV tokens / S, R) at once, in ceil(R / c) waves of response_length decode steps;
             a decode step is memory-bound: it reads the worker's weights and c * S / 2 tokens of KV cache from HBM:
                 step = (shard + c * S / 2 * kv_bytes_per_token) / (gpu HBM GB/s * DECODE_HBM_EFFICIENCY)
                        + layers * ALLREDUCE_LATENCY_S * 2 (engine TP > 1; x CROSS_NODE_FACTOR across nodes)
             plus the prefill, 2 * active parameters * prompt tokens + the prompt's causal attention, at PREFILL_MFU.
  forwards   old log-probs (and reference, critic values): 2 * active parameters * N * S FLOPs each, plus the causal
             attention of every row as one packed segment (attention_flops: S^2 x heads x (qk + v head dim) per
             layer and row),
  update     actor (and critic): 3 x the forward's FLOPs per epoch, x 4/3 with full recompute (x 1.05 selective),
             both over the trainer's GPUs at the GPU's TFLOP/s * MFU, divided by tp_efficiency (TP_COST per TP
             doubling, CP_COST per CP doubling) and multiplied by the pipeline bubble 1 + (PP - 1) / (micro-batches *
             VPP); MoE: plus the allgather dispatcher's traffic (dispatcher_seconds: the hidden states of the expert
             TP x EP group's tokens gathered and reduce-scattered in every MoE layer, over NVLink or the link across
             nodes; megarl runs megatron's allgather dispatcher, not all-to-all).
  sync       the weight sync's lower bound at the link bandwidth (megarl.plan.phases.sync_cost).
  offload    a host round trip of the offloaded states (megarl.plan.phases.host_round_trip_seconds).
Active parameters: every parameter but the routed experts, plus top_k / num_experts of those.
Calibration (`megarl plan --search --calibration FILE`, FILE from `megarl plan --measure --calibration-out FILE`):
the TFLOP/s per device the measured run achieved in its forward and update phases (its FLOPs counted as above, over
its measured seconds) replace the GPU's TFLOP/s * MFU for those two phases. Generation, the sync and the offload keep their
assumptions (the measured run starts no engine and moves no weights to it); a calibration describes the device and
layout it was measured on, so measure on the GPU kind you plan for.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional



@dataclass(frozen=True)
class Gpu:
    """One GPU kind: dense bf16 tensor TFLOP/s (no sparsity), HBM GB/s, NVLink GB/s per direction, GiB a process sees."""

    name: str
    tflops: float
    hbm_gbps: float
    nvlink_gbps: float
    mem_gib: float


# Vendor datasheet figures, SXM / HGX parts, dense bf16 (the datasheets' headline figures are with 2:4 sparsity, twice
# these): NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s
# both directions, 80 GB); NVIDIA H200 datasheet (H200 SXM: the H100's 989 TFLOP/s, 4.8 TB/s HBM3e, NVLink 900 GB/s,
# 141 GB, about 140 GiB visible); NVIDIA HGX B200 (per GPU: 2.25 PFLOP/s bf16 dense, 8 TB/s HBM3e, NVLink 5 1.8 TB/s,
# 180 GB, 179 GiB visible as the 671B recipe plans); NVIDIA A100 datasheet (A100 SXM 80GB: 312 TFLOP/s bf16 dense,
# 2,039 GB/s HBM2e, NVLink 600 GB/s). NVLink per direction is half the datasheet's bidirectional figure.
GPUS = {g.name: g for g in (
    Gpu("H100", 989.0, 3350.0, 450.0, 80.0),
    Gpu("H200", 989.0, 4800.0, 450.0, 140.0),
    Gpu("B200", 2250.0, 8000.0, 900.0, 179.0),
    Gpu("A100", 312.0, 2039.0, 300.0, 80.0),
)}
DEFAULT_GPU = GPUS["H100"]
GPU_TFLOPS = DEFAULT_GPU.tflops
HBM_GBPS = DEFAULT_GPU.hbm_gbps
COLLECTIVE_EFFICIENCY = 0.7  # NCCL all-gather / reduce-scatter bus bandwidth over the link's rate, at large messages
MFU = {"update": 0.40, "forward": 0.45, "prefill": 0.40}
DECODE_HBM_EFFICIENCY = 0.6
ALLREDUCE_LATENCY_S = 10e-6  # one NVLink all-reduce of a decode step's activations
CROSS_NODE_FACTOR = 5.0
TP_COST = 0.04  # trainer throughput lost per TP doubling (its all-reduces/all-gathers)
CP_COST = 0.05  # per CP doubling: each layer's K/V exchange over the CP ranks, only partly hidden behind attention


@dataclass(frozen=True)
class StepTime:
    """Seconds of one RL step by stage."""

    generate: float
    forwards: float
    update: float
    sync: float
    offload: float

    @property
    def total(self) -> float:
        return self.generate + self.forwards + self.update + self.sync + self.offload


def active_parameters(n_params: int, n_expert: int, topk: int, num_experts: int) -> float:
    return n_params - n_expert + (n_expert * topk / num_experts if num_experts else 0)


def tp_efficiency(tp: int, ep: int, cp: int = 1) -> float:
    """The share of the trainer's throughput left after TP's and CP's exchanges (EP's is priced as the allgather
    dispatcher's traffic, dispatcher_seconds; `ep` is kept for callers)."""
    return 1.0 / (1.0 + TP_COST * math.log2(tp) + CP_COST * math.log2(cp))


def attention_flops(spec, rows: int, seq: int) -> float:
    """Forward FLOPs of causal self-attention's two matrix products over `rows` packed segments of `seq` tokens each:
    per layer and segment QK^T and PV, 2 x seq^2 x heads x head dim each, halved by the causal mask:
    seq^2 x heads x (qk head dim + v head dim). spec: an ArchSpec (MLA: its qk and v head dims)."""
    if spec.mla is not None:
        qk, v = spec.mla.q_head_dim, spec.mla.v_head_dim
    else:
        qk = v = spec.head_dim
    return float(rows) * spec.num_layers * seq * seq * spec.num_attention_heads * (qk + v)


def dispatcher_seconds(spec, tokens: int, dp: int, cp: int, tp: int, sp: bool, expert_tp: int, ep: int, pp: int,
                       collectives: float, pbytes: int, cross_node: bool, link_gbps: float, gpu: Gpu) -> float:
    """The allgather dispatcher's traffic (megarl.plan.terms, the MoE block) over a step's `tokens` on one rank: each
    MoE layer of its stage all-gathers its G = tokens / (DP x CP x TP_sp) x X x EP tokens' hidden states over the
    expert TP x EP group and reduce-scatters them back, `collectives` times per token (2 a forward, 4 a forward and
    backward); a rank receives (g - 1) / g of G x h x p each time, at COLLECTIVE_EFFICIENCY of NVLink within a node
    or of the link across nodes."""
    group = expert_tp * ep
    if not spec.is_moe or group <= 1:
        return 0.0
    moe_layers = sum(1 for i in range(spec.num_layers) if not spec.moe_layers or spec.moe_layers[i]) / pp
    local = tokens / (dp * cp * (tp if sp and tp > 1 else 1))
    moved = local * group * spec.hidden_size * pbytes * (group - 1) / group * moe_layers * collectives
    rate = (link_gbps if cross_node else gpu.nvlink_gbps) * 1e9 * COLLECTIVE_EFFICIENCY
    return moved / rate


def bubble(pp: int, micro_batches: int, vpp: int) -> float:
    return 1.0 + (pp - 1) / (max(1, micro_batches) * vpp)


def generate_seconds(rows: int, replicas: int, prompt: int, response: int, max_num_seqs: int, kv_tokens: int,
                     shard_bytes: int, kv_per_token: int, layers: int, engine_tp: int, gpus_per_node: int,
                     active: float, gpu: Gpu = DEFAULT_GPU, prefill_attention: float = 0.0) -> float:
    """The slowest replica's generation of its rows (see the module doc)."""
    seq = prompt + response
    r = -(-rows // max(1, replicas))
    c = max(1, min(max_num_seqs, kv_tokens // seq, r))
    step = (shard_bytes + c * seq / 2 * kv_per_token) / (gpu.hbm_gbps * 1e9 * DECODE_HBM_EFFICIENCY)
    if engine_tp > 1:
        step += layers * 2 * ALLREDUCE_LATENCY_S * (CROSS_NODE_FACTOR if engine_tp > gpus_per_node else 1.0)
    prefill = (2 * active * r * prompt + prefill_attention * r) / (engine_tp * gpu.tflops * 1e12 * MFU["prefill"])
    return -(-r // c) * response * step + prefill


def trainer_seconds(active: float, tokens: int, gpus: int, passes: float, mfu: float, tp: int, ep: int, pp: int,
                    micro_batches: int, vpp: int, cp: int = 1, gpu: Gpu = DEFAULT_GPU,
                    attention: float = 0.0) -> float:
    """`passes` x (2 * active * tokens + attention) FLOPs (2 a forward, 6 a forward and backward; attention: the
    step's causal attention forward FLOPs, attention_flops) over the trainer's GPUs."""
    flops = (2 * active * tokens + attention) * passes
    return flops / (gpus * gpu.tflops * 1e12 * mfu) / tp_efficiency(tp, ep, cp) * bubble(pp, micro_batches, vpp)


def recompute_factor(recompute: str) -> float:
    return {"full": 4 / 3, "selective": 1.05}.get(recompute, 1.0)


@dataclass(frozen=True)
class Calibration:
    """Measured trainer throughput: phase ("forward", "update") -> achieved TFLOP/s per device."""

    tflops: dict = field(default_factory=dict)
    source: str = ""
    device: str = ""


def read_calibration(path: str) -> Calibration:
    """The file `megarl plan --measure --calibration-out` wrote; ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
        tflops = {k: float(v) for k, v in data["achieved_tflops_per_device"].items() if k in MFU}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--calibration {path}: not a calibration file of `megarl plan --measure --calibration-out` "
                         f"({type(exc).__name__}: {exc}); run that command to make one") from None
    bad = [k for k, v in tflops.items() if not v > 0]
    if bad:
        raise ValueError(f"--calibration {path}: achieved_tflops_per_device {bad} must be positive; measure again")
    return Calibration(tflops, str(path), str(data.get("device", "")))


def effective_mfu(phase: str, calibration: Optional[Calibration] = None, gpu: Gpu = DEFAULT_GPU) -> float:
    """The share of the GPU's TFLOP/s a trainer phase ("forward" or "update") runs at: measured where calibrated."""
    if calibration is not None and phase in calibration.tflops:
        return calibration.tflops[phase] / gpu.tflops
    return MFU[phase]


def assumptions(calibration: Optional[Calibration] = None, gpu: Gpu = DEFAULT_GPU) -> str:
    if calibration is not None and calibration.tflops:
        measured = ", ".join(f"{k} {v:.3g}" for k, v in sorted(calibration.tflops.items()))
        return (f"measured ({calibration.source}, {calibration.device}): TFLOP/s per device {measured}; "
                + assumptions(None, gpu).replace("assumed: ", "assumed otherwise: "))
    return (f"assumed: {gpu.name} {gpu.tflops:g} TFLOP/s per GPU at MFU update {MFU['update']}, forward "
            f"{MFU['forward']}, prefill {MFU['prefill']}, causal attention FLOPs per row; HBM {gpu.hbm_gbps:g} GB/s "
            f"at {DECODE_HBM_EFFICIENCY} in decode; MoE allgather dispatcher at {COLLECTIVE_EFFICIENCY} of NVLink "
            f"{gpu.nvlink_gbps:g} GB/s (the link across nodes); "
            f"{TP_COST:.0%} per TP doubling, {CP_COST:.0%} per CP doubling; "
            f"all-reduce latency {ALLREDUCE_LATENCY_S * 1e6:g} us (x{CROSS_NODE_FACTOR:g} across nodes); every "
            "response at full length")
