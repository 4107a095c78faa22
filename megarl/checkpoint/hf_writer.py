"""Write a Hugging Face model directory from the bridge's export stream, one safetensors shard per bucket.

The directory is written aside (`<out>.tmp`) and renamed when complete, so a crash never leaves a half-written model
where a later run would load it. Non-weight files (config.json, generation_config.json, tokenizer files, chat
template) are copied from the source HF directory.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Sequence

import torch

_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def write_hf_model(buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], source_dir: str | Path,
                   out_dir: str | Path) -> Path:
    """Consume `buckets` of (hf_name, tensor) and write `out_dir` (index + shards + copied config/tokenizer)."""
    from safetensors.torch import save_file

    out, tmp = Path(out_dir), Path(str(out_dir) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[tuple[str, list[str]]] = []
    total = 0
    for i, bucket in enumerate(buckets):
        name = f"model-{i + 1:05d}.safetensors"
        tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        shards.append((name, list(tensors)))
    count = len(shards)
    weight_map = {}
    for i, (name, names) in enumerate(shards):  # rename to the conventional model-0000i-of-0000n pattern
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        (tmp / name).rename(tmp / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for fname in _COPIED:
        if (Path(source_dir) / fname).exists():
            shutil.copy2(Path(source_dir) / fname, tmp / fname)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
