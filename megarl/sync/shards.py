"""Who holds which part of every HF tensor, and who needs which part: the pure core of the weight sync plan.

Both sides are described in HF coordinates, through the bridge's one mapping per architecture:

* a trainer rank holds, for each megatron tensor of its pipeline stage / expert shard, the HF chunks of its TP shard
  (`Mapping.hf_chunk_range`, vocab padding stripped);
* an engine worker needs, for each HF tensor, the box its vLLM weight loader reads: derived from the facts the live
  worker reports about its modules (`EngineModule` below: padded vocabulary ranges, query heads and replicated KV
  heads per rank, merged column splits, row splits, local experts under expert parallelism). `predict_engine_modules`
  computes the same facts without an engine, for `megarl plan` and `python -m megarl.sync.plan`; a test checks
  the prediction against a live engine.

A box is one (start, stop) pair per dimension of the full HF tensor. `plan_moves` intersects needs with holdings and
picks one source per piece (the receiving rank itself when it holds it, else the least-loaded holder), so that every
engine worker receives exactly its shard and no rank receives or forwards anything else. `bucket_moves` groups the
moves into buckets bounded per receiving rank; a tensor larger than a bucket is cut into row blocks.
"""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping as TMapping, Optional, Sequence

from megarl.bridge.mapping import Mapping

Box = tuple  # ((start, stop), ...) per dimension

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


# ---- boxes ------------------------------------------------------------------------------------------------------
def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def range_box(shape: Sequence[int], rng: Optional[tuple]) -> Box:
    """The box of `(dim, start, stop)` in a tensor of `shape` (None: the whole tensor)."""
    box = list(full_box(shape))
    if rng is not None:
        dim, start, stop = rng
        box[dim] = (int(start), int(stop))
    return tuple(box)


def intersect(a: Box, b: Box) -> Optional[Box]:
    # plain loops: `megarl plan` of a 235B MoE layout calls this about a million times
    out = []
    for (x0, x1), (y0, y1) in zip(a, b):
        lo, hi = (x0 if x0 > y0 else y0), (x1 if x1 < y1 else y1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def box_shape(box: Box) -> tuple:
    return tuple(hi - lo for lo, hi in box)


def relative_slices(box: Box, origin: Box) -> tuple:
    """Slices that select `box` from a tensor covering `origin` (box inside origin)."""
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(box, origin))


def split_rows(box: Box, max_numel: int) -> list:
    """Cut `box` along its first dimension longer than one into blocks of at most max_numel elements (at least one
    row each)."""
    dim = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), 0)
    lo, hi = box[dim]
    row = box_numel(box) // (hi - lo)
    step = max(1, max_numel // max(1, row))
    return [box[:dim] + ((s, min(s + step, hi)),) + box[dim + 1:] for s in range(lo, hi, step)]


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
        if leaf in parts:
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


# ---- moves and buckets ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Move:
    """Piece `box` of HF tensor `hf`, from trainer rank `src` to the rank `dst` that hosts the engine worker needing
    it (src == dst: a local copy)."""

    hf: str
    src: int
    dst: int
    box: Box
    holding: Box  # the box the source holds (the piece is cut from it)
    nbytes: int


def plan_moves(order: Sequence[str], needs: TMapping[int, TMapping[str, Box]], holdings: TMapping[str, list],
               element_bytes: TMapping[str, int]) -> list:
    """Every piece each receiving rank needs, with its source. Deterministic: every rank computes the same list.

    needs: {receiving rank: {hf_name: box}}; holdings: trainer_holdings(...); element_bytes: {hf_name: bytes}."""
    load: dict = {}
    moves = []
    wanted: dict = {}
    for dst in sorted(needs):
        for hf_name, want in needs[dst].items():
            wanted.setdefault(hf_name, []).append((dst, want))
    for hf_name in order:
        distinct: dict = {}  # the tensor's disjoint chunks, each with the ranks holding it
        for rank, box in holdings.get(hf_name, ()):
            distinct.setdefault(box, set()).add(rank)
        distinct = {box: sorted(ranks) for box, ranks in distinct.items()}
        for dst, want in wanted.get(hf_name, ()):
            covered, numel = 0, box_numel(want)
            for held, ranks in distinct.items():
                piece = want if held == want else intersect(want, held)
                if piece is None:
                    continue
                src = dst if dst in ranks else min(ranks, key=lambda r: (load.get(r, 0), abs(r - dst), r))
                size = numel if piece is want else box_numel(piece)
                nbytes = size * element_bytes[hf_name]
                if src != dst:
                    load[src] = load.get(src, 0) + nbytes
                moves.append(Move(hf_name, src, dst, piece, held, nbytes))
                covered += size
                if covered == numel:  # the chunks are disjoint: nothing else intersects
                    break
            if covered != numel:
                raise ValueError(f"{hf_name}: the trainer ranks hold {covered} of the {box_numel(want)} elements "
                                 f"engine rank {dst} needs (box {want}); the layouts do not fit together")
    return moves


def bucket_moves(moves: Sequence[Move], bucket_bytes: int) -> list:
    """Consecutive buckets of moves; each receiving rank gets at most bucket_bytes per bucket. A tensor whose pieces
    for one rank exceed a bucket is cut into row blocks, one bucket or more of its own."""
    by_tensor: dict = {}
    for mv in moves:
        by_tensor.setdefault(mv.hf, []).append(mv)
    buckets, current, fill = [], [], {}
    for group in by_tensor.values():
        need: dict = {}
        for mv in group:
            need[mv.dst] = need.get(mv.dst, 0) + mv.nbytes
        if any(fill.get(d, 0) + b > bucket_bytes for d, b in need.items()) and current:
            buckets.append(current)
            current, fill = [], {}
        if max(need.values()) <= bucket_bytes:
            current.extend(group)
            for d, b in need.items():
                fill[d] = fill.get(d, 0) + b
            continue
        for block in _cut(group, bucket_bytes):  # larger than a bucket: blocks of their own
            buckets.append(block)
    if current:
        buckets.append(current)
    return buckets


def _cut(group: Sequence[Move], bucket_bytes: int) -> list:
    pieces = []
    for mv in group:
        per = mv.nbytes // box_numel(mv.box)
        for box in split_rows(mv.box, max(1, bucket_bytes // per)):
            pieces.append(Move(mv.hf, mv.src, mv.dst, box, mv.holding, box_numel(box) * per))
    blocks, current, fill = [], [], {}
    for mv in pieces:
        if fill.get(mv.dst, 0) + mv.nbytes > bucket_bytes and current:
            blocks.append(current)
            current, fill = [], {}
        current.append(mv)
        fill[mv.dst] = fill.get(mv.dst, 0) + mv.nbytes
    if current:
        blocks.append(current)
    return blocks


def traffic(moves: Iterable[Move]) -> tuple:
    """({rank: bytes sent to other ranks}, {rank: bytes received from other ranks}, {rank: bytes its engine worker
    loads})."""
    sent, received, loaded = {}, {}, {}
    for mv in moves:
        loaded[mv.dst] = loaded.get(mv.dst, 0) + mv.nbytes
        if mv.src != mv.dst:
            sent[mv.src] = sent.get(mv.src, 0) + mv.nbytes
            received[mv.dst] = received.get(mv.dst, 0) + mv.nbytes
    return sent, received, loaded
