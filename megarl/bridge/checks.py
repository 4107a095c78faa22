"""`megarl validate` rules of the model a recipe names: where its shape is read from, and whether the bridge converts
its architecture exactly. The layout rules of the other features read the model's shape through `model_shape`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megarl.bridge.hf_config import BridgeError, ModelFileError, check_layout, read_config_json, spec_from_dict
from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig

P = "parallelism."


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a model's config.json that the layout rules need."""

    source: str
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    num_experts: int
    max_position_embeddings: Optional[int]

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str) -> "ModelShape":
        heads = int(cfg.get("num_attention_heads", 0))
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
        return cls(source, heads, int(cfg.get("num_key_value_heads") or heads), int(cfg.get("num_hidden_layers", 0)),
                   int(experts), cfg.get("max_position_embeddings"))


def read_config(path) -> Optional[dict]:
    """config.json as a dict, or None when it is missing or does not parse (validate's path rules name it)."""
    if not path or not Path(path).is_file():
        return None
    try:
        return read_config_json(path)
    except ModelFileError:
        return None


def model_config(cfg: MegarlConfig) -> tuple:
    """(config.json dict, its path) from model.config_path or model.path/config.json; (None, None) if neither (or it
    does not parse: check_paths names the file)."""
    for candidate in (cfg.model.config_path, cfg.model.path and str(Path(cfg.model.path) / "config.json")):
        if candidate and Path(candidate).is_file():
            hf = read_config(candidate)
            return (hf, candidate) if hf is not None else (None, None)
    return None, None


def model_shape(cfg: MegarlConfig) -> Optional[ModelShape]:
    """The model's shape from model.config_path, model.path/config.json, or model.create_tiny; None if unknown."""
    hf, source = model_config(cfg)
    if hf is not None:
        return ModelShape.from_hf_dict(hf, source)
    tiny = cfg.model.create_tiny
    if tiny is not None:
        return ModelShape("model.create_tiny", tiny.num_attention_heads, tiny.num_key_value_heads,
                          tiny.num_hidden_layers, tiny.num_experts, None)
    return None


def check_model_source(cfg: MegarlConfig) -> list[Issue]:
    m = cfg.model
    if m.config_path and not Path(m.config_path).is_file():
        return [Issue("model.config_path", m.config_path, "file not found: the layout checks read the model's shape "
                      "from it", "point it at the model's config.json (e.g. `huggingface-cli download NAME "
                      "config.json --local-dir DIR`), or unset it", keys=("model.config_path",))]
    if not m.path:
        return [Issue("model.path", m.path, "no model given", "set model.path to a Hugging Face model directory",
                      keys=("model.path",))]
    return []  # whether it exists: check_paths


def check_architecture(cfg: MegarlConfig) -> list[Issue]:
    """The checkpoint's architecture and features must be ones megarl's bridge converts exactly (megarl.bridge)."""
    hf, source = model_config(cfg)
    if hf is None:
        return []
    key = "model.config_path" if cfg.model.config_path else "model.path"
    try:
        spec = spec_from_dict(hf.get("text_config", hf), source)
    except BridgeError as exc:
        return [Issue(key, (hf.get("architectures") or [None])[0], str(exc),
                      "use a supported architecture (megarl.bridge.hf_config.SUPPORTED_ARCHITECTURES)", keys=(key,))]
    p = cfg.parallelism
    try:
        # the bridge's own TP rules (e.g. MLA's latent sizes); PP / EP rules are check_model_layout's
        check_layout(spec, p.tensor_model_parallel_size, 1, 1, p.expert_tensor_parallel_size)
    except BridgeError as exc:
        return [Issue(P + "tensor_model_parallel_size", p.tensor_model_parallel_size, f"{exc} ({source})",
                      "pick a TP the model's sizes divide", keys=(P + "tensor_model_parallel_size",))]
    return []
