"""Resharding plan: which Megatron ranks send which HF tensors, and which engine ranks receive which slices.

Pure and deterministic: computed from an HF config dict and two layouts, no process group, no weights. It states what
a weight sync moves (per tensor, per rank, in bytes), is printed by `python -m megarl.rollout.plan`, and is the input
the planner will use to choose layouts.

Conventions
* Megatron ranks of one data-parallel replica, megatron-core order tp-ep-pp: rank = tp + TP * (ep + EP * pp).
  Dense tensors are sent by the ep == 0 ranks (the other EP ranks hold replicas); expert e of a MoE layer lives on
  ep rank e // (experts / EP), split over its TP ranks (expert TP = TP).
* Split kinds: "column" (HF dim 0: q/k/v, gate/up, experts' gate/up, router-free), "row" (HF dim 1: o_proj, down_proj),
  "vocab" (dim 0 of embed_tokens / lm_head), "replicated" (norms, router, biases of row layers).
* Engine ranks 0..engine_TP-1 (vLLM's TP group). With engine EP > 1 (it must equal engine TP: vLLM's expert parallel
  group is its TP group) expert e is received whole by engine rank e // (experts / EP); otherwise experts are split
  over engine TP like dense MLPs. A "column"/"row"/"vocab" tensor reaches every engine rank as its 1/TP slice along
  the split dim; a replicated tensor reaches every engine rank whole.
* Megatron shards are gathered into full HF tensors (the bridge export) and then sliced for the engine, so a rank
  sends exactly the bytes it holds and an engine rank receives exactly the bytes it keeps.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    moe_ffn: int = 0
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    family: str = "llama"

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelShape":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        family = "mixtral" if "Mixtral" in arch else "qwen2" if arch.startswith("Qwen2") else \
            "qwen3" if arch.startswith("Qwen3") else "llama"
        heads = int(cfg["num_attention_heads"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        return cls(hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                   ffn=int(cfg.get("intermediate_size") or 0), vocab=int(cfg["vocab_size"]), experts=experts,
                   moe_ffn=int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size") if experts else 0)
                               or 0),
                   tied=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=family == "qwen2",
                   qk_norm=family == "qwen3", family=family)

    def tensors(self) -> list[tuple[str, tuple[int, ...], str, Optional[int], Optional[int]]]:
        """(HF name, shape, split kind, layer or None, expert or None) for every tensor of the HF checkpoint."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: list = [("model.embed_tokens.weight", (self.vocab, h), "vocab", None, None)]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [(f"{p}.input_layernorm.weight", (h,), "replicated", i, None),
                    (f"{p}.self_attn.q_proj.weight", (q, h), "column", i, None),
                    (f"{p}.self_attn.k_proj.weight", (kv, h), "column", i, None),
                    (f"{p}.self_attn.v_proj.weight", (kv, h), "column", i, None)]
            if self.qkv_bias:
                out += [(f"{p}.self_attn.{n}_proj.bias", (d,), "column", i, None)
                        for n, d in (("q", q), ("k", kv), ("v", kv))]
            if self.qk_norm:
                out += [(f"{p}.self_attn.{n}_norm.weight", (self.head_dim,), "replicated", i, None) for n in "qk"]
            out += [(f"{p}.self_attn.o_proj.weight", (h, q), "row", i, None),
                    (f"{p}.post_attention_layernorm.weight", (h,), "replicated", i, None)]
            if self.experts:
                f = self.moe_ffn
                if self.family == "mixtral":
                    out.append((f"{p}.block_sparse_moe.gate.weight", (self.experts, h), "replicated", i, None))
                    names = (("w1", (f, h), "column"), ("w3", (f, h), "column"), ("w2", (h, f), "row"))
                    base = f"{p}.block_sparse_moe.experts"
                else:
                    out.append((f"{p}.mlp.gate.weight", (self.experts, h), "replicated", i, None))
                    names = (("gate_proj", (f, h), "column"), ("up_proj", (f, h), "column"),
                             ("down_proj", (h, f), "row"))
                    base = f"{p}.mlp.experts"
                for e in range(self.experts):
                    out += [(f"{base}.{e}.{n}.weight", s, k, i, e) for n, s, k in names]
            else:
                out += [(f"{p}.mlp.gate_proj.weight", (self.ffn, h), "column", i, None),
                        (f"{p}.mlp.up_proj.weight", (self.ffn, h), "column", i, None),
                        (f"{p}.mlp.down_proj.weight", (h, self.ffn), "row", i, None)]
        out.append(("model.norm.weight", (h,), "replicated", None, None))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, h), "vocab", None, None))
        return out


@dataclass(frozen=True)
class TensorMove:
    name: str
    shape: tuple[int, ...]
    kind: str  # column | row | vocab | replicated
    bytes: int
    pp_stage: int
    senders: dict[int, int]  # Megatron rank -> bytes it sends
    receivers: dict[int, tuple[Optional[int], int, int, int]]  # engine rank -> (split dim or None, start, stop, bytes)


@dataclass
class ReshardPlan:
    tp: int
    pp: int
    ep: int
    engine_tp: int
    engine_ep: int
    dtype_bytes: int
    moves: list[TensorMove] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(m.bytes for m in self.moves)

    def bytes_sent(self) -> dict[int, int]:
        out = {r: 0 for r in range(self.tp * self.pp * self.ep)}
        for m in self.moves:
            for r, b in m.senders.items():
                out[r] += b
        return out

    def bytes_received(self) -> dict[int, int]:
        out = {r: 0 for r in range(self.engine_tp)}
        for m in self.moves:
            for r, rec in m.receivers.items():
                out[r] += rec[3]
        return out

    def summary(self, per_tensor: bool = False) -> str:
        gib = 1024 ** 3
        lines = [f"reshard plan: Megatron TP{self.tp} PP{self.pp} EP{self.ep} -> engine TP{self.engine_tp} "
                 f"EP{self.engine_ep}; {len(self.moves)} tensors, {self.total_bytes / gib:.3f} GiB "
                 f"({self.dtype_bytes} bytes/element)"]
        lines.append("Megatron rank (tp, ep, pp): bytes sent")
        for r, b in self.bytes_sent().items():
            tp, rest = r % self.tp, r // self.tp
            lines.append(f"  rank {r:4d} ({tp}, {rest % self.ep}, {rest // self.ep}): {b:>14,d} B  "
                         f"{b / gib:8.3f} GiB")
        lines.append("engine rank: bytes received")
        for r, b in self.bytes_received().items():
            lines.append(f"  engine {r:3d}: {b:>14,d} B  {b / gib:8.3f} GiB")
        if per_tensor:
            lines.append("tensor, shape, kind, bytes, stage, senders{rank: bytes}, receivers{rank: (dim, start, stop)}")
            for m in self.moves:
                rec = {r: v[:3] for r, v in m.receivers.items()}
                lines.append(f"  {m.name} {list(m.shape)} {m.kind} {m.bytes} pp{m.pp_stage} {m.senders} {rec}")
        return "\n".join(lines)


def _stage_of(layer: Optional[int], name: str, layers: int, pp: int) -> int:
    if layer is None:
        return 0 if "embed_tokens" in name else pp - 1
    return layer // (layers // pp)


def build_plan(shape: ModelShape, tp: int = 1, pp: int = 1, ep: int = 1, engine_tp: int = 1, engine_ep: int = 1,
               dtype: str = "bfloat16") -> ReshardPlan:
    """The plan for `shape` from Megatron (tp, pp, ep) to an engine (engine_tp, engine_ep)."""
    for key, val in (("tp", tp), ("pp", pp), ("ep", ep), ("engine_tp", engine_tp), ("engine_ep", engine_ep)):
        if val < 1:
            raise ValueError(f"{key}={val} must be >= 1")
    if shape.layers % pp:
        raise ValueError(f"pp={pp} must divide num_hidden_layers={shape.layers}")
    if (ep > 1 or engine_ep > 1) and not shape.experts:
        raise ValueError("ep/engine_ep > 1 needs a MoE model (num_experts > 0)")
    if shape.experts and (shape.experts % ep or shape.experts % engine_ep):
        raise ValueError(f"num_experts={shape.experts} must be divisible by ep={ep} and engine_ep={engine_ep}")
    if engine_ep > 1 and engine_ep != engine_tp:
        raise ValueError(f"engine_ep={engine_ep} must equal engine_tp={engine_tp} (vLLM's expert-parallel group is "
                         f"its tensor-parallel group)")
    nbytes = DTYPE_BYTES[dtype]
    plan = ReshardPlan(tp, pp, ep, engine_tp, engine_ep, nbytes)
    for name, shp, kind, layer, expert in shape.tensors():
        size = math.prod(shp) * nbytes
        stage = _stage_of(layer, name, shape.layers, pp)
        ep_rank = expert // (shape.experts // ep) if expert is not None else 0
        base = tp * (ep_rank + ep * stage)
        if kind in ("column", "row") and shp[0 if kind == "column" else -1] % tp:
            raise ValueError(f"{name}: the split dim of {list(shp)} is not divisible by Megatron tp={tp}")
        if kind == "replicated":
            senders = {base: size}
        else:  # Megatron pads the vocabulary to a multiple of TP: real rows per rank, the last rank gets the rest
            rows, step = shp[0 if kind != "row" else -1], -(-shp[0 if kind != "row" else -1] // tp)
            senders = {base + t: (min((t + 1) * step, rows) - min(t * step, rows)) * (size // rows)
                       for t in range(tp)}
        receivers: dict[int, tuple[Optional[int], int, int, int]] = {}
        if expert is not None and engine_ep > 1:
            receivers[expert // (shape.experts // engine_ep)] = (None, 0, 0, size)
        elif kind == "replicated" or engine_tp == 1:
            for r in range(engine_tp):
                receivers[r] = (None, 0, 0, size)
        else:
            dim = 0 if kind in ("column", "vocab") else len(shp) - 1
            if shp[dim] % engine_tp and kind != "vocab":
                raise ValueError(f"{name}: dim {dim} of {list(shp)} is not divisible by engine_tp={engine_tp}")
            step = -(-shp[dim] // engine_tp)  # vLLM pads the vocabulary; the last rank gets the remainder
            per_row = size // shp[dim]
            for r in range(engine_tp):
                start, stop = min(r * step, shp[dim]), min((r + 1) * step, shp[dim])
                receivers[r] = (dim, start, stop, (stop - start) * per_row)
        plan.moves.append(TensorMove(name, tuple(shp), kind, size, stage, senders, receivers))
    return plan


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megarl.rollout.plan",
                                 description="Print the weight resharding plan from a Megatron layout to an engine "
                                 "layout for an HF config.json (no weights, no processes).")
    ap.add_argument("--hf-config", required=True, help="path to an HF config.json (or a model directory)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--engine-tp", type=int, default=1)
    ap.add_argument("--engine-ep", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--per-tensor", action="store_true", help="also list every tensor's senders and receivers")
    args = ap.parse_args(argv)
    path = args.hf_config
    if not path.endswith(".json"):
        path = path.rstrip("/") + "/config.json"
    try:
        with open(path) as f:
            cfg = json.load(f)
        plan = build_plan(ModelShape.from_hf_config(cfg.get("text_config", cfg)), args.tp, args.pp, args.ep,
                          args.engine_tp, args.engine_ep, args.dtype)
    except (OSError, KeyError, ValueError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(plan.summary(per_tensor=args.per_tensor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
