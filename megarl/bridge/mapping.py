"""THE mapping between Hugging Face and megatron-core names and layouts: one table per architecture family.

Import (HF safetensors -> any TP/PP/EP layout), export (any layout -> HF tensors), live weight sync and the merger
all go through `Mapping`; nothing else in megarl knows an HF tensor name.

Names. Megatron names are *global* names in megatron-core's local layer spec: layer `{L}` is the global layer index
(PP offsets already applied), expert `{E}` the global expert id (`ep_rank * num_local_experts + i`). Transformer
Engine spec names (the input norms fused into `linear_qkv` / `linear_fc1`, grouped-GEMM expert weights
`experts.linear_fc1.weight{E}`) are translated to these by `canonical_name`, so the same table serves CPU and GPU.

Layouts. Every TP split of an HF tensor is "chunk r of tp equal chunks along one dim" (`Rule.tp_dim`); the transform
kind says how the chunks of one or more HF tensors make one megatron shard:
  plain    one HF tensor, the shard is the chunk (tp_dim None: replicated, the whole tensor)
  vocab    embedding / lm_head rows: the HF rows are zero-padded to the padded vocab size, then chunked on dim 0
  qkv      [q; k; v] -> linear_qkv, rows grouped per KV group g: [q heads of g, k_g, v_g]. TP splits contiguously
           over groups, so a shard is the same interleave of chunk r of q, k and v.
  gate_up  [gate; up] -> linear_fc1 (SwiGLU): shard r is [chunk r of gate; chunk r of up].
  rope     MLA projections whose rows end in rope dims (per block of `Rule.block` rows, the last qk_rope_head_dim
           rows), for checkpoints with `rope_interleave: false`. megatron-core's MLA always reads the rope dims as
           interleaved pairs (x0, x1), (x2, x3), ... (it de-interleaves before rotating halves, as DeepSeek's own
           checkpoints and HF `rope_interleave: true` do: those map plainly). A half-rotated checkpoint's rope rows
           [a0..a(r/2-1), b0..b(r/2-1)] are stored interleaved: [a0, b0, a1, b1, ...]. The permutation stays inside
           one TP chunk (checked by check_layout).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.bridge.hf_config import ArchSpec, BridgeError

PLAIN, VOCAB, QKV, GATE_UP, ROPE = "plain", "vocab", "qkv", "gate_up", "rope"
LM_HEAD, VALUE_HEAD = "lm", "value"
# Vision-language models: the vision tower's parameters live below this prefix of the first stage's model
# (megarl.megatron.vlm), one HF tensor each, whole on every TP rank (the tower is replicated).
VISION_PREFIX, HF_VISION_PREFIX = "vision_model.", "visual."
# Checkpoint names that differ from the text models' (the language model's below "model.", the tower's below
# "visual."): Qwen3-VL's checkpoints nest both below the joint model
HF_RENAMES = {"qwen3_vl": (("model.", "model.language_model."), ("visual.", "model.visual."))}


@dataclass(frozen=True)
class Rule:
    megatron: str  # megatron name pattern with {L} (global layer) / {E} (global expert)
    hf: tuple  # HF name patterns, in the order the transform takes them
    kind: str = PLAIN
    tp_dim: Optional[int] = None  # dim split over tensor parallelism (of the megatron and of each HF tensor)
    expert: bool = False  # routed-expert weight: sharded over EP, split over the expert-TP group
    block: int = 0  # rope kind: rows per block (a q head, or the whole kv down-projection)


@dataclass(frozen=True)
class Entry:
    """One rule applied to one layer/expert: a megatron tensor and the HF tensors it is made of."""

    rule: Rule
    megatron: str
    hf: tuple
    layer: Optional[int] = None
    expert: Optional[int] = None

    @property
    def kind(self) -> str:
        return self.rule.kind

    @property
    def tp_dim(self) -> Optional[int]:
        return self.rule.tp_dim


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron's vocab padding: the smallest size >= vocab_size divisible by lcm(multiple, tp)."""
    step = math.lcm(max(1, multiple), tp)
    return -(-vocab_size // step) * step


def _attention_rules(spec: ArchSpec) -> list:
    a, m = "model.layers.{L}.self_attn.", "decoder.layers.{L}.self_attention."
    rules = [Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
             Rule(m + "linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), QKV, 0)]
    if spec.qkv_bias:
        rules.append(Rule(m + "linear_qkv.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), QKV, 0))
    if spec.qk_layernorm:
        rules += [Rule(m + "q_layernorm.weight", (a + "q_norm.weight",)),
                  Rule(m + "k_layernorm.weight", (a + "k_norm.weight",))]
    rules += [Rule(m + "linear_proj.weight", (a + "o_proj.weight",), PLAIN, 1),
              Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",))]
    return rules


def _mla_rules(spec: ArchSpec) -> list:
    """DeepSeek-V3 multi-latent attention (megatron-core MLASelfAttention, local-spec names)."""
    a, m = "model.layers.{L}.self_attn.", "decoder.layers.{L}.self_attention."
    mla = spec.mla
    q_kind, kv_kind = (PLAIN, PLAIN) if mla.rope_interleave else (ROPE, ROPE)
    rules = [Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",))]
    if mla.q_lora_rank is None:
        rules.append(Rule(m + "linear_q_proj.weight", (a + "q_proj.weight",), q_kind, 0, block=mla.q_head_dim))
    else:
        rules += [Rule(m + "linear_q_down_proj.weight", (a + "q_a_proj.weight",), PLAIN, 0),
                  Rule(m + "q_layernorm.weight", (a + "q_a_layernorm.weight",)),
                  Rule(m + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), q_kind, 0, block=mla.q_head_dim)]
    rules += [Rule(m + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",), kv_kind, 0,
                   block=mla.kv_lora_rank + mla.qk_rope_head_dim),
              Rule(m + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",)),
              Rule(m + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",), PLAIN, 0),
              Rule(m + "linear_proj.weight", (a + "o_proj.weight",), PLAIN, 1),
              Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",))]
    return rules


def _mlp_rules(mg: str, hf: str, gate: str, up: str, down: str, expert: bool = False) -> list:
    return [Rule(mg + "linear_fc1.weight", (hf + gate, hf + up), GATE_UP, 0, expert),
            Rule(mg + "linear_fc2.weight", (hf + down,), PLAIN, 1, expert)]


def vision_tensors(v) -> dict:
    """{name below VISION_PREFIX: shape} of a vision tower (v: VisionSpec) in checkpoint order: the patch embedding,
    every block, the patch merger (and Qwen3-VL's learned positions and DeepStack mergers)."""
    h, merged, ffn = v.hidden_size, v.hidden_size * v.merge_unit, v.intermediate_size
    out = {"patch_embed.proj.weight": (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)}
    qwen3 = v.tower == "qwen3_vl"
    norm = ("weight", "bias") if qwen3 else ("weight",)  # LayerNorm / RMSNorm
    mlp = ({"linear_fc1": (ffn, h), "linear_fc2": (h, ffn)} if qwen3 else
           {"gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)})
    if qwen3:
        out.update({"patch_embed.proj.bias": (h,), "pos_embed.weight": (v.num_position_embeddings, h)})
    for b in range(v.depth):
        p = f"blocks.{b}."
        out.update({p + f"norm1.{n}": (h,) for n in norm})
        out.update({p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,), p + "attn.proj.weight": (h, h),
                    p + "attn.proj.bias": (h,)})
        out.update({p + f"norm2.{n}": (h,) for n in norm})
        for name, shape in mlp.items():
            out.update({p + f"mlp.{name}.weight": shape, p + f"mlp.{name}.bias": shape[:1]})

    def merger(p: str, norm_width: int, fc1: str, fc2: str, norm_name: str) -> None:
        out.update({p + f"{norm_name}.{n}": (norm_width,) for n in norm})
        out.update({p + f"{fc1}.weight": (merged, merged), p + f"{fc1}.bias": (merged,),
                    p + f"{fc2}.weight": (v.out_hidden_size, merged), p + f"{fc2}.bias": (v.out_hidden_size,)})

    if qwen3:
        merger("merger.", h, "linear_fc1", "linear_fc2", "norm")
        for i in range(len(v.deepstack_visual_indexes)):  # normalised after the 2 x 2 patches are joined
            merger(f"deepstack_merger_list.{i}.", merged, "linear_fc1", "linear_fc2", "norm")
    else:
        merger("merger.", h, "mlp.0", "mlp.2", "ln_q")
    return out


def _vision_entries(spec: ArchSpec) -> list:
    """The vision tower's tensors: one HF tensor each, replicated."""
    out = []
    for n in vision_tensors(spec.vision):
        rule = Rule(VISION_PREFIX + n, (HF_VISION_PREFIX + n,))
        out.append(Entry(rule, rule.megatron, rule.hf))
    return out


def _renamed(entries: list, renames: tuple) -> list:
    """Entries whose HF names start with a renamed prefix, renamed (HF_RENAMES)."""
    def rename(name: str) -> str:
        return next((new + name[len(old):] for old, new in renames if name.startswith(old)), name)

    return [Entry(e.rule, e.megatron, tuple(rename(h) for h in e.hf), e.layer, e.expert) for e in entries]


def _dense_mlp_rules() -> list:
    return _mlp_rules("decoder.layers.{L}.mlp.", "model.layers.{L}.mlp.",
                      "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _moe_rules(spec: ArchSpec) -> list:
    mg = "decoder.layers.{L}.mlp."
    if spec.family == "mixtral":
        hf = "model.layers.{L}.block_sparse_moe."
        rules = [Rule(mg + "router.weight", (hf + "gate.weight",))]
        rules += _mlp_rules(mg + "experts.local_experts.{E}.", hf + "experts.{E}.",
                            "w1.weight", "w3.weight", "w2.weight", expert=True)
        return rules
    hf = "model.layers.{L}.mlp."
    rules = [Rule(mg + "router.weight", (hf + "gate.weight",))]
    if spec.router is not None and spec.router.expert_bias:
        rules.append(Rule(mg + "router.expert_bias", (hf + "gate.e_score_correction_bias",)))
    rules += _mlp_rules(mg + "experts.local_experts.{E}.", hf + "experts.{E}.",
                        "gate_proj.weight", "up_proj.weight", "down_proj.weight", expert=True)
    if spec.shared_expert_ffn_hidden_size:
        shared = "shared_experts." if spec.router is not None else "shared_expert."  # DeepSeek/GLM vs Qwen2-MoE
        rules += _mlp_rules(mg + "shared_experts.", hf + shared,
                            "gate_proj.weight", "up_proj.weight", "down_proj.weight")
        if spec.shared_expert_gate:
            rules.append(Rule(mg + "shared_experts.gate_weight", (hf + "shared_expert_gate.weight",)))
    return rules


class Mapping:
    """The name/layout table of one ArchSpec, expanded over layers and experts, in HF checkpoint order.

    head: "lm" for a policy (lm_head, or nothing when embeddings are tied); "value" for a critic, whose
    `output_layer.weight` [1, hidden] is HF `score.weight` (a *ForSequenceClassification checkpoint).
    padded_vocab: the megatron vocab size (see padded_vocab_size); defaults to the unpadded size.
    """

    def __init__(self, spec: ArchSpec, head: str = LM_HEAD, padded_vocab: Optional[int] = None):
        if head not in (LM_HEAD, VALUE_HEAD):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        self.spec, self.head = spec, head
        self.padded_vocab = padded_vocab or spec.vocab_size
        self._hf_shapes: Optional[dict] = None
        if self.padded_vocab < spec.vocab_size:
            raise BridgeError(f"padded vocab {self.padded_vocab} < vocab_size={spec.vocab_size}")
        entries = [Entry(Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB, 0),
                         "embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
        attention = _mla_rules(spec) if spec.mla is not None else _attention_rules(spec)
        dense, moe = _dense_mlp_rules(), _moe_rules(spec) if spec.is_moe else []
        for layer in range(spec.num_layers):
            for rule in attention + (moe if spec.moe_layers[layer] else dense):
                experts = range(spec.num_experts) if rule.expert else [None]
                for e in experts:
                    fmt = dict(L=layer, E=e)
                    entries.append(Entry(rule, rule.megatron.format(**fmt), tuple(h.format(**fmt) for h in rule.hf),
                                         layer, e))
        entries.append(Entry(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
                             "decoder.final_layernorm.weight", ("model.norm.weight",)))
        if head == VALUE_HEAD:
            entries.append(Entry(Rule("output_layer.weight", ("score.weight",)), "output_layer.weight",
                                 ("score.weight",)))
        elif not spec.tie_word_embeddings:
            entries.append(Entry(Rule("output_layer.weight", ("lm_head.weight",), VOCAB, 0), "output_layer.weight",
                                 ("lm_head.weight",)))
        if spec.vision is not None:
            entries += _vision_entries(spec)
        if spec.family in HF_RENAMES:
            entries = _renamed(entries, HF_RENAMES[spec.family])
        self.entries: list = entries
        self.by_megatron = {e.megatron: e for e in entries}
        self.by_hf = {h: e for e in entries for h in e.hf}

    # ---- names and shapes -------------------------------------------------------------------------------------
    def hf_names(self) -> list:
        """Every HF tensor name of the model, in checkpoint order (layer by layer)."""
        return [h for e in self.entries for h in e.hf]

    def entry(self, megatron_name: str) -> Entry:
        """The entry of a *global, canonical* megatron name (see canonical_name); aliases tied output weights."""
        if megatron_name == "output_layer.weight" and self.head == LM_HEAD and self.spec.tie_word_embeddings:
            return self.by_megatron["embedding.word_embeddings.weight"]
        try:
            return self.by_megatron[megatron_name]
        except KeyError:
            raise BridgeError(f"megatron parameter {megatron_name!r} has no rule in the {self.spec.family} mapping "
                              "(a model built from a different config?)") from None

    def hf_shape(self, hf_name: str) -> tuple:
        s = self.spec
        entry = self.by_hf[hf_name]
        i = entry.hf.index(hf_name)
        name = entry.megatron
        hd, h = s.head_dim, s.hidden_size
        if name.startswith(VISION_PREFIX):
            return vision_tensors(s.vision)[name[len(VISION_PREFIX):]]
        if entry.kind == VOCAB:
            return (s.vocab_size, h)
        if entry.kind == QKV:
            rows = (s.num_attention_heads if i == 0 else s.num_key_value_heads) * hd
            return (rows,) if name.endswith(".bias") else (rows, h)
        if s.mla is not None and ".self_attention." in name:
            return self._mla_shape(name)
        if name.endswith("q_layernorm.weight") or name.endswith("k_layernorm.weight"):
            return (hd,)
        if name.endswith("layernorm.weight"):
            return (h,)
        if name.endswith("linear_proj.weight"):
            return (h, s.num_attention_heads * hd)
        if name.endswith("router.weight"):
            return (s.num_experts, h)
        if name.endswith("router.expert_bias"):
            return (s.num_experts,)
        if name.endswith("gate_weight") or name == "output_layer.weight":
            return (1, h)
        ffn = (s.moe_ffn_hidden_size if entry.rule.expert else
               s.shared_expert_ffn_hidden_size if ".shared_experts." in name else s.ffn_hidden_size)
        if name.endswith("linear_fc1.weight"):
            return (ffn, h)
        if name.endswith("linear_fc2.weight"):
            return (h, ffn)
        raise AssertionError(f"no shape rule for {name}")

    def _mla_shape(self, name: str) -> tuple:
        s, mla = self.spec, self.spec.mla
        n, h = s.num_attention_heads, s.hidden_size
        q_in = h if mla.q_lora_rank is None else mla.q_lora_rank
        shapes = {"linear_q_down_proj.weight": (mla.q_lora_rank, h),
                  "q_layernorm.weight": (mla.q_lora_rank,),
                  "linear_q_up_proj.weight": (n * mla.q_head_dim, q_in),
                  "linear_q_proj.weight": (n * mla.q_head_dim, q_in),
                  "linear_kv_down_proj.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
                  "kv_layernorm.weight": (mla.kv_lora_rank,),
                  "linear_kv_up_proj.weight": (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
                  "linear_proj.weight": (h, n * mla.v_head_dim)}
        return shapes[name.split(".self_attention.")[1]]

    def rope_order(self, entry: Entry, start: int, stop: int) -> Optional[torch.Tensor]:
        """Rope entries: the HF rows, relative to `start`, that megatron rows [start, stop) hold (None: same order).
        Within each block of `entry.rule.block` rows, the last qk_rope_head_dim rows r hold HF rows 0, r/2, 1,
        r/2 + 1, ... of that rope part."""
        if entry.kind != ROPE:
            return None
        block, r = entry.rule.block, self.spec.mla.qk_rope_head_dim
        rows = torch.arange(start, stop)
        off = rows % block
        j = off - (block - r)
        rope = j >= 0
        src = rows.clone()
        jr = j[rope]
        perm = torch.where(jr % 2 == 0, jr // 2, r // 2 + jr // 2)
        src[rope] = rows[rope] - jr + perm
        if bool(((src < start) | (src >= stop)).any()):
            raise BridgeError(f"{entry.hf[0]}: rows {start}:{stop} split its rope dims over TP ranks; choose a TP size "
                              "that keeps the rope rows on one rank")
        return src - start

    def hf_shapes(self) -> dict:
        """{hf name: shape}, computed once (the mapping does not change; planning a large model asks it per rank)."""
        if self._hf_shapes is None:
            self._hf_shapes = {h: self.hf_shape(h) for h in self.hf_names()}
        return dict(self._hf_shapes)

    def megatron_shape(self, entry: Entry, tp: int = 1) -> tuple:
        """Shape of one TP shard of the megatron tensor."""
        shapes = [list(self.hf_shape(h)) for h in entry.hf]
        if entry.kind == VOCAB:
            shapes[0][0] = self.padded_vocab
        full = list(shapes[0])
        if len(shapes) > 1:
            full[0] = sum(s[0] for s in shapes)
        if entry.tp_dim is not None:
            full[entry.tp_dim] //= tp
        return tuple(full)

    # ---- transforms ---------------------------------------------------------------------------------------------
    def hf_chunk_range(self, entry: Entry, i: int, tp_rank: int, tp: int) -> Optional[tuple]:
        """(dim, start, stop) of HF tensor `entry.hf[i]` that TP rank `tp_rank` needs; None = the whole tensor.

        For vocab entries the range is clipped to the real rows (the rest of the shard is zero padding)."""
        if entry.tp_dim is None:
            return None
        n = self.padded_vocab if entry.kind == VOCAB else self.hf_shape(entry.hf[i])[entry.tp_dim]
        if n % tp:
            raise BridgeError(f"{entry.hf[i]}: dim {entry.tp_dim} of size {n} is not divisible by TP={tp}")
        start, stop = tp_rank * n // tp, (tp_rank + 1) * n // tp
        if entry.kind == VOCAB:
            stop = min(stop, self.spec.vocab_size)
            start = min(start, stop)
        return entry.tp_dim, start, stop

    def _chunk_start(self, entry: Entry, tp_rank: int, tp: int) -> int:
        rng = self.hf_chunk_range(entry, 0, tp_rank, tp)
        return 0 if rng is None else rng[1]

    def to_megatron(self, entry: Entry, chunks: list, tp: int = 1, tp_rank: int = 0) -> torch.Tensor:
        """One megatron TP shard from the HF chunks returned by hf_chunk_range (one per entry.hf)."""
        if entry.kind == PLAIN:
            return chunks[0]
        if entry.kind == ROPE:
            start = self._chunk_start(entry, tp_rank, tp)
            return chunks[0][self.rope_order(entry, start, start + chunks[0].shape[0])]
        if entry.kind == VOCAB:
            rows = self.padded_vocab // tp
            chunk = chunks[0]
            if chunk.shape[0] == rows:
                return chunk
            out = chunk.new_zeros((rows,) + tuple(chunk.shape[1:]))
            out[: chunk.shape[0]] = chunk
            return out
        if entry.kind == GATE_UP:
            return torch.cat(chunks, dim=0)
        # qkv: interleave per query group
        q, k, v = chunks
        groups = self.spec.num_key_value_heads // tp
        hd, per = self.spec.head_dim, self.spec.heads_per_group
        tail = tuple(q.shape[1:])
        return torch.cat([q.reshape((groups, per * hd) + tail), k.reshape((groups, hd) + tail),
                          v.reshape((groups, hd) + tail)], dim=1).reshape((-1,) + tail)

    def shard_to_hf(self, entry: Entry, shard: torch.Tensor, tp_rank: int, tp: int) -> list:
        """The HF chunks one megatron TP shard holds: [(hf_name, chunk)], each chunk being the part of that HF tensor
        given by `hf_chunk_range(entry, i, tp_rank, tp)` (the whole tensor when it is None). The inverse of
        `to_megatron` for one shard: live weight sync reshards these chunks without gathering whole tensors."""
        if entry.kind == PLAIN:
            return [(entry.hf[0], shard)]
        if entry.kind == ROPE:
            start = self._chunk_start(entry, tp_rank, tp)
            order = self.rope_order(entry, start, start + shard.shape[0])
            return [(entry.hf[0], shard[torch.argsort(order)])]
        if entry.kind == VOCAB:
            _, start, stop = self.hf_chunk_range(entry, 0, tp_rank, tp)
            return [(entry.hf[0], shard[: stop - start])]
        if entry.kind == GATE_UP:
            gate, up = shard.chunk(2, dim=0)
            return [(entry.hf[0], gate), (entry.hf[1], up)]
        return [(h, t) for h, (_, t) in zip(entry.hf, self._split_qkv(shard, tp))]

    def _qkv_groups(self, shard: torch.Tensor, tp: int) -> tuple:
        """A fused q/k/v shard as [KV groups, rows of a group, ...] (a view) and the (first, end) rows of q, k and v
        within a group."""
        groups = self.spec.num_key_value_heads // tp
        hd, per = self.spec.head_dim, self.spec.heads_per_group
        g = shard.reshape((groups, (per + 2) * hd) + tuple(shard.shape[1:]))
        return g, [(0, per * hd), (per * hd, (per + 1) * hd), ((per + 1) * hd, (per + 2) * hd)]

    def _split_qkv(self, shard: torch.Tensor, tp: int) -> list:
        g, parts = self._qkv_groups(shard, tp)
        tail = tuple(shard.shape[1:])
        return [(name, g[:, lo:hi].reshape((-1,) + tail)) for name, (lo, hi) in zip("qkv", parts)]

    def to_hf(self, entry: Entry, shards: list, views: bool = False) -> list:
        """Full HF tensors [(hf_name, tensor)] from the megatron TP shards of an entry (in TP rank order).

        views: return views of the shards where the layout allows instead of fresh copies: a single shard, or
            shards lying back to back in one buffer joined along dim 0 (q/k/v, gate/up and splits of a later
            dimension still need a copy)."""
        tp = len(shards)

        def cat(parts, dim=0):
            if views and (len(parts) == 1 or (dim == 0 and _back_to_back(parts))):
                return _joined_view(parts)
            return torch.cat(parts, dim=dim)

        if entry.kind == PLAIN:
            full = shards[0] if entry.tp_dim is None else cat(shards, entry.tp_dim)
            return [(entry.hf[0], full)]
        if entry.kind == ROPE:
            full = torch.cat(shards, dim=0)
            return [(entry.hf[0], full[torch.argsort(self.rope_order(entry, 0, full.shape[0]))])]
        if entry.kind == VOCAB:
            return [(entry.hf[0], cat(shards)[: self.spec.vocab_size])]
        if entry.kind == GATE_UP:
            halves = [s.chunk(2, dim=0) for s in shards]
            return [(entry.hf[0], cat([g for g, _ in halves])), (entry.hf[1], cat([u for _, u in halves]))]
        parts = [[t for _, t in self._split_qkv(s, tp)] for s in shards]
        return [(h, cat([p[i] for p in parts])) for i, h in enumerate(entry.hf)]


def _back_to_back(parts: list) -> bool:
    """Contiguous tensors of one storage, each starting where the previous one ends (so dim-0 concatenation is a
    view)."""
    first = parts[0]
    return all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
               and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts) and \
        all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(parts, parts[1:]))


def _joined_view(parts: list) -> torch.Tensor:
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows,) + tuple(first.shape[1:]), first.stride(), first.storage_offset())


def hf_shapes(spec: ArchSpec, head: str = LM_HEAD) -> dict:
    return Mapping(spec, head).hf_shapes()


def num_parameters(spec: ArchSpec) -> int:
    """Parameters of the HF model (tied embeddings counted once)."""
    return sum(math.prod(s) for s in hf_shapes(spec).values())


# ---- megatron parameter names ----------------------------------------------------------------------------------
_TE_RENAMES = (
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_weight$"), ".input_layernorm.weight"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_weight$"), ".pre_mlp_layernorm.weight"),
    (re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$"), r".mlp.experts.local_experts.\2.\1.weight"),
    # MLA: the TE spec fuses the q/kv latent norms into the up projections
    (re.compile(r"\.self_attention\.linear_q_up_proj\.layer_norm_weight$"), ".self_attention.q_layernorm.weight"),
    (re.compile(r"\.self_attention\.linear_kv_up_proj\.layer_norm_weight$"), ".self_attention.kv_layernorm.weight"),
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def canonical_name(name: str) -> str:
    """Translate a Transformer Engine spec parameter name to the local-spec name used by the tables."""
    for pattern, repl in _TE_RENAMES:
        name = pattern.sub(repl, name)
    return name


def globalize(name: str, layer_offset_of, expert_offset: int) -> str:
    """A rank-local canonical name -> global: `layer_offset_of(local_index) -> global index`, expert + offset."""
    m = _LAYER.match(name)
    if m:
        name = f"decoder.layers.{layer_offset_of(int(m.group(1)))}." + name[m.end():]
    m = _EXPERT.search(name)
    if m:
        name = name[: m.start()] + f".local_experts.{int(m.group(1)) + expert_offset}." + name[m.end():]
    return name
