"""Which linears get LoRA adapters, by the HF/PEFT names users write, resolved through the bridge mapping (pure).

    targets = resolve_targets(Mapping(spec), LoraSettings(rank=16, alpha=32, target_modules=["q_proj", "v_proj"]))
    targets[0].peft_key("A")   # 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'

One adapter per HF projection: megatron fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`, but the
adapters are PEFT's per-projection ones (q_proj, k_proj, v_proj; gate_proj, up_proj), each with its own A [r, in] and
B [out, r]; routed experts get one adapter per expert and projection. The HF names come from the bridge's one
mapping per architecture, so no second table of names exists.

TP placement follows the base weight: a column-parallel linear (weight split on its output rows) splits B on dim 0
the same way and replicates A; a row-parallel linear (weight split on its input columns) splits A on dim 1 and
replicates B.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from megarl.bridge.mapping import Entry, Mapping

# the HF short names of the projections LoRA can target, and what Mixtral calls its expert projections
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
ALL_LINEAR = "all-linear"
_LINEARS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
PEFT_PREFIX = "base_model.model."


class LoraError(ValueError):
    """A LoRA setting the model cannot honour: the key, the rule it breaks and the fix (str: all three)."""

    def __init__(self, message: str, key: str = "", rule: str = "", fix: str = ""):
        super().__init__(message)
        self.key, self.rule, self.fix = key, rule or message, fix


@dataclass(frozen=True)
class LoraSettings:
    """rank r, alpha (scaling = alpha / r, as PEFT without rslora), dropout on the adapter's input, target modules
    (HF/PEFT short names or "all-linear"), init ("kaiming": PEFT's default, A kaiming-uniform and B zero;
    "gaussian": A ~ N(0, 1/r), B zero) and the seed of that init."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Union[tuple, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    init: str = "kaiming"
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class Target:
    """One adapter: the HF projection `hf_weight` (e.g. model.layers.3.self_attn.k_proj.weight), which is slot
    `slot` of the megatron tensor `entry.megatron`.

    shape (out, in) of the HF weight; parallel: "column" (B split on dim 0 over TP) or "row" (A split on dim 1)."""

    entry: Entry
    slot: int
    hf_weight: str
    projection: str  # canonical short name (q_proj ... down_proj)
    shape: tuple
    parallel: str
    expert: bool = False

    @property
    def module(self) -> str:
        """The HF module name (PEFT's key stem)."""
        return self.hf_weight[: -len(".weight")]

    def peft_key(self, which: str) -> str:
        """PEFT's adapter_model.safetensors key of lora_A ("A") or lora_B ("B") (default adapter, no name)."""
        return f"{PEFT_PREFIX}{self.module}.lora_{which}.weight"

    def shapes(self, rank: int) -> dict:
        out, inp = self.shape
        return {"A": (rank, inp), "B": (out, rank)}

    def split(self) -> tuple:
        """(which matrix is TP-split, its dim): ("B", 0) for column-parallel linears, ("A", 1) for row-parallel."""
        return ("B", 0) if self.parallel == "column" else ("A", 1)


@dataclass
class TargetSet:
    targets: list = field(default_factory=list)

    def by_megatron(self) -> dict:
        """{megatron tensor name: [Target, ...] in slot order}."""
        out: dict = {}
        for t in self.targets:
            out.setdefault(t.entry.megatron, []).append(t)
        return out


def available_projections(mapping: Mapping) -> list:
    """The projections this architecture has (the target_modules it accepts besides "all-linear")."""
    seen = []
    for e in mapping.entries:
        if e.megatron.endswith(_LINEARS):
            for h in e.hf:
                p = _projection(h)
                if p not in seen:
                    seen.append(p)
    return [p for p in PROJECTIONS if p in seen]


def _projection(hf_weight: str) -> str:
    short = hf_weight.split(".")[-2]
    return ALIASES.get(short, short)


def wanted_projections(mapping: Mapping, target_modules) -> set:
    """The canonical projections `target_modules` names; unknown names are refused with the ones that exist."""
    have = available_projections(mapping)
    if target_modules == ALL_LINEAR or (not isinstance(target_modules, str) and ALL_LINEAR in target_modules):
        return set(have)
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    wanted = set()
    for name in target_modules:
        canon = ALIASES.get(name, name)
        if canon not in have:
            rule = (f"{name!r} is not a linear of {mapping.spec.architecture} (it has {have}, or 'all-linear'); the "
                    "LM head and embeddings take no adapters here")
            fix = "use those names, as in PEFT's LoraConfig"
            raise LoraError(f"actor.lora.target_modules: {rule}; {fix}", "actor.lora.target_modules", rule, fix)
        wanted.add(canon)
    if not wanted:
        raise LoraError("actor.lora.target_modules is empty: name at least one projection or 'all-linear'")
    return wanted


def resolve_targets(mapping: Mapping, settings: LoraSettings) -> TargetSet:
    """Every adapter of the model, in HF checkpoint order. Refuses a rank larger than a targeted layer."""
    wanted = wanted_projections(mapping, settings.target_modules)
    if settings.rank < 1:
        raise LoraError(f"actor.lora.rank={settings.rank}: must be >= 1 (0 or no lora section: no adapters)")
    out = TargetSet()
    for e in mapping.entries:
        if not e.megatron.endswith(_LINEARS):
            continue
        parallel = "row" if e.tp_dim == 1 else "column"
        for slot, h in enumerate(e.hf):
            proj = _projection(h)
            if proj not in wanted:
                continue
            shape = tuple(mapping.hf_shape(h))
            if settings.rank > min(shape):
                rule = f"larger than {proj} of {h} {list(shape)} allows (rank at most {min(shape)})"
                fix = f"lower actor.lora.rank or drop {proj!r} from actor.lora.target_modules"
                raise LoraError(f"actor.lora.rank={settings.rank}: {rule}; {fix}", "actor.lora.rank", rule, fix)
            out.targets.append(Target(e, slot, h, proj, shape, parallel, e.rule.expert))
    return out


def adapter_numel(targets: TargetSet, rank: int) -> int:
    """Parameters of all adapters (A and B) of the whole model."""
    return sum(math.prod(s) for t in targets.targets for s in t.shapes(rank).values())


def stage_adapter_numel(targets: TargetSet, rank: int, tp: int, pp: int, ep: int, etp: Optional[int] = None,
                        num_layers: Optional[int] = None) -> list:
    """Adapter parameters one rank of each pipeline stage holds (its TP share, its EP share of the experts), for
    `megarl plan`: [stage 0, ..., stage PP-1]."""
    etp = etp or tp
    per_layer: dict = {}
    for t in targets.targets:
        split_which, dim = t.split()
        size = etp if t.expert else tp
        n = 0
        for which, shape in t.shapes(rank).items():
            shape = list(shape)
            if which == split_which:
                shape[dim] //= size
            n += math.prod(shape)
        if t.expert:
            n /= ep
        layer = t.entry.layer or 0
        per_layer[layer] = per_layer.get(layer, 0) + n
    layers = num_layers or (max(per_layer) + 1 if per_layer else 1)
    per_stage = -(-layers // pp)
    return [int(math.ceil(sum(per_layer.get(i, 0) for i in range(s * per_stage, min(layers, (s + 1) * per_stage)))))
            for s in range(pp)]
