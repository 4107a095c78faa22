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

from megarl.bridge.tiny import tiny_hf_config
from megarl.config import MegarlConfig
from megarl.config.schema import TinyModelSpec
from megarl.config.outputs import data_dir, synthetic_paths

log = logging.getLogger("megarl")

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
    from megarl.data.synthetic import make_chain_dataset
    from megarl.data.synthetic_shapes import make_shapes_dataset
    from megarl.data.synthetic_tool import make_multiply_dataset
    from megarl.data.synthetic_walk import SFT_MIN_STEPS, make_walk_dataset

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
            rows = make_multiply_dataset(n, seed=seeds[split], max_operand=syn.max_operand, split=split,
                                         direct_answer_share=syn.direct_answer_share if split == "sft" else 0.0)
        elif syn.task == "shapes":
            rows = make_shapes_dataset(n, seed=seeds[split], split=split)
        elif syn.task == "walk":
            rows = (make_walk_dataset(n, seed=seeds[split], split=split, slip_share=syn.slip_share,
                                      min_steps=SFT_MIN_STEPS) if split == "sft"
                    else make_walk_dataset(n, seed=seeds[split], split=split))
        elif syn.task == "chain":
            rows = make_chain_dataset(n, seed=seeds[split], max_operand=syn.max_operand,
                                      answer_format=syn.answer_format, split=split,
                                      slip_share=syn.slip_share if split == "sft" else 0.0)
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
    `path` (a vision-language one with the task's image processor)."""
    import torch
    import transformers

    from megarl.bridge.tiny import TINY_VL_ARCHS, VISION_ID_NAMES
    from megarl.data import arithmetic_tokenizer
    from megarl.data.synthetic_shapes import shapes_image_processor, shapes_tokenizer, vision_tokens
    from megarl.data.synthetic_tool import multiply_tokenizer
    from megarl.data.synthetic_walk import walk_tokenizer

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if task == "multiply_tool":
        tokenizer = multiply_tokenizer(str(tmp))
    elif task == "walk":
        tokenizer = walk_tokenizer(str(tmp))
    elif task == "shapes":
        tokenizer = shapes_tokenizer(str(tmp))
    else:
        tokenizer = arithmetic_tokenizer(str(tmp), max_operand=max_operand, task=task)
    vision = spec.architecture in TINY_VL_ARCHS
    if vision != (task == "shapes"):
        raise ValueError(f"model.create_tiny.architecture={spec.architecture} with data.synthetic.task={task}: the "
                         "shapes task needs a vision-language architecture (qwen2_5_vl), and a vision-language one "
                         "the shapes task")
    ids = dict(zip(VISION_ID_NAMES, tokenizer.convert_tokens_to_ids(vision_tokens()))) if vision else None
    config = tiny_hf_config(spec, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                            tokenizer.pad_token_id, vision_token_ids=ids)
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).to(torch.float32)
    model.save_pretrained(str(tmp), safe_serialization=True)
    if vision:
        shapes_image_processor().save_pretrained(str(tmp))
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
