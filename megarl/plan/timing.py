"""The time model of one RL step: what the layout search ranks by. Every assumption is a named constant here, printed
with the search's result; none is measured by this module.

  generate   per engine replica, rows R = ceil(N / replicas) sequences of S = prompt + response tokens, at most
             c = min(max_num_seqs, KV tokens / S, R) at once, in ceil(R / c) waves of response_length decode steps;
             a decode step reads the worker's weights and c * S / 2 tokens of KV cache from HBM:
                 step = (shard + c * S / 2 * kv_bytes_per_token) / (HBM_GBPS * DECODE_HBM_EFFICIENCY)
                        + layers * ALLREDUCE_LATENCY_S * 2 (engine TP > 1; x CROSS_NODE_FACTOR across nodes)
             plus the prefill, 2 * active parameters * prompt tokens at PREFILL_MFU.
  forwards   old log-probs (and reference, critic values): 2 * active parameters * N * S FLOPs each,
  update     actor (and critic): 6 * active parameters * N * S FLOPs per epoch, x 4/3 with full recompute
             (x 1.05 selective),
             both over the trainer's GPUs at GPU_TFLOPS * MFU, divided by tp_efficiency (TP_COST per TP doubling,
             EP_COST per EP doubling, CP_COST per CP doubling) and multiplied by the pipeline bubble
             1 + (PP - 1) / (micro-batches * VPP).
  sync       the weight sync's lower bound at the link bandwidth (megarl.plan.phases.sync_cost).
  offload    a host round trip of the offloaded states (megarl.plan.phases.host_round_trip_seconds).
Active parameters: every parameter but the routed experts, plus top_k / num_experts of those.
Calibration (`megarl plan --search --calibration FILE`, FILE from `megarl plan --measure --calibration-out FILE`):
the TFLOP/s per device the measured run achieved in its forward and update phases (its FLOPs counted as above, over
its measured seconds) replace GPU_TFLOPS * MFU for those two phases. Generation, the sync and the offload keep their
assumptions (the measured run starts no engine and moves no weights to it); a calibration describes the device and
layout it was measured on, so measure on the GPU kind you plan for.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

GPU_TFLOPS = 989.0  # H100 SXM dense bf16
HBM_GBPS = 3350.0  # H100 SXM
MFU = {"update": 0.40, "forward": 0.45, "prefill": 0.40}
DECODE_HBM_EFFICIENCY = 0.6
ALLREDUCE_LATENCY_S = 10e-6  # one NVLink all-reduce of a decode step's activations
CROSS_NODE_FACTOR = 5.0
TP_COST = 0.04  # trainer throughput lost per TP doubling (its all-reduces/all-gathers)
EP_COST = 0.03  # per EP doubling (all-to-all dispatch)
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
    return 1.0 / (1.0 + TP_COST * math.log2(tp) + EP_COST * math.log2(ep) + CP_COST * math.log2(cp))


def bubble(pp: int, micro_batches: int, vpp: int) -> float:
    return 1.0 + (pp - 1) / (max(1, micro_batches) * vpp)


def generate_seconds(rows: int, replicas: int, prompt: int, response: int, max_num_seqs: int, kv_tokens: int,
                     shard_bytes: int, kv_per_token: int, layers: int, engine_tp: int, gpus_per_node: int,
                     active: float) -> float:
    """The slowest replica's generation of its rows (see the module doc)."""
    seq = prompt + response
    r = -(-rows // max(1, replicas))
    c = max(1, min(max_num_seqs, kv_tokens // seq, r))
    step = (shard_bytes + c * seq / 2 * kv_per_token) / (HBM_GBPS * 1e9 * DECODE_HBM_EFFICIENCY)
    if engine_tp > 1:
        step += layers * 2 * ALLREDUCE_LATENCY_S * (CROSS_NODE_FACTOR if engine_tp > gpus_per_node else 1.0)
    prefill = 2 * active * r * prompt / (engine_tp * GPU_TFLOPS * 1e12 * MFU["prefill"])
    return -(-r // c) * response * step + prefill


def trainer_seconds(active: float, tokens: int, gpus: int, passes: float, mfu: float, tp: int, ep: int, pp: int,
                    micro_batches: int, vpp: int, cp: int = 1) -> float:
    """`passes` x 2 * active * tokens FLOPs (2 a forward, 6 a forward and backward) over the trainer's GPUs."""
    flops = 2 * active * tokens * passes
    return flops / (gpus * GPU_TFLOPS * 1e12 * mfu) / tp_efficiency(tp, ep, cp) * bubble(pp, micro_batches, vpp)


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


def effective_mfu(phase: str, calibration: Optional[Calibration] = None) -> float:
    """The share of GPU_TFLOPS a trainer phase ("forward" or "update") runs at: measured where calibrated."""
    if calibration is not None and phase in calibration.tflops:
        return calibration.tflops[phase] / GPU_TFLOPS
    return MFU[phase]


def assumptions(calibration: Optional[Calibration] = None) -> str:
    if calibration is not None and calibration.tflops:
        measured = ", ".join(f"{k} {v:.3g}" for k, v in sorted(calibration.tflops.items()))
        return (f"measured ({calibration.source}, {calibration.device}): TFLOP/s per device {measured}; "
                + assumptions().replace("assumed: ", "assumed otherwise: "))
    return (f"assumed: {GPU_TFLOPS:g} TFLOP/s per GPU at MFU update {MFU['update']}, forward {MFU['forward']}, "
            f"prefill {MFU['prefill']}; HBM {HBM_GBPS:g} GB/s at {DECODE_HBM_EFFICIENCY} in decode; "
            f"{TP_COST:.0%} per TP doubling, {EP_COST:.0%} per EP doubling, {CP_COST:.0%} per CP doubling; "
            f"all-reduce latency {ALLREDUCE_LATENCY_S * 1e6:g} us (x{CROSS_NODE_FACTOR:g} across nodes); every "
            "response at full length")
