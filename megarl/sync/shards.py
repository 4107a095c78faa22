"""Who holds which part of every HF tensor, and who needs which part: the pure core of the weight sync plan.

Both sides are described in HF coordinates, through the bridge's one mapping per architecture:

* a trainer rank holds, for each megatron tensor of its pipeline stage / expert shard, the HF chunks of its TP shard
  (`Mapping.hf_chunk_range`, vocab padding stripped);
* an engine worker needs, for each HF tensor, the box its vLLM weight loader reads: derived from the facts the live
  worker reports about its modules (`EngineModule` below: padded vocabulary ranges, query heads and replicated KV
  heads per rank, merged column splits, row splits, local experts under expert parallelism). `predict_engine_modules`
  computes the same facts without an engine, for `megarl plan` and `python -m megarl.sync.plan`; a test checks
  the prediction against a live engine.

A box (megarl.sync.boxes) is one (start, stop) pair per dimension of the full HF tensor; megarl.sync.moves pairs
needs with holdings into moves and buckets.
"""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping as TMapping, Optional, Sequence

from megarl.bridge.mapping import VISION_PREFIX, Mapping
from megarl.sync.boxes import Box, box_numel, full_box, range_box

# HF projection names that vLLM fuses into one module (the default of the supported text architectures); a live
# engine reports its own `packed_modules_mapping`, which takes precedence.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it over TP ranks
_EXPERT = re.compile(r"^(?P<module>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_ROW_EXPERT_PROJ = ("down_proj", "w2")
_ROW_MODULES = ("o_proj", "down_proj")
# vLLM's MLA (deepseek_v2.py): the up projections are column-parallel; q_a_proj + kv_a_proj_with_mqa (fused_qkv_a_proj,
# disable_tp) and the latent norms are whole on every rank; no KV heads, so nothing is replicated per head
_MLA_COLUMN_MODULES = ("q_b_proj", "q_proj", "kv_b_proj")


# ---- the mapping's table, computed once --------------------------------------------------------------------------
class SyncTable:
    """The mapping's tensors as the plan reads them, computed once per mapping and handed to every question the plan
    asks (each worker's needs, each rank's holdings): every HF tensor's shape and whole box, the engine module it
    belongs to under a packed-module naming, and the boxes each TP rank of a megatron tensor holds."""

    _tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, mapping: Mapping):
        self.mapping = mapping
        self.order = mapping.hf_names()
        self.shapes = mapping.hf_shapes()
        self.whole = {h: full_box(shape) for h, shape in self.shapes.items()}
        self._modules: dict = {}
        self._held: dict = {}

    @classmethod
    def of(cls, mapping: Mapping) -> "SyncTable":
        table = cls._tables.get(mapping)
        if table is None:
            table = cls._tables[mapping] = cls(mapping)
        return table

    def modules(self, packed: TMapping[str, Sequence[str]]) -> list:
        """[(hf name, engine module, part or expert id, HF projection)] in checkpoint order (module_of, once per
        packed-module naming)."""
        key = tuple(sorted((k, tuple(v)) for k, v in packed.items()))
        rows = self._modules.get(key)
        if rows is None:
            rows = self._modules[key] = [(h,) + module_of(h, packed) for h in self.order]
        return rows

    def held(self, entry, tp_rank: int, tp: int) -> list:
        """The box of each of entry.hf that TP rank `tp_rank` of `tp` holds (vocabulary padding stripped)."""
        key = (entry.megatron, tp_rank, tp)
        boxes = self._held.get(key)
        if boxes is None:
            boxes = self._held[key] = [range_box(self.shapes[h], self.mapping.hf_chunk_range(entry, i, tp_rank, tp))
                                       for i, h in enumerate(entry.hf)]
        return boxes


# ---- the engine side --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineModule:
    """What an engine worker's module reads of the checkpoint (a plain-data mirror of the vLLM layer's attributes).

    kind: vocab | qkv | merged_column | column | row | moe | replicated.
    vocab: the [start, stop) range of real vocabulary rows this rank holds (vLLM pads the vocabulary first).
    heads / kv_heads / kv_replicas / head_size: QKV per rank (kv_replicas > 1: each KV head lives on that many ranks).
    experts: global ids of the experts this rank holds (moe)."""

    kind: str
    tp_rank: int = 0
    tp_size: int = 1
    vocab: tuple = (0, 0)
    heads: int = 0
    kv_heads: int = 0
    kv_replicas: int = 1
    head_size: int = 0
    experts: tuple = ()

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: TMapping) -> "EngineModule":
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


def module_of(hf_name: str, packed: TMapping[str, Sequence[str]]) -> tuple:
    """(engine module name, part index within a packed module or expert id, HF projection name) of an HF tensor."""
    m = _EXPERT.match(hf_name)
    if m:
        return m["module"], int(m["expert"]), m["proj"]
    module, _, _ = hf_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        # vLLM's Qwen-VL models list {"qkv": ["qkv"]}: a tensor the checkpoint already fuses, not a part of one
        if leaf in parts and list(parts) != [fused]:
            return f"{parent}.{fused}", list(parts).index(leaf), leaf
    return module, None, leaf


def need_box(hf_name: str, shape: Sequence[int], mod: Optional[EngineModule], part: Optional[int],
             proj: str, whole: Optional[Box] = None) -> Optional[Box]:
    """The box of an HF tensor that a module reads (None: this rank does not hold it, e.g. an expert elsewhere)."""
    whole = whole or full_box(shape)
    if mod is None or mod.kind == "replicated":
        return whole
    bias = hf_name.endswith(".bias")
    if mod.kind == "vocab":
        start, stop = mod.vocab
        return range_box(shape, (0, start, stop)) if stop > start else None
    if mod.kind == "qkv":
        if part is None:  # a checkpoint tensor already fused q/k/v (the Qwen-VL vision tower's attn.qkv)
            if mod.tp_size == 1:
                return whole
            # each rank reads its rows of q, of k and of v: three row blocks, which one box cannot describe
            raise ValueError(f"{hf_name}: a fused q/k/v checkpoint tensor cannot be split over {mod.tp_size} engine "
                             "ranks yet; run the engine with rollout.tensor_model_parallel_size=1")
        if part == 0:
            rows, index = mod.heads * mod.head_size, mod.tp_rank
        else:
            rows, index = mod.kv_heads * mod.head_size, mod.tp_rank // mod.kv_replicas
        return range_box(shape, (0, index * rows, (index + 1) * rows))
    if mod.kind == "moe":
        if part not in mod.experts:
            return None
        dim = 1 if proj in _ROW_EXPERT_PROJ else 0
    elif mod.kind == "row":
        if bias:
            return whole
        dim = 1
    else:  # column, merged_column: each part split on its output rows
        dim = 0
    per = shape[dim] // mod.tp_size
    return range_box(shape, (dim, mod.tp_rank * per, (mod.tp_rank + 1) * per))


def engine_needs(mapping: Mapping, modules: TMapping[str, EngineModule],
                 packed: Optional[TMapping[str, Sequence[str]]] = None) -> dict:
    """{hf_name: box} an engine worker reads, in HF checkpoint order (tensors it does not hold are absent).

    The engine's LM head of a tied model reads the embedding: the tied head is loaded from `model.embed_tokens.weight`
    by the worker, so it needs no entry of its own."""
    packed = packed or DEFAULT_PACKED
    modules = dict(modules)
    for name, mod in list(modules.items()):  # vLLM 0.32 nests fused experts one level deeper (experts.routed_experts)
        head, sep, _ = name.rpartition(".experts.")
        if sep and mod.kind == "moe":
            modules.setdefault(head + ".experts", mod)
    table = SyncTable.of(mapping)
    out = {}
    for hf_name, module, part, proj in table.modules(packed):
        box = need_box(hf_name, table.shapes[hf_name], modules.get(module), part, proj, table.whole[hf_name])
        if box is not None:
            out[hf_name] = box
    return out


def predict_engine_modules(mapping: Mapping, tp: int, ep: int, rank: int) -> dict:
    """The EngineModule facts a vLLM worker of rank `rank` in an engine of tensor parallel size `tp` (expert parallel
    when ep > 1, which vLLM requires to equal tp) reports, computed from the model's shapes alone."""
    spec = mapping.spec
    if ep > 1 and ep != tp:
        raise ValueError(f"engine expert parallel size {ep} must equal the engine's tensor parallel size {tp} "
                         "(vLLM forms its expert-parallel group from the tensor-parallel ranks)")
    padded = -(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    per_vocab = padded // tp
    vocab = (min(rank * per_vocab, spec.vocab_size), min((rank + 1) * per_vocab, spec.vocab_size))
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    qkv = EngineModule("qkv", rank, tp, heads=heads // tp, kv_heads=max(1, kv // tp),
                       kv_replicas=max(1, tp // kv), head_size=spec.head_dim)
    if ep > 1:
        base, extra = divmod(spec.num_experts, ep)
        first = rank * base + min(rank, extra)
        moe = EngineModule("moe", 0, 1, experts=tuple(range(first, first + base + (rank < extra))))
    else:
        moe = EngineModule("moe", rank, tp, experts=tuple(range(spec.num_experts)))
    out = {}
    for hf_name, module, part, proj in SyncTable.of(mapping).modules(DEFAULT_PACKED):
        leaf = module.rpartition(".")[2]
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[module] = EngineModule("vocab", rank, tp, vocab=vocab)
        elif leaf == "qkv_proj":
            out[module] = qkv
        elif leaf == "gate_up_proj":
            out[module] = EngineModule("merged_column", rank, tp)
        elif leaf in _ROW_MODULES:
            out[module] = EngineModule("row", rank, tp)
        elif spec.mla is not None and leaf in _MLA_COLUMN_MODULES:
            out[module] = EngineModule("column", rank, tp)
        elif module.endswith(".experts"):
            out[module] = moe
    return out


# ---- the trainer side -------------------------------------------------------------------------------------------
def trainer_holdings(mapping: Mapping, owners: TMapping[str, Iterable[tuple]]) -> dict:
    """{hf_name: [(rank, box)]}: the HF chunks each trainer rank holds.

    owners: {megatron name: [(global rank, tp rank, tp size)]}, from the live model (every rank's parameters) or from
    a layout (`layout_owners`)."""
    table = SyncTable.of(mapping)
    out: dict = {}
    for entry in mapping.entries:
        for rank, tp_rank, tp in owners.get(entry.megatron, ()):
            for hf_name, box in zip(entry.hf, table.held(entry, tp_rank, tp)):
                if box_numel(box):
                    out.setdefault(hf_name, []).append((rank, box))
    return out


def layout_owners(mapping: Mapping, tp: int, pp: int, ep: int, world: int,
                  stage_layers: Optional[Sequence[int]] = None) -> dict:
    """{megatron name: [(rank, tp rank, tp size)]} for a megatron layout over `world` ranks, in megatron-core's
    rank order (tp fastest, then expert parallel inside data parallel, then pipeline): rank = t + TP*(d + DP*p) with
    expert-parallel rank d % EP. Layers per stage: `stage_layers` (uneven stages, megarl.layout.stage_layer_counts),
    else split evenly; expert e lives on EP rank e // (experts/EP)."""
    from megarl.layout import layer_stages, stage_layer_counts

    spec = mapping.spec
    dp = world // (tp * pp)
    if dp * tp * pp != world or dp % ep:
        raise ValueError(f"world size {world} does not fit TP{tp} x PP{pp} with EP{ep} dividing DP")
    stage_of = layer_stages(list(stage_layers) if stage_layers else stage_layer_counts(spec.num_layers, pp))
    out: dict = {}
    for entry in mapping.entries:
        if entry.layer is not None:
            stages = [stage_of[entry.layer]]
        elif entry.megatron.startswith("embedding"):
            stages = [0] + ([pp - 1] if spec.tie_word_embeddings and pp > 1 else [])
        elif entry.megatron.startswith(VISION_PREFIX):  # the vision tower feeds the first stage's embeddings
            stages = [0]
        else:
            stages = [pp - 1]
        split = entry.tp_dim is not None and tp > 1
        holders = []
        for p in stages:
            for d in range(dp):
                if entry.expert is not None and d % ep != entry.expert // (spec.num_experts // ep):
                    continue
                for t in range(tp):
                    holders.append((t + tp * (d + dp * p), t if split else 0, tp if split else 1))
        out[entry.megatron] = holders
    return out


def worker_needs(mapping: Mapping, layout: dict) -> dict:
    """{hf name: box} of what one engine worker (its reported layout) reads."""
    return engine_needs(mapping, {k: EngineModule.from_dict(v) for k, v in layout["modules"].items()},
                        layout.get("packed"))
