"""Read a Hugging Face `config.json` into a small typed `ArchSpec`, and check a parallel layout against it.

Everything megarl needs to build a megatron-core GPTModel that computes exactly what the HF model computes is in
`ArchSpec`; everything it cannot reproduce exactly (an unsupported architecture, rope type, activation, bias
layout) is refused here with a `BridgeError` naming the config field, before any weights are read.

Both config dialects are read: transformers < 5 (`rope_theta`, `rope_scaling`) and transformers >= 5
(`rope_parameters`, `num_local_experts` for Qwen3-MoE).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union


class BridgeError(ValueError):
    """A checkpoint, config or layout that megarl cannot convert exactly; the message names the tensor or field."""


def name_sample(names, limit: int = 8) -> str:
    """The first `limit` names, with ' ...' when there are more (error messages about long tensor lists)."""
    names = list(names)
    return f"{names[:limit]}{' ...' if len(names) > limit else ''}"


def problem_report(header: str, problems: list, limit: int = 20) -> str:
    """`header (N problems):` then one problem per indented line, at most `limit` of them."""
    return (f"{header} ({len(problems)} problems):\n  " + "\n  ".join(problems[:limit])
            + ("\n  ..." if len(problems) > limit else ""))


# HF architecture class -> family. A family fixes the tensor names and the per-layer structure.
CAUSAL_LM = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # DeepSeek-V3/R1, Kimi-K2, Moonlight: MLA + sigmoid-routed MoE
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5 / GLM-4.5-Air
}
# Reward / value models: the same backbone with a `score` head (num_labels=1); loadable as critics.
SEQUENCE_CLASSIFICATION = {name.replace("ForCausalLM", "ForSequenceClassification"): fam
                           for name, fam in CAUSAL_LM.items() if fam != "glm4_moe"}  # transformers has no GLM-4.5 one
# Vision-language models: a vision tower whose merged patch embeddings replace the image placeholder tokens of a
# decoder whose rope is multimodal (M-RoPE: temporal / height / width sections of each head's rotary dims).
VISION_LANGUAGE = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Qwen3VLForConditionalGeneration": "qwen3_vl"}
# the causal LM each vision-language family's language model is (its text fields read as that architecture's)
VL_TEXT_ARCHITECTURE = {"qwen2_5_vl": "Qwen2ForCausalLM", "qwen3_vl": "Qwen3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(CAUSAL_LM) + tuple(SEQUENCE_CLASSIFICATION) + tuple(VISION_LANGUAGE)
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe")
# Families whose router is DeepSeek's: sigmoid scores, `e_score_correction_bias` added for the choice only,
# group-limited top-k, renormalised top-k probabilities times routed_scaling_factor, `first_k_dense_replace` dense
# layers, `n_shared_experts` shared experts of moe_intermediate_size each.
SIGMOID_ROUTER_FAMILIES = ("deepseek_v3", "glm4_moe")
# rope types megatron-core 0.16.1 reproduces exactly: "default" (plain), "llama3" (RotaryEmbedding._apply_scaling,
# all four parameters honoured, see megarl.megatron.model), "linear" (seq_len_interpolation_factor).
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# MLA's decoupled rope additionally takes YaRN (megatron-core's YarnRotaryEmbedding inside MultiLatentAttention).
MLA_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (MLA only)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    partial: float = 1.0  # fraction of head_dim that is rotated (GLM-4.5: 0.5); the first dims, non-interleaved
    # M-RoPE (vision-language models): rotary frequency pairs per position axis (temporal, height, width), in that
    # order over the first half of head_dim and again over the second; () for 1D rope
    mrope_section: tuple = ()
    # Qwen3-VL's M-RoPE: frequency pair i rotates by axis i % 3 (height and width while i < 3 x their section),
    # the temporal axis elsewhere, instead of three contiguous runs of pairs
    mrope_interleaved: bool = False


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention sizes (DeepSeek-V2/V3, Kimi-K2). q_lora_rank None: a plain q projection."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the checkpoint's rope dims are in interleaved pairs (false: mapping kind "rope")

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_cache_elements_per_token(self) -> int:
        """Per layer: the compressed latent plus the shared rope key (what vLLM's MLA backends cache)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower of a Qwen2.5-VL or Qwen3-VL checkpoint (its `vision_config`) and the token ids that place its
    output. tower "qwen2_5_vl": RMSNorm, SwiGLU MLP, window attention, a bias-free patch embedding; "qwen3_vl":
    LayerNorm, a GELU MLP, full attention per frame, a patch embedding with bias plus a learned square table of
    position embeddings resampled to each image's grid, and DeepStack mergers whose outputs are added to the first
    language-model layers' outputs at the image tokens."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int  # the blocks' SwiGLU MLP (with biases)
    out_hidden_size: int  # the patch merger's output: the language model's hidden size
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2  # merged tokens are spatial_merge_size**2 patches
    window_size: int = 112  # pixels: windows of window_size // patch_size // spatial_merge_size merged tokens a side
    fullatt_block_indexes: tuple = ()  # blocks attending over the whole image; the others within windows
    rope_theta: float = 10000.0  # the 2D rotary embedding over (row, column) of each patch
    norm_eps: float = 1e-6
    tokens_per_second: int = 4  # video only (temporal M-RoPE positions); images do not use it
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    tower: str = "qwen2_5_vl"
    hidden_act: str = "silu"  # the blocks' MLP activation (qwen3_vl: gelu_pytorch_tanh)
    num_position_embeddings: int = 0  # qwen3_vl: the learned position table, a square grid of this many entries
    deepstack_visual_indexes: tuple = ()  # qwen3_vl: blocks whose output feeds language-model layer 0, 1, ...

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch (a row of pixel_values): channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


@dataclass(frozen=True)
class RouterSpec:
    """DeepSeek-style router (SIGMOID_ROUTER_FAMILIES): sigmoid scores, expert bias for the choice only."""

    expert_bias: bool = True  # `e_score_correction_bias` in the checkpoint
    num_groups: int = 1  # n_group
    group_topk: int = 1  # topk_group
    scaling_factor: float = 1.0  # routed_scaling_factor


@dataclass(frozen=True)
class ArchSpec:
    """What megarl needs to know about one HF decoder-only checkpoint (sizes are of the *unpadded* model)."""

    architecture: str  # the HF class name in config.json "architectures"
    family: str  # llama | mistral | qwen2 | qwen3 | mixtral | qwen3_moe | qwen2_moe
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # explicit `head_dim` when config.json has one, else hidden_size // num_attention_heads
    ffn_hidden_size: int  # dense MLP intermediate size (dense layers of MoE models too)
    vocab_size: int
    max_position_embeddings: int
    rope: RopeSpec = field(default_factory=RopeSpec)
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None  # attention window in tokens (Mistral); None = full causal attention
    torch_dtype: str = "float32"
    score_head: bool = False  # a *ForSequenceClassification checkpoint: `score.weight` [1, hidden] instead of lm_head
    # MoE (num_experts == 0 for dense models)
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True  # renormalise the top-k softmax probabilities (Mixtral: always)
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE shared expert (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE sigmoid gate on the shared expert output
    moe_layers: tuple = ()  # per layer: True where the MLP is a MoE block
    mla: Optional[MLASpec] = None  # multi-latent attention (deepseek_v3); None: grouped-query attention
    router: Optional[RouterSpec] = None  # DeepSeek-style sigmoid router; None: softmax router
    attn_out_bias: bool = False  # o_proj bias (never, today: refused)
    mtp_layers: int = 0  # `num_nextn_predict_layers`: multi-token-prediction layers in the checkpoint, not loaded
    vision: Optional[VisionSpec] = None  # vision-language models: the vision tower (rope.mrope_section set too)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def kv_cache_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, mla_latent: Optional[int],
                             dtype_bytes: int, engine_tp: int = 1) -> int:
    """Bytes of KV cache one token takes on one engine TP rank, across all layers (what vLLM allocates per token).

    Standard attention: 2 (K and V) * layers * max(1, kv_heads // engine_tp) * head_dim * dtype_bytes (KV heads
    split over TP, replicated when TP exceeds them). Multi-latent attention (mla_latent = kv_lora_rank +
    qk_rope_head_dim): layers * mla_latent * dtype_bytes, the compressed latent, whole on every TP rank."""
    if mla_latent is not None:
        return num_layers * mla_latent * dtype_bytes
    return 2 * num_layers * max(1, kv_heads // engine_tp) * head_dim * dtype_bytes


def spec_kv_cache_bytes_per_token(spec: ArchSpec, dtype_bytes: int, engine_tp: int = 1) -> int:
    """kv_cache_bytes_per_token of an ArchSpec."""
    return kv_cache_bytes_per_token(spec.num_layers, spec.num_key_value_heads, spec.head_dim,
                                    spec.mla.kv_cache_elements_per_token() if spec.mla is not None else None,
                                    dtype_bytes, engine_tp)


def _field(cfg: dict, name: str, path: str, default: Any = ..., kinds=(int,)) -> Any:
    if name not in cfg or cfg[name] is None:
        if default is ...:
            raise BridgeError(f"{path}: field '{name}' is missing (required for {cfg.get('architectures')})")
        return default
    value = cfg[name]
    if kinds and not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise BridgeError(f"{path}: field '{name}'={value!r} has type {type(value).__name__}, "
                          f"expected {'/'.join(k.__name__ for k in kinds)}")
    return value


def _rope(cfg: dict, path: str, mla: bool = False, partial_ok: bool = False) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    allowed = MLA_ROPE_TYPES if mla else SUPPORTED_ROPE_TYPES
    if kind not in allowed:
        raise BridgeError(f"{path}: rope scaling type rope_type={kind!r} is not supported by megatron-core's "
                          f"{'MLA rotary embedding' if mla else 'RotaryEmbedding'}; supported: {list(allowed)}")
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial is None:
        partial = 1.0
    if partial != 1.0 and not partial_ok:
        raise BridgeError(f"{path}: partial_rotary_factor={partial} is not supported for {cfg.get('architectures')} "
                          "(only 1.0; GLM-4.5 takes a partial rotary factor)")
    if not 0 < float(partial) <= 1:
        raise BridgeError(f"{path}: partial_rotary_factor={partial} must be in (0, 1]")
    if kind == "default":
        return RopeSpec(theta=float(theta), partial=float(partial))
    if kind == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if key not in params:
                raise BridgeError(f"{path}: rope_scaling.{key} is missing for rope_type='yarn'")
        if params.get("attention_factor") is not None:
            raise BridgeError(f"{path}: rope_scaling.attention_factor={params['attention_factor']} is not supported: "
                              "megatron-core derives YaRN's attention factor from mscale / mscale_all_dim")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale_all_dim and not mscale:
            # HF then scales cos/sin by yarn_mscale(factor); megatron by yarn_mscale(factor, 1) / yarn_mscale(factor,
            # mscale_all_dim): no setting of megatron's reproduces it
            raise BridgeError(f"{path}: rope_scaling.mscale_all_dim={mscale_all_dim} without mscale is not supported")
        return RopeSpec(theta=float(theta), type="yarn", factor=float(params["factor"]),
                        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                        # HF ignores mscale unless mscale_all_dim is set too
                        mscale=float(mscale) if mscale_all_dim else 1.0, mscale_all_dim=float(mscale_all_dim or 0.0),
                        partial=float(partial))
    if "factor" not in params:
        raise BridgeError(f"{path}: rope_scaling.factor is missing for rope_type={kind!r}")
    if kind == "linear":
        return RopeSpec(theta=float(theta), type="linear", factor=float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in params:
            raise BridgeError(f"{path}: rope_scaling.{key} is missing for rope_type='llama3'")
    return RopeSpec(theta=float(theta), type="llama3", factor=float(params["factor"]),
                    low_freq_factor=float(params["low_freq_factor"]),
                    high_freq_factor=float(params["high_freq_factor"]),
                    original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def spec_from_dict(cfg: dict, path: str = "config.json") -> ArchSpec:
    """Parse a config.json dict; raise BridgeError naming the field for anything megarl cannot reproduce."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1:
        raise BridgeError(f"{path}: field 'architectures'={archs!r} must name exactly one architecture; "
                          f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BridgeError(f"{path}: architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
    family = CAUSAL_LM.get(arch) or SEQUENCE_CLASSIFICATION.get(arch) or VISION_LANGUAGE[arch]
    if family in VISION_LANGUAGE.values():
        return _qwen_vl(cfg, path, family)
    score_head = arch in SEQUENCE_CLASSIFICATION
    if score_head and cfg.get("num_labels", len(cfg.get("id2label") or {0: 0})) != 1:
        raise BridgeError(f"{path}: {arch} with num_labels={cfg.get('num_labels', len(cfg.get('id2label') or {}))} "
                          "cannot be a value model; megarl critics need num_labels=1")

    hidden = _field(cfg, "hidden_size", path)
    layers = _field(cfg, "num_hidden_layers", path)
    heads = _field(cfg, "num_attention_heads", path)
    kv_heads = _field(cfg, "num_key_value_heads", path, heads)
    head_dim = _field(cfg, "head_dim", path, None)
    if head_dim is None:
        if hidden % heads:
            raise BridgeError(f"{path}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                              "and there is no explicit head_dim")
        head_dim = hidden // heads
    if heads % kv_heads:
        raise BridgeError(f"{path}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise BridgeError(f"{path}: hidden_act={act!r} is not supported (the bridge maps SwiGLU MLPs: 'silu')")
    # GLM-4.5's attention_bias puts biases on q/k/v only (o_proj has none): megatron's add_qkv_bias
    for flag in (("mlp_bias",) if family == "glm4_moe" else ("attention_bias", "mlp_bias")):
        if cfg.get(flag):
            raise BridgeError(f"{path}: {flag}=true is not supported (megatron adds biases to q/k/v only "
                              "via add_qkv_bias; an o_proj/MLP bias has no exact counterpart here)")
    if family in ("qwen2", "qwen2_moe"):
        qkv_bias = bool(cfg.get("qkv_bias", True))
    else:
        qkv_bias = family == "glm4_moe" and bool(cfg.get("attention_bias", False))
    sliding = None
    if family == "mistral" or cfg.get("use_sliding_window"):
        sliding = cfg.get("sliding_window") or None
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"

    moe: dict = {}
    ffn = _field(cfg, "intermediate_size", path)
    extra: dict = {}
    if family in SIGMOID_ROUTER_FAMILIES:
        moe, extra = _sigmoid_router_moe(cfg, path, family, layers)
        if family == "deepseek_v3":
            extra["mla"] = _mla(cfg, path, heads)
            head_dim = extra["mla"].q_head_dim
            kv_heads = heads  # MLA: every head has its own k/v (from the shared latent)
    elif family in MOE_FAMILIES:
        if family == "mixtral":
            num_experts = _field(cfg, "num_local_experts", path)
            moe_ffn = ffn
            norm_topk = True
            pattern = tuple(True for _ in range(layers))
        else:
            num_experts = cfg.get("num_experts") or _field(cfg, "num_local_experts", path)
            moe_ffn = _field(cfg, "moe_intermediate_size", path)
            norm_topk = bool(cfg.get("norm_topk_prob", False))
            step = _field(cfg, "decoder_sparse_step", path, 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            pattern = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        topk = _field(cfg, "num_experts_per_tok", path)
        if not 0 < topk <= num_experts:
            raise BridgeError(f"{path}: num_experts_per_tok={topk} must be in 1..{num_experts} (num experts)")
        if topk == 1 and norm_topk:
            raise BridgeError(f"{path}: num_experts_per_tok=1 with renormalised top-k (norm_topk_prob / Mixtral) is not "
                              "supported: megatron-core needs moe_router_pre_softmax for top-1, which does not renormalise")
        shared = (cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
        moe = dict(num_experts=num_experts, moe_topk=topk, moe_ffn_hidden_size=moe_ffn, moe_norm_topk_prob=norm_topk,
                   shared_expert_ffn_hidden_size=shared, shared_expert_gate=shared > 0, moe_layers=pattern)
    else:
        moe = dict(moe_layers=tuple(False for _ in range(layers)))

    return ArchSpec(
        architecture=arch, family=family, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, ffn_hidden_size=ffn,
        vocab_size=_field(cfg, "vocab_size", path),
        max_position_embeddings=_field(cfg, "max_position_embeddings", path, 4096),
        rope=_rope(cfg, path, mla=family == "deepseek_v3", partial_ok=family == "glm4_moe"),
        norm_eps=float(_field(cfg, "rms_norm_eps", path, 1e-6, kinds=(int, float))),
        qkv_bias=qkv_bias, qk_layernorm=family in ("qwen3", "qwen3_moe") or (
            family == "glm4_moe" and bool(cfg.get("use_qk_norm", False))),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not score_head,
        sliding_window=sliding, torch_dtype=str(dtype), score_head=score_head, **moe, **extra)


def _qwen_vl(cfg: dict, path: str, family: str) -> ArchSpec:
    """A Qwen2.5-VL or Qwen3-VL config: the language model is Qwen2's (q/k/v bias) or Qwen3's (q/k RMSNorm, an explicit
    head_dim) with M-RoPE (Qwen3-VL's interleaved), read from `text_config` (transformers >= 5) or the top level (older
    Qwen2.5-VL config.json files keep the text fields there)."""
    name = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}[family]
    text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text.update(cfg.get("text_config") or {})
    text["architectures"] = [VL_TEXT_ARCHITECTURE[family]]
    if text.get("use_sliding_window"):
        raise BridgeError(f"{path}: use_sliding_window=true is not supported for {name} (transformers' eager "
                          "attention ignores it too; every released checkpoint has false)")
    hidden, heads = _field(text, "hidden_size", path), _field(text, "num_attention_heads", path)
    if family == "qwen2_5_vl" and (hidden % heads or text.get("head_dim") not in (None, hidden // heads)):
        raise BridgeError(f"{path}: Qwen2.5-VL's attention uses head_dim = hidden_size // num_attention_heads "
                          f"({hidden} // {heads}); head_dim={text.get('head_dim')} does not fit it")
    params = dict(text.get("rope_parameters") or {})
    params.update(text.get("rope_scaling") or {})
    section = params.get("mrope_section")
    if params.get("rope_type", params.get("type")) == "mrope":  # older configs name M-RoPE's default rope "mrope"
        params["rope_type"] = "default"
    params.pop("type", None)
    params.pop("mrope_interleaved", None)  # transformers' Qwen3-VL always interleaves, whatever the flag says
    text["rope_parameters"], text["rope_scaling"] = params, None
    base = spec_from_dict(text, path)
    if not isinstance(section, (list, tuple)) or len(section) != 3 or sum(section) * 2 != base.head_dim:
        raise BridgeError(f"{path}: rope mrope_section={section!r} must be three sizes (temporal, height, width) "
                          f"summing to head_dim / 2 = {base.head_dim // 2}")
    if base.rope.type != "default":
        raise BridgeError(f"{path}: rope_type={base.rope.type!r} with M-RoPE is not supported (only 'default')")
    vision = _vision(cfg.get("vision_config") or {}, cfg, path, base, family)
    tie = bool(cfg.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
    rope = dataclasses.replace(base.rope, mrope_section=tuple(section), mrope_interleaved=family == "qwen3_vl")
    return dataclasses.replace(base, architecture=cfg["architectures"][0], family=family, rope=rope,
                               tie_word_embeddings=tie, vision=vision)


# the vision MLP activations each tower takes (transformers' names)
VISION_ACTIVATIONS = {"qwen2_5_vl": ("silu",), "qwen3_vl": ("gelu_pytorch_tanh", "gelu")}


def _vision(vc: dict, cfg: dict, path: str, lm: ArchSpec, family: str) -> VisionSpec:
    where = f"{path} vision_config"
    qwen3 = family == "qwen3_vl"
    act = vc.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu")
    if act not in VISION_ACTIVATIONS[family]:
        raise BridgeError(f"{where}: hidden_act={act!r} is not supported (the {family} vision MLP takes "
                          f"{list(VISION_ACTIVATIONS[family])})")
    rope = dict(vc.get("rope_parameters") or {})
    spec = VisionSpec(
        depth=_field(vc, "depth", where), hidden_size=_field(vc, "hidden_size", where),
        num_heads=_field(vc, "num_heads", where), intermediate_size=_field(vc, "intermediate_size", where),
        out_hidden_size=_field(vc, "out_hidden_size", where), in_channels=_field(vc, "in_channels", where, 3),
        patch_size=_field(vc, "patch_size", where, 16 if qwen3 else 14),
        temporal_patch_size=_field(vc, "temporal_patch_size", where, 2),
        spatial_merge_size=_field(vc, "spatial_merge_size", where, 2),
        window_size=0 if qwen3 else _field(vc, "window_size", where, 112),
        fullatt_block_indexes=tuple(vc.get("fullatt_block_indexes") or ()),
        rope_theta=float(rope.get("rope_theta", vc.get("rope_theta", 10000.0))),
        tokens_per_second=_field(vc, "tokens_per_second", where, 4),
        image_token_id=_field(cfg, "image_token_id", path, 151655),
        video_token_id=_field(cfg, "video_token_id", path, 151656),
        vision_start_token_id=_field(cfg, "vision_start_token_id", path, 151652),
        tower=family, hidden_act=act,
        num_position_embeddings=_field(vc, "num_position_embeddings", where) if qwen3 else 0,
        deepstack_visual_indexes=tuple(vc.get("deepstack_visual_indexes") or ()) if qwen3 else ())
    if spec.hidden_size % spec.num_heads or spec.head_dim % 4:
        raise BridgeError(f"{where}: hidden_size={spec.hidden_size} / num_heads={spec.num_heads} must give a head_dim "
                          "divisible by 4 (the 2D rotary embedding gives half of it to rows, half to columns)")
    if spec.out_hidden_size != lm.hidden_size:
        raise BridgeError(f"{where}: out_hidden_size={spec.out_hidden_size} must equal the language model's "
                          f"hidden_size={lm.hidden_size} (the merger's output replaces token embeddings)")
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise BridgeError(f"{where}: rope_type={rope.get('rope_type')!r} is not supported (the {family} vision rope "
                          "is 'axial')")
    if qwen3:
        side = math.isqrt(spec.num_position_embeddings)
        if side < 1 or side * side != spec.num_position_embeddings:
            raise BridgeError(f"{where}: num_position_embeddings={spec.num_position_embeddings} must be a square "
                              "(the learned positions are a side x side grid)")
        deep = spec.deepstack_visual_indexes
        if len(set(deep)) != len(deep) or any(not 0 <= i < spec.depth for i in deep) or len(deep) > lm.num_layers:
            raise BridgeError(f"{where}: deepstack_visual_indexes={list(deep)} must be distinct blocks of 0.."
                              f"{spec.depth - 1}, at most num_hidden_layers={lm.num_layers} of them (block i's "
                              "features feed language-model layer i)")
    return spec


def _mla(cfg: dict, path: str, heads: int) -> MLASpec:
    q_lora = _field(cfg, "q_lora_rank", path, None)
    mla = MLASpec(q_lora_rank=q_lora, kv_lora_rank=_field(cfg, "kv_lora_rank", path),
                  qk_nope_head_dim=_field(cfg, "qk_nope_head_dim", path),
                  qk_rope_head_dim=_field(cfg, "qk_rope_head_dim", path), v_head_dim=_field(cfg, "v_head_dim", path),
                  rope_interleave=bool(cfg.get("rope_interleave", True)))
    if mla.qk_rope_head_dim % 2:
        raise BridgeError(f"{path}: qk_rope_head_dim={mla.qk_rope_head_dim} must be even (rope rotates pairs)")
    return mla


def _sigmoid_router_moe(cfg: dict, path: str, family: str, layers: int) -> tuple:
    """The MoE fields of a DeepSeek-V3 / GLM-4.5 config (see SIGMOID_ROUTER_FAMILIES); raises on what megatron-core's
    router cannot reproduce."""
    num_experts = _field(cfg, "n_routed_experts", path)
    topk = _field(cfg, "num_experts_per_tok", path)
    groups = _field(cfg, "n_group", path, 1)
    group_topk = _field(cfg, "topk_group", path, 1)
    if not 1 < topk <= num_experts:
        raise BridgeError(f"{path}: num_experts_per_tok={topk} must be in 2..{num_experts}: megatron-core's sigmoid "
                          "router renormalises the top-k scores only for top-k > 1")
    if not cfg.get("norm_topk_prob", True):
        raise BridgeError(f"{path}: norm_topk_prob=false is not supported: megatron-core's sigmoid router always "
                          "renormalises the top-k scores (every released DeepSeek-V3 / Kimi-K2 / GLM-4.5 uses true)")
    if num_experts % groups or group_topk > groups:
        raise BridgeError(f"{path}: n_group={groups} must divide n_routed_experts={num_experts} and be >= "
                          f"topk_group={group_topk}")
    if groups > 1 and topk // group_topk != 2:
        # HF scores a group by its top-2 experts; megatron-core by its top (topk // topk_group) experts
        raise BridgeError(f"{path}: num_experts_per_tok={topk} // topk_group={group_topk} must be 2 with n_group="
                          f"{groups} > 1: HF scores a group by the sum of its top-2 experts, megatron-core by its top "
                          "(num_experts_per_tok // topk_group) (DeepSeek-V3: 8 // 4)")
    first_dense = _field(cfg, "first_k_dense_replace", path, 0)
    if cfg.get("moe_layer_freq", 1) not in (None, 1):
        raise BridgeError(f"{path}: moe_layer_freq={cfg['moe_layer_freq']} is not supported (transformers builds a MoE "
                          "block in every layer from first_k_dense_replace on; only 1)")
    pattern = tuple(i >= first_dense for i in range(layers))
    shared = _field(cfg, "n_shared_experts", path, 0) or 0
    moe_ffn = _field(cfg, "moe_intermediate_size", path)
    scaling = float(_field(cfg, "routed_scaling_factor", path, 1.0, kinds=(int, float)))
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise BridgeError(f"{path}: topk_method={cfg.get('topk_method')!r} is not supported (only 'noaux_tc': "
                          "sigmoid scores with e_score_correction_bias)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise BridgeError(f"{path}: scoring_func={cfg.get('scoring_func')!r} is not supported (only 'sigmoid')")
    moe = dict(num_experts=num_experts, moe_topk=topk, moe_ffn_hidden_size=moe_ffn, moe_norm_topk_prob=True,
               shared_expert_ffn_hidden_size=shared * moe_ffn, shared_expert_gate=False, moe_layers=pattern)
    extra = dict(router=RouterSpec(expert_bias=True, num_groups=groups, group_topk=group_topk, scaling_factor=scaling),
                 mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))
    return moe, extra


# ----------------------------------------------------------------------------------------------------------------------
# Whole files: a model directory as a download leaves it (config.json, the index, the safetensors shards)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
REDOWNLOAD = "download the file again (an interrupted download leaves it incomplete)"
_MAX_HEADER = 100_000_000  # safetensors refuses larger headers: a bigger length means the file is not safetensors


class ModelFileError(BridgeError):
    """A file of a model directory that is missing, damaged or incomplete; `file`, what is wrong and what to do."""

    def __init__(self, file: Union[str, Path], problem: str, fix: str = REDOWNLOAD):
        self.file, self.problem, self.fix = str(file), problem, fix
        super().__init__(f"{file}: {problem}; {fix}")


def read_config_json(path: Union[str, Path]) -> dict:
    """A config.json (or any model JSON file) as a dict; ModelFileError naming the file when it does not parse."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ModelFileError(path, f"cannot be read ({exc.strerror})", "check the file's permissions") from None
    except ValueError:
        raise ModelFileError(path, "is not text (not valid UTF-8)") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ModelFileError(path, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}, "
                             f"{len(text)} characters)") from None
    if not isinstance(data, dict):
        raise ModelFileError(path, f"holds a JSON {type(data).__name__}, not an object")
    return data


def read_index(path: Union[str, Path]) -> dict:
    """{tensor name: shard file} of a model.safetensors.index.json."""
    weight_map = read_config_json(path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(path, "has no 'weight_map' object of tensor name -> shard file")
    return dict(weight_map)


def check_weight_files(hf_dir: Union[str, Path]) -> None:
    """Raise ModelFileError naming the first damaged weight file of `hf_dir`: an index that does not parse or names
    a shard that is not there, a shard whose header safetensors refuses (truncated, not safetensors) or that lacks
    tensors the index puts in it. Reads headers only. A directory without weights passes (the loader says so)."""
    d = Path(hf_dir)
    index = d / INDEX_FILE
    if not index.is_file():
        for shard in sorted(d.glob("*.safetensors")):
            shard_names(shard)
        return
    by_file: dict = {}
    for name, file in read_index(index).items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        shard = d / file
        if not shard.is_file():
            raise ModelFileError(shard, f"missing: {INDEX_FILE} puts {len(names)} tensor{'s' if len(names) > 1 else ''} in it "
                                 f"(e.g. {names[0]})",
                                 "download it again (or the whole model)")
        absent = sorted(set(names) - shard_names(shard))
        if absent:
            raise ModelFileError(shard, f"lacks {len(absent)} tensors that {INDEX_FILE} puts in it (e.g. "
                                 f"{absent[0]}): the shard and the index come from different downloads",
                                 "download both again")


def shard_names(path: Path) -> set:
    """The tensor names of one safetensors file, through safetensors' own header checks."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(path, _damage(path, exc)) from None


def _damage(path: Path, exc: Exception) -> str:
    """What is wrong with a safetensors file safetensors refused, from its size and its header's data offsets (the
    format: an 8-byte little-endian header length, the JSON header, then the tensors' bytes)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > _MAX_HEADER:
            return f"not a safetensors file ({size} bytes; safetensors: {exc})"
        if 8 + length > size:
            return f"truncated: {size} bytes, shorter than its own {length}-byte header"
        try:
            header = json.loads(fh.read(length))
            end = 8 + length + max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                                   default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"its header does not parse (safetensors: {exc})"
    if size < end:
        return f"truncated: {size} of the {end} bytes its header describes"
    if size > end:
        return f"{size - end} bytes longer than its header describes ({end} bytes)"
    return f"safetensors cannot read it ({exc})"


def load_spec(hf_dir: Union[str, Path]) -> ArchSpec:
    """Read `hf_dir/config.json` into an ArchSpec, after checking that the directory's files are whole
    (check_weight_files): every command that opens a model directory comes here first, so a damaged download is named
    in one line before any weight is read or any rank starts."""
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise BridgeError(f"{path}: not found; point --hf at a Hugging Face model directory (config.json, "
                          "*.safetensors, tokenizer files)")
    cfg = read_config_json(path)
    check_weight_files(hf_dir)
    return spec_from_dict(cfg, str(path))


def check_layout(spec: ArchSpec, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
                 first_stage: Optional[int] = None, last_stage: Optional[int] = None) -> None:
    """Raise BridgeError naming the field when the layout cannot shard this model (megatron's own rules).
    first_stage / last_stage: uneven pipeline stages (megarl.layout.stage_layer_counts)."""
    from megarl.layout import stage_layer_counts

    etp = tp if etp is None else etp
    rules = [
        (tp, "tensor_model_parallel_size", spec.num_attention_heads, "num_attention_heads"),
        (tp, "tensor_model_parallel_size", spec.num_key_value_heads, "num_key_value_heads"),
    ]
    if first_stage is None and last_stage is None:
        rules.append((pp, "pipeline_model_parallel_size", spec.num_layers, "num_hidden_layers"))
    else:
        try:
            stage_layer_counts(spec.num_layers, pp, first_stage, last_stage)
        except ValueError as exc:
            raise BridgeError(str(exc)) from None
    if not all(spec.moe_layers) or not spec.is_moe:
        rules.append((tp, "tensor_model_parallel_size", spec.ffn_hidden_size, "intermediate_size"))
    if spec.is_moe:
        rules.append((ep, "expert_model_parallel_size", spec.num_experts, "num_experts"))
        rules.append((etp, "expert_tensor_parallel_size", spec.moe_ffn_hidden_size, "moe_intermediate_size"))
        if spec.shared_expert_ffn_hidden_size:
            rules.append((tp, "tensor_model_parallel_size", spec.shared_expert_ffn_hidden_size,
                          "shared_expert_intermediate_size"))
    elif ep != 1:
        raise BridgeError(f"expert_model_parallel_size={ep} needs a MoE model; {spec.architecture} is dense")
    if spec.mla is not None:
        # megatron-core's local MLA spec (and megarl's TE one) column-splits the down projections too
        kv_rows = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
        rules.append((tp, "tensor_model_parallel_size", kv_rows, "kv_lora_rank + qk_rope_head_dim"))
        if spec.mla.q_lora_rank is not None:
            rules.append((tp, "tensor_model_parallel_size", spec.mla.q_lora_rank, "q_lora_rank"))
        if tp >= 1 and kv_rows % tp == 0 and not spec.mla.rope_interleave and spec.mla.qk_rope_head_dim > kv_rows // tp:
            raise BridgeError(f"tensor_model_parallel_size={tp} splits the rope rows of kv_a_proj_with_mqa "
                              f"({kv_rows} rows, the last {spec.mla.qk_rope_head_dim} rope): they must stay on one "
                              "TP rank; use a smaller TP")
    for size, size_name, value, value_name in rules:
        if size < 1 or value % size:
            raise BridgeError(f"{size_name}={size} does not divide {value_name}={value}")
    deep = len(spec.vision.deepstack_visual_indexes) if spec.vision is not None else 0
    if deep and pp > 1:  # the layout is valid by now
        first = stage_layer_counts(spec.num_layers, pp, first_stage, last_stage)[0]
        if first < deep:  # the first stage holds the vision tower, so the layers its DeepStack features feed
            raise BridgeError(f"pipeline_model_parallel_size={pp} puts {first} layer(s) on the first stage, but "
                              f"{spec.architecture}'s DeepStack adds image features after layers 0..{deep - 1}, which "
                              f"must be there with the vision tower; use a smaller PP or num_layers_in_first_pipeline_"
                              f"stage >= {deep}")
