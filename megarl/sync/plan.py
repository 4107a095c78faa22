"""The weight-sync plan of a trainer layout and an engine layout, from an HF config: pure, printable.

One plan object for both uses: `build_plan` computes it without processes (the trainer's holdings from the megatron
layout, `shards.layout_owners`; each engine worker's needs from `shards.predict_engine_modules`, the facts a live
worker reports, a test compares the two), and the live transports build theirs with `live_plan` from the holdings
the trainer ranks gathered and the layouts the live workers reported. Both are derived from the bridge's one mapping
per architecture, so there is no second tensor table. `megarl plan` takes its per-GPU bytes from here.

    python -m megarl.sync.plan --hf-config config.json --tp 8 --pp 2 --world 128 --engine-tp 8
    python -m megarl.sync.plan --hf-config config.json --tp 8 --world 64 --engine-tp 8 --replicas 4 --separate
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping as TMapping, Optional

from megarl.bridge.hf_config import spec_from_dict
from megarl.bridge.mapping import Mapping, padded_vocab_size
from megarl.sync.boxes import box_numel
from megarl.sync.moves import plan_moves, traffic
from megarl.sync.shards import SyncTable, engine_needs, layout_owners, predict_engine_modules, trainer_holdings

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass
class SyncPlan:
    """Who sends which piece of which HF tensor to which engine worker's host rank, and the bytes that makes. A live
    plan (`live_plan`) leaves tp, pp, ep and engine_ep None: its holdings and needs are what the ranks and workers
    reported."""

    mapping: Mapping
    tp: Optional[int]
    pp: Optional[int]
    ep: Optional[int]
    world: int
    engine_tp: int
    engine_ep: Optional[int]
    replicas: int
    element_bytes: int
    holdings: dict
    moves: list
    separate: bool = False  # engines on GPUs of their own: engine GPU i is receiver world + i

    @property
    def total_bytes(self) -> int:
        """The model's bytes (one copy)."""
        return sum(box_numel(tuple((0, n) for n in shape)) for shape in self.mapping.hf_shapes().values()) \
            * self.element_bytes

    def traffic(self) -> tuple:
        """({rank: bytes sent}, {rank: bytes received from other ranks}, {rank: bytes its engine worker loads})."""
        return traffic(self.moves)

    def held_bytes(self) -> tuple:
        """({rank: dense parameter bytes}, {rank: expert parameter bytes}) each trainer rank holds."""
        dense: dict = {r: 0 for r in range(self.world)}
        expert: dict = {r: 0 for r in range(self.world)}
        for hf_name, held in self.holdings.items():
            into = expert if ".experts." in hf_name else dense
            for rank, box in held:
                into[rank] += box_numel(box) * self.element_bytes
        return dense, expert

    def _name(self, r: int) -> str:
        return f"rank {r}" if r < self.world else f"engine {r - self.world}"

    def summary(self, per_tensor: bool = False) -> str:
        gib = 1024 ** 3
        sent, received, loaded = self.traffic()
        engines = self.replicas * self.engine_tp
        where = f"on {engines} GPUs of their own" if self.separate else f"({engines} trainer ranks generate)"
        trainer = f"TP{self.tp} PP{self.pp} EP{self.ep} " if self.tp is not None else ""
        engine = f"TP{self.engine_tp}" + (f" EP{self.engine_ep}" if self.engine_ep is not None else "")
        lines = [f"weight sync plan: trainer {trainer}on {self.world} ranks -> "
                 f"{self.replicas} engine replica(s) of {engine} {where}; model "
                 f"{self.total_bytes / gib:.3f} GiB ({self.element_bytes} bytes/element), {len(self.moves)} pieces"]
        ranks = self.world + (engines if self.separate else 0)
        busiest = max(range(ranks), key=lambda r: received.get(r, 0))
        lines.append(f"per sync: busiest receiver {self._name(busiest)} gets {received.get(busiest, 0):,} B from "
                     f"other ranks; largest engine shard {max(loaded.values(), default=0):,} B; no rank gathers the "
                     "model")
        lines.append("rank: sent to other ranks | received from other ranks | loaded into its engine worker")
        show = range(ranks) if ranks <= 16 else sorted({0, busiest, self.world - 1, ranks - 1})
        for r in show:
            lines.append(f"  {self._name(r):>11s}: {sent.get(r, 0):>14,d} B | {received.get(r, 0):>14,d} B | "
                         f"{loaded.get(r, 0):>14,d} B")
        if per_tensor:
            lines.append("tensor: src -> dst box bytes")
            for mv in self.moves:
                lines.append(f"  {mv.hf}: {mv.src} -> {mv.dst} {list(mv.box)} {mv.nbytes}")
        return "\n".join(lines)


def build_plan(hf_config: TMapping[str, Any], tp: int = 1, pp: int = 1, ep: int = 1, world: Optional[int] = None,
               engine_tp: int = 1, engine_ep: int = 1, replicas: Optional[int] = None,
               dtype: str = "bfloat16", separate: bool = False, first_stage: Optional[int] = None,
               last_stage: Optional[int] = None) -> SyncPlan:
    """The sync plan. Colocated engines: `replicas` (default world / engine_tp) replicas whose workers are hosted by
    the first ranks. separate: `replicas` (default 1) replicas on GPUs of their own, engine GPU i being receiver
    world + i (megarl.sync.transports.remote numbers them so)."""
    world = world or tp * pp * ep
    replicas = replicas or (1 if separate else world // engine_tp)
    if not separate and replicas * engine_tp > world:
        raise ValueError(f"{replicas} engine replicas x engine TP {engine_tp} need more than the {world} ranks")
    spec = spec_from_dict(dict(hf_config))
    if (ep > 1 or engine_ep > 1) and not spec.is_moe:
        raise ValueError("ep / engine_ep > 1 needs an MoE model (num_experts > 0)")
    if spec.is_moe and (spec.num_experts % ep or spec.num_experts % engine_ep):
        raise ValueError(f"num_experts={spec.num_experts} must be divisible by ep={ep} and engine_ep={engine_ep}")
    from megarl.layout import stage_layer_counts

    stage_layers = stage_layer_counts(spec.num_layers, pp, first_stage, last_stage)  # ValueError naming the setting
    mapping = Mapping(spec, padded_vocab=padded_vocab_size(spec.vocab_size, tp))
    nbytes = DTYPE_BYTES[dtype]
    holdings = trainer_holdings(mapping, layout_owners(mapping, tp, pp, ep, world, stage_layers))
    per_worker = [engine_needs(mapping, predict_engine_modules(mapping, engine_tp, engine_ep, w))
                  for w in range(engine_tp)]
    first = world if separate else 0
    needs = {first + r * engine_tp + w: per_worker[w] for r in range(replicas) for w in range(engine_tp)}
    moves = plan_moves(mapping.hf_names(), needs, holdings, {h: nbytes for h in mapping.hf_names()})
    return SyncPlan(mapping, tp, pp, ep, world, engine_tp, engine_ep, replicas, nbytes, holdings, moves, separate)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megarl.sync.plan",
                                 description="Print the weight-sync plan from a Megatron layout to engine replicas "
                                 "(colocated, or --separate) for an HF config.json (no weights, no processes).")
    ap.add_argument("--hf-config", required=True, help="path to an HF config.json (or a model directory)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--world", type=int, default=None, help="trainer ranks (default TP*PP*EP)")
    ap.add_argument("--engine-tp", type=int, default=1)
    ap.add_argument("--engine-ep", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=None, help="engine replicas (default: world / engine TP; 1 with "
                    "--separate)")
    ap.add_argument("--separate", action="store_true", help="engines on GPUs of their own (rollout.placement="
                    "separate, Ray mode), not on the trainer's ranks")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--per-tensor", action="store_true", help="also list every piece's source and destination")
    args = ap.parse_args(argv)
    path = args.hf_config if args.hf_config.endswith(".json") else args.hf_config.rstrip("/") + "/config.json"
    try:
        with open(path) as f:
            cfg = json.load(f)
        plan = build_plan(cfg.get("text_config", cfg), args.tp, args.pp, args.ep, args.world, args.engine_tp,
                          args.engine_ep, args.replicas, args.dtype, args.separate)
    except (OSError, KeyError, ValueError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(plan.summary(per_tensor=args.per_tensor))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def live_plan(mapping: Mapping, holdings: dict, needs: dict, element_bytes: dict, world: int, engine_tp: int,
              replicas: int, separate: bool = False) -> SyncPlan:
    """The plan of a live sync (a transport, at start): holdings {hf name: [(rank, box)]} as the trainer ranks
    gathered them, needs {receiver: {hf name: box}} from the layouts the live workers reported, element_bytes {hf
    name: bytes} of what travels."""
    moves = plan_moves(SyncTable.of(mapping).order, needs, holdings, element_bytes)
    common = Counter(element_bytes.values()).most_common(1)[0][0] if element_bytes else 0
    return SyncPlan(mapping, None, None, None, world, engine_tp, None, replicas, common, holdings, moves, separate)
