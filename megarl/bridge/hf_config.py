"""Read a Hugging Face `config.json` into a small typed `ArchSpec`, and check a parallel layout against it.

Everything megarl needs to build a megatron-core GPTModel that computes exactly what the HF model computes is in
`ArchSpec`; everything it cannot reproduce exactly (an unsupported architecture, rope type, activation, bias
layout) is refused here with a `BridgeError` naming the config field, before any weights are read.

Both config dialects are read: transformers < 5 (`rope_theta`, `rope_scaling`) and transformers >= 5
(`rope_parameters`, `num_local_experts` for Qwen3-MoE).
"""
from __future__ import annotations

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
}
# Reward / value models: the same backbone with a `score` head (num_labels=1); loadable as critics.
SEQUENCE_CLASSIFICATION = {name.replace("ForCausalLM", "ForSequenceClassification"): fam
                           for name, fam in CAUSAL_LM.items()}
SUPPORTED_ARCHITECTURES = tuple(CAUSAL_LM) + tuple(SEQUENCE_CLASSIFICATION)
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
# rope types megatron-core 0.16.1 reproduces exactly: "default" (plain), "llama3" (RotaryEmbedding._apply_scaling,
# all four parameters honoured, see megarl.megatron.model), "linear" (seq_len_interpolation_factor).
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Parameters of the HF model (tied embeddings counted once)."""
        from megarl.bridge.mapping import hf_shapes

        return sum(math.prod(s) for s in hf_shapes(self).values())


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


def _rope(cfg: dict, path: str) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise BridgeError(f"{path}: rope scaling type rope_type={kind!r} is not supported by megatron-core's "
                          f"RotaryEmbedding; supported: {list(SUPPORTED_ROPE_TYPES)}")
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise BridgeError(f"{path}: partial_rotary_factor={partial} is not supported (only 1.0)")
    if kind == "default":
        return RopeSpec(theta=float(theta))
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
    family = CAUSAL_LM.get(arch) or SEQUENCE_CLASSIFICATION[arch]
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
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise BridgeError(f"{path}: {flag}=true is not supported (megatron adds biases to q/k/v only "
                              "via add_qkv_bias; an o_proj/MLP bias has no exact counterpart here)")
    if family in ("qwen2", "qwen2_moe"):
        qkv_bias = bool(cfg.get("qkv_bias", True))
    else:
        qkv_bias = False
    sliding = None
    if family == "mistral" or cfg.get("use_sliding_window"):
        sliding = cfg.get("sliding_window") or None
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"

    moe: dict = {}
    ffn = _field(cfg, "intermediate_size", path)
    if family in MOE_FAMILIES:
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
        rope=_rope(cfg, path), norm_eps=float(_field(cfg, "rms_norm_eps", path, 1e-6, kinds=(int, float))),
        qkv_bias=qkv_bias, qk_layernorm=family in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not score_head,
        sliding_window=sliding, torch_dtype=str(dtype), score_head=score_head, **moe)


def load_spec(hf_dir: Union[str, Path]) -> ArchSpec:
    """Read `hf_dir/config.json` into an ArchSpec."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise BridgeError(f"{path}: not found; point --hf at a Hugging Face model directory (config.json, "
                          "*.safetensors, tokenizer files)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BridgeError(f"{path}: not valid JSON: {exc}") from exc
    return spec_from_dict(cfg, str(path))


def check_layout(spec: ArchSpec, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None) -> None:
    """Raise BridgeError naming the field when the layout cannot shard this model (megatron's own rules)."""
    etp = tp if etp is None else etp
    rules = [
        (tp, "tensor_model_parallel_size", spec.num_attention_heads, "num_attention_heads"),
        (tp, "tensor_model_parallel_size", spec.num_key_value_heads, "num_key_value_heads"),
        (pp, "pipeline_model_parallel_size", spec.num_layers, "num_hidden_layers"),
    ]
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
    for size, size_name, value, value_name in rules:
        if size < 1 or value % size:
            raise BridgeError(f"{size_name}={size} does not divide {value_name}={value}")
