"""Who holds which bytes, counted from the bridge mapping's shapes and split rules alone: the layout search's stand-in
for the sync plan (megarl.sync.plan.build_plan), which places every piece of every tensor and takes seconds to
minutes for a 600B MoE model, once per layout.

Per tensor of the mapping (megarl.bridge.mapping.Mapping.entries), with T = trainer TP, E = EP, X = expert TP:
  trainer rank   dense split over TP (rule.tp_dim set): numel / T; dense not split: numel; routed expert: numel / X
                 when split, on EP rank e for experts e*n/E..(e+1)*n/E; the vocabulary on the first (embedding) and
                 last (LM head) stage, / T; the layers on their pipeline stage.
  engine worker  the same rules at engine TP t and engine EP: experts / EP (split over t when engine EP is 1).
  per sync       a colocated worker receives its shard less what its GPU holds of it: the share of its layers that
                 sit on its own pipeline stage when engine and trainer TP agree, nothing otherwise (an upper bound);
                 a separately placed worker receives its whole shard. A trainer GPU sends at most its own holding.
The counts agree with the sync plan's per stage within 1% on the recipes' models (tests/unit/test_plan_search.py); the
plan itself remains what `megarl plan` prints for one layout.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from megarl.bridge.hf_config import spec_from_dict
from megarl.bridge.mapping import VISION_PREFIX, Mapping, padded_vocab_size
from megarl.sync.plan import DTYPE_BYTES

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Profile:
    """Element counts of one model by where they sit: per decoder layer and outside the layers."""

    mapping: Mapping
    split: list  # per layer: dense elements split over TP
    whole: list  # per layer: dense elements every TP rank holds
    expert_split: list  # per layer: routed-expert elements split over expert TP
    expert_whole: list  # per layer: routed-expert elements not split
    vocab: int  # vocab-parallel rows x hidden of one vocabulary matrix (embedding or LM head)
    head: bool  # an untied LM head on the last stage
    tail: int  # final norm and other non-layer elements, on the last stage
    total: int
    expert_total: int
    vision: int = 0  # a vision tower's elements: whole on every TP rank of the first stage (and of an engine)


@lru_cache(maxsize=8)
def _profile(hf_key: str) -> Profile:
    import json

    hf = json.loads(hf_key)
    mapping = Mapping(spec_from_dict(hf))
    spec, shapes = mapping.spec, mapping.hf_shapes()
    n = spec.num_layers
    split, whole, esplit, ewhole = [0] * n, [0] * n, [0] * n, [0] * n
    tail, total, expert_total, vocab, head, vision = 0, 0, 0, 0, False, 0
    for entry in mapping.entries:
        numel = sum(math.prod(shapes[h]) for h in entry.hf)
        total += numel
        if entry.kind == "vocab":
            vocab = numel
            head = head or entry.megatron == "output_layer.weight"
            continue
        if entry.megatron.startswith(VISION_PREFIX):
            vision += numel
            continue
        if entry.layer is None:
            tail += numel
            continue
        if entry.rule.expert:
            expert_total += numel
            (esplit if entry.tp_dim is not None else ewhole)[entry.layer] += numel
        else:
            (split if entry.tp_dim is not None else whole)[entry.layer] += numel
    return Profile(mapping, split, whole, esplit, ewhole, vocab, head, tail, total, expert_total, vision)


def profile(hf: dict) -> Profile:
    import json

    return _profile(json.dumps(hf, sort_keys=True))


def stage_elements(p: Profile, layers: list, tp: int, ep: int, etp: int, first: bool, last: bool) -> tuple:
    """(dense, expert) elements one rank of a stage holding `layers` holds."""
    spec = p.mapping.spec
    dense = sum(p.split[i] // tp + p.whole[i] for i in layers)
    expert = sum(p.expert_split[i] // (ep * etp) + p.expert_whole[i] // ep for i in layers)
    rows = padded_vocab_size(spec.vocab_size, tp) // tp * spec.hidden_size
    dense += rows * (first + (last and p.head)) + (p.tail if last else 0) + (p.vision if first else 0)
    return dense, expert


def counted_weights(hf: dict, pl):
    """A stand-in for megarl.plan.model.Weights of placement `pl`, counted (see the module doc)."""
    p = profile(hf)
    spec = p.mapping.spec
    eb = DTYPE_BYTES[pl.dtype]
    counts = pl.layout.stage_layers(spec.num_layers)
    starts = [sum(counts[:s]) for s in range(pl.pp)]
    etp = pl.layout.expert_tensor
    dense, expert = [], []
    for s in range(pl.pp):
        d, e = stage_elements(p, list(range(starts[s], starts[s] + counts[s])), pl.tp, pl.ep, etp, s == 0,
                              s == pl.pp - 1)
        dense.append(d * eb)
        expert.append(e * eb)
    held = [a + b for a, b in zip(dense, expert)]
    t, eep = pl.engine_tp, pl.engine_ep
    eexp = sum(p.expert_split[i] // (eep * (t if eep == 1 else 1)) + p.expert_whole[i] // eep
               for i in range(spec.num_layers))
    edense = sum(p.split[i] // t + p.whole[i] for i in range(spec.num_layers))
    edense += padded_vocab_size(spec.vocab_size, t) // t * spec.hidden_size * (1 + p.head) + p.tail + p.vision
    shard = (edense + eexp) * eb
    if pl.separate or t != pl.tp:
        received = shard
    else:  # its own stage's layers are already on the GPU
        received = int(shard * (1 - min(counts) / spec.num_layers))
    workers = pl.generating
    sync = SimpleNamespace(mapping=p.mapping, total_bytes=p.total * eb, element_bytes=eb)
    return SimpleNamespace(sync=sync, spec=spec, dense=dense, expert=expert, held=held,
                           sent={0: max(held)}, received={0: received} if workers else {},
                           loaded={0: shard} if workers else {0: 0}, n_params=p.total, n_expert=p.expert_total)
